"""Actor-side CoPE additions, run through OpenRLHF's own ActorPPOTrainer.ppo_train / training_step on CPU.

OpenRLHF's DeepSpeed strategy cannot start here (setup_distributed sets a CUDA device), so the trainers get
a stand-in strategy (plain torch SGD, one rank; tests/ray_cpu_groups.py) and OpenRLHF's own Actor wrapper,
PolicyLoss and NaiveReplayBuffer. The only CUDA call left on this path, ``torch.cuda.current_device()`` (the
device ppo_train moves batches to), is pointed at the CPU. Experiences go through the replay buffer
(split, unpad, collate), so the CoPE fields are also checked to survive it.
"""

import contextlib
import copy
import math
import os

import pytest
import torch
from openrlhf.models import PolicyLoss
from openrlhf.trainer.ppo_utils import NaiveReplayBuffer
from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch, split_experience_batch
from openrlhf.trainer.ray import ppo_actor
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer, PolicyModelActor
from openrlhf.utils.config import hierarchize

from cope_rlhf import actor_forecast
from cope_rlhf.actor import UPDATES_STATE, CoPEActorPPOTrainer, CoPEPolicyModelActor
from cope_rlhf.actor_forwards import CoPEActorMethods
from cope_rlhf.batch_keys import FILTERED_KEY, FORECAST_WEIGHT_KEY, INFO_BETA_KEY, SIGNALS_KEY
from cope_rlhf.advantage import (DEGENERATE_STD, filter_degenerate_groups, group_reward_std, info_gates,
                                 zero_action_mask)
from cope_rlhf.cli.args import build_parser
from cope_rlhf.config import CoPEConfig
from cope_rlhf.turns import unpadded_trajectories
from cope_rlhf.forecast import build_forecast_samples, forecast_weights
from cope_rlhf.info_gain import position_ids_for
from cope_rlhf.temporal_ensemble import TOP_M, collect_members, mixture_target, te_kl, te_lambda
from tests.ray_cpu_groups import StandInStrategy, load_actor
from cope_rlhf.signal_references import (assert_same_top_m, collate_forecast_samples, forecast_nll,
                                     forecast_samples_from_experiences, per_sample_forecast_loss,
                                     per_sample_member_logits, per_turn_info_gain)
from tests.tiny_hf import agent_response, stock_grpo, to_experience

N = 2
LR = 0.005
EPISODES = [
    (["You are in a room. Go to the red ball.", "You see a door.", "Nothing happens.", "The door opens."],
     ["Thought:\nlook.\n\nAction:\nlook around", "Action:\nopen door", "Action:\ntoggle and go through door"]),
    (["Pick up the key.", "You see a key.", "You see a blue key.", "Done."],
     ["Action:\nlook around", "Action:\npick key", "Action:\npick up key"]),
]
REWARDS = [1.0, 0.0, 0.0, 1.0]
AGENT_FUNC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "agent_funcs", "babyai.py")


def cli_args(*argv):
    args = hierarchize(build_parser().parse_args(
        ["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(N),
         "--train.micro_batch_size", "4", "--train.agent_func_path", AGENT_FUNC, *argv]))
    args.actor.eps_clip_low_high = (args.actor.eps_clip, args.actor.eps_clip)  # as OpenRLHF's CLI sets it
    return args


@pytest.fixture
def on_cpu(monkeypatch):
    """ppo_train moves batches to torch.cuda.current_device(); here that is the CPU."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


def make_trainer(cls, args, model_dir, tok, monkeypatch):
    """An ActorPPOTrainer (or subclass) as PolicyModelActor would build it, minus DeepSpeed and CUDA."""
    trainer = object.__new__(cls)
    trainer.strategy, trainer.args, trainer.tokenizer = StandInStrategy(args), args, tok
    trainer.actor = load_actor(model_dir).train()
    trainer.actor_optim = torch.optim.SGD(trainer.actor.parameters(), lr=LR)
    trainer.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.actor_optim, lambda step: 1.0)
    trainer.ema_model, trainer.aux_loss, trainer.max_epochs = None, False, 1
    trainer.micro_train_batch_size, trainer.dataloader_pin_memory = args.train.micro_batch_size, False
    trainer.actor_loss_fn = PolicyLoss(
        clip_eps_low=args.actor.eps_clip_low_high[0], clip_eps_high=args.actor.eps_clip_low_high[1],
        dual_clip=args.actor.dual_clip, token_level_loss=args.actor.loss_agg_mode == "token-mean",
        policy_loss_type=args.actor.policy_loss_type,
    )
    with monkeypatch.context() as m:  # the buffer only records a CUDA device name at construction
        m.setattr(torch.cuda, "current_device", lambda: 0)
        trainer.replay_buffer = NaiveReplayBuffer(args.train.micro_batch_size, 0, True, False, False)
    return trainer


def grpo_batch(tok, model_dir, rewards, episode_of=lambda i: i // N):
    """Multi-turn trajectories (len(rewards) / N prompts x N) with GRPO advantages and rollout log-probs; sample
    i plays EPISODES[episode_of(i)]."""
    e = Experience.concat_experiences(
        [to_experience(agent_response(tok, *EPISODES[episode_of(i)], reward=r)) for i, r in enumerate(rewards)],
        tok.pad_token_id,
    )
    e.index = list(range(len(rewards)))
    e.kl = torch.zeros(e.action_mask.shape)
    stock_grpo([e], N)
    with torch.no_grad():
        e.action_log_probs = load_actor(model_dir)(e.sequences, e.action_mask, e.attention_mask)
    return e


@pytest.fixture(scope="module")
def batch(tok, model_dir):
    return grpo_batch(tok, model_dir, REWARDS)


def te_members(batch, model_dir, tok, args):
    holder = object.__new__(CoPEActorMethods)
    holder.actor, holder.strategy = load_actor(model_dir).eval(), StandInStrategy(args)
    rows = unpadded_trajectories([batch])
    config = CoPEConfig.from_args(args)
    samples = [build_forecast_samples(*rows[p], tok, config.action_forecast_k, row=p) for p in batch.index]
    _, members = holder.cope_frozen_signals(batch.sequences, batch.attention_mask, batch.action_mask, samples,
                                            [rows[p] for p in batch.index], info_gain=False)
    return [m for m, _ in members]


def train_once(trainer, experience):
    """PolicyModelActor.append (the CoPE one for CoPE trainers), then ppo_train, as PolicyModelActor.fit does."""
    torch.manual_seed(0)  # the replay buffer's DataLoader shuffles
    if isinstance(trainer, CoPEActorPPOTrainer):
        actor = object.__new__(CoPEPolicyModelActor.__ray_actor_class__)
        actor.trainer = trainer
        actor.append(copy.deepcopy(experience))
    else:
        trainer.replay_buffer.append(copy.deepcopy(experience))
    status = trainer.ppo_train(kl_ctl=0.0)
    trainer.replay_buffer.clear()
    return status


def params(trainer):
    return {k: v.detach().clone() for k, v in trainer.actor.state_dict().items()}


def test_flags_off_bit_identical(batch, model_dir, tok, monkeypatch, on_cpu):
    args = cli_args()
    stock = make_trainer(ActorPPOTrainer, args, model_dir, tok, monkeypatch)
    cope = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    before = params(stock)
    stock_status, cope_status = train_once(stock, batch), train_once(cope, batch)
    after = params(stock)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the step did move the weights
    assert all(torch.equal(after[k], v) for k, v in params(cope).items())
    assert stock_status == cope_status


def kl_to_q(actor, batch, members, eta):
    """Reference: mean KL(pi || q) over covered tokens, q from the *given* frozen logits per row."""
    kls = []
    with torch.no_grad():
        for b, m in enumerate(members):
            length = int(batch.attention_mask[b].sum())
            logits = actor.model(input_ids=batch.sequences[b : b + 1, :length]).logits[0].float()
            policy = logits[m["positions"] - 1]
            kls.append((policy, m))
    return kls


def te_reference(policy_logits_rows, frozen_rows, eta):
    values = []
    for (policy, m), (frozen, _) in zip(policy_logits_rows, frozen_rows):
        q = mixture_target(frozen, m["probs"], m["ids"], eta)
        values.append(te_kl(policy, q).mean() if len(policy) else torch.zeros(()))
    return torch.stack(values).mean()  # upstream's scale: each trajectory's mean, then the mean over trajectories


def test_te_term_pulls_policy_toward_q(batch, model_dir, tok, monkeypatch, on_cpu):
    args = cli_args("--cope.te_enable", "--cope.te_lambda", "1.0", "--cope.te_warmup_steps", "0")
    members = te_members(batch, model_dir, tok, args)  # the reference: the same weights, in a separate holder
    assert sum(len(m["positions"]) for m in members) > 0
    stock = make_trainer(ActorPPOTrainer, args, model_dir, tok, monkeypatch)
    cope = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    frozen = kl_to_q(cope.actor, batch, members, 0.5)
    expected_kl = te_reference(frozen, frozen, 0.5)
    stock_status = train_once(stock, batch)
    status = train_once(cope, batch)  # append computes the members, under the pre-update weights
    assert status["cope/te_kl"] == pytest.approx(float(expected_kl), rel=1e-4)
    assert status["cope/te_slots"] > 0 and 0 < status["cope/te_slot_coverage"] <= 1
    assert not cope.__dict__.get("cope_signals")  # used for this update, then forgotten
    assert status["policy_loss"] == pytest.approx(stock_status["policy_loss"], rel=1e-5, abs=1e-7)
    kl_stock = te_reference(kl_to_q(stock.actor, batch, members, 0.5), frozen, 0.5)
    kl_cope = te_reference(kl_to_q(cope.actor, batch, members, 0.5), frozen, 0.5)
    assert kl_cope < kl_stock  # the TE term moved the policy toward q beyond what PPO alone did


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_te_scale_is_the_mean_over_trajectories_whatever_the_micro_batch(batch, model_dir, tok, monkeypatch, on_cpu,
                                                                          micro_batch):
    """Upstream's scale: lambda x (each trajectory's mean KL over its covered tokens) averaged over the step's
    trajectories, those without members included. So the update does not depend on how the step is cut into
    micro-batches (this project used to average covered tokens per micro-batch: a trajectory with many covered tokens
    weighed more, and differently in each cut)."""
    members = te_members(batch, model_dir, tok, cli_args("--cope.te_enable"))
    assert len({len(m["positions"]) for m in members}) > 1  # the rows differ in coverage: the two scales differ
    results = {}
    for micro in (len(REWARDS), micro_batch):
        args = cli_args("--cope.te_enable", "--cope.te_lambda", "5.0", "--cope.te_warmup_steps", "0",
                        "--train.micro_batch_size", str(micro))
        trainer = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
        trainer.strategy = AccumulatingStrategy(args, len(REWARDS) // micro)
        results[micro] = train_once(trainer, batch), params(trainer)
    (whole, whole_params), (cut, cut_params) = results[len(REWARDS)], results[micro_batch]
    assert whole["cope/te_kl"] > 0 and cut["cope/te_kl"] > 0
    for name, value in whole_params.items():
        torch.testing.assert_close(cut_params[name], value, atol=1e-6, rtol=1e-4, msg=name)


def test_te_hold_below_keeps_lambda_at_zero_until_members_know_the_action(batch, model_dir, tok, monkeypatch, on_cpu):
    """``--cope.te_hold_below``: while the members' probability of the action taken is below it, lambda is 0
    (``cope/te_held`` 1) and the update is stock GRPO's; above it TE pulls."""
    stock = make_trainer(ActorPPOTrainer, cli_args(), model_dir, tok, monkeypatch)
    train_once(stock, batch)
    for hold, held in ((1.0, True), (1e-9, False)):
        args = cli_args("--cope.te_enable", "--cope.te_lambda", "1.0", "--cope.te_warmup_steps", "0",
                        "--cope.te_hold_below", str(hold))
        cope = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
        status = train_once(cope, batch)
        assert status["cope/te_held"] == float(held)
        assert 0 < status["cope/te_member_prob_valid"] < 1 and status["cope/te_invalid_target_frac"] == 0.0
        same = all(torch.equal(v, params(cope)[k]) for k, v in params(stock).items())
        assert same == held


def varlen_stand_in(module, args, kwargs):
    """CPU stand-in for flash attention's varlen kernel, which --ds.packing_samples relies on (HF's sdpa would let
    the samples of the (1, N) stream attend to each other): the block-causal mask of the position-id restarts."""
    position_ids = kwargs.get("position_ids")
    if kwargs.get("attention_mask") is None and position_ids is not None and position_ids.shape[0] == 1:
        sample = (position_ids[0] == 0).cumsum(0)
        causal = torch.ones(len(sample), len(sample), dtype=torch.bool).tril()
        kwargs["attention_mask"] = (causal & (sample[:, None] == sample[None, :]))[None, None]
    return args, kwargs


def test_te_term_with_packing_samples_equals_padded(batch, model_dir, tok, monkeypatch, on_cpu):
    """--ds.packing_samples: OpenRLHF's Actor runs the micro-batch unpadded as one (1, N) stream; the TE term reads
    its logits there. Same KL, same update as the padded run."""
    args = cli_args("--cope.te_enable", "--cope.te_lambda", "1.0", "--cope.te_warmup_steps", "0")
    results = {}
    for packing in (False, True):
        trainer = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
        trainer.actor.packing_samples = packing
        calls = []
        trainer.actor.model.register_forward_pre_hook(lambda m, a, kw: calls.append(a[0] if a else kw["input_ids"]),
                                                      with_kwargs=True)
        trainer.actor.model.register_forward_pre_hook(varlen_stand_in, with_kwargs=True)
        results[packing] = train_once(trainer, batch), params(trainer), calls
    (padded, padded_params, _), (packed, packed_params, packed_calls) = results[False], results[True]
    assert packed_calls[0].shape[0] == 1  # the packed path did run: one row
    assert packed["cope/te_kl"] == pytest.approx(padded["cope/te_kl"], rel=1e-5)
    for name, value in padded_params.items():
        torch.testing.assert_close(packed_params[name], value, atol=1e-6, rtol=1e-5, msg=name)


def test_frozen_signals_stay_on_the_rank_the_buffer_carries_ids(batch, model_dir, tok, monkeypatch, on_cpu):
    """append computes info gain and the TE members in one packed forward per trajectory; the replay buffer carries
    one per-sample id tensor for them (no lists of objects in info); TE_TRAJ_SUBSAMPLE 0.5 gives members to half the
    trajectories; the ids never reach the log, the signals are forgotten after the update."""
    args = cli_args("--cope.te_enable", "--cope.te_lambda", "0.1", "--cope.te_warmup_steps", "0",
                    "--cope.te_traj_subsample", "0.5", "--cope.info_intrinsic_weight", "0.1")
    trainer = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    actor = object.__new__(CoPEPolicyModelActor.__ray_actor_class__)
    actor.trainer = trainer
    experience = copy.deepcopy(batch)
    experience.info[INFO_BETA_KEY] = info_gates([experience], N, 0.1, 0.05)[0]  # what the maker adds
    dims = mask_dims(trainer.actor.model)
    actor.append(experience)
    assert [d for d, _ in dims] == [4] * 4  # INFO_KL_BATCH 2, TE_MICRO_BATCH_SIZE_PER_GPU 1: a forward per trajectory
    items = trainer.replay_buffer.items
    assert [int(item.info[SIGNALS_KEY]) for item in items] == [0, 1, 2, 3]
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for item in items for v in item.info.values())
    with_members = [i for i, m in trainer.cope_signals.items() if len(m["members"]["positions"])]
    assert len(with_members) == 2  # half of the four trajectories were drawn
    assert all("intrinsic" in m for m in trainer.cope_signals.values())
    torch.manual_seed(0)
    status = trainer.ppo_train(kl_ctl=0.0)
    assert SIGNALS_KEY not in status and INFO_BETA_KEY not in status
    assert status["cope/te_kl"] > 0 and status["cope/te_slots"] > 0 and status["cope/info_turns_scored"] > 0
    assert status["cope/info_reward_mean"] > 0
    assert not trainer.__dict__.get("cope_signals")


def test_te_lambda_zero_is_diagnostic_only(batch, model_dir, tok, monkeypatch, on_cpu):
    args = cli_args("--cope.te_enable", "--cope.te_lambda", "0")
    stock = make_trainer(ActorPPOTrainer, args, model_dir, tok, monkeypatch)
    cope = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    train_once(stock, batch)
    status = train_once(cope, batch)
    assert status["cope/te_kl"] > 0
    assert all(torch.equal(v, params(cope)[k]) for k, v in params(stock).items())


def with_forecast_weights(experience, tok, args):
    """The experience as the maker hands it over with the forecast on (each row's weight), and the samples the actor
    builds from it (the whole-batch reference, cope_rlhf/signal_references.py)."""
    experience = copy.deepcopy(experience)
    config = CoPEConfig.from_args(args)
    experience.info[FORECAST_WEIGHT_KEY] = forecast_weights([experience], tok, config, N)[0][0]
    samples, _ = forecast_samples_from_experiences([copy.deepcopy(experience)], tok, config, N)
    return experience, samples


def forecast_loss_of(actor, samples, tok, coef=1.0):
    ids, attn, mask, weights = collate_forecast_samples(samples, tok.pad_token_id)
    with torch.no_grad():
        logits = actor.model(input_ids=ids, attention_mask=attn, position_ids=position_ids_for(attn)).logits
    return float(forecast_nll(logits, ids, mask, weights, coef))


def test_forecast_pass_lowers_forecast_nll(batch, model_dir, tok, monkeypatch, on_cpu):
    args = cli_args("--cope.action_forecast_enable", "--cope.action_forecast_gate", "all",
                    "--cope.action_forecast_coef", "1.0")
    experience, samples = with_forecast_weights(batch, tok, args)
    assert len(samples) >= 4
    stock = make_trainer(ActorPPOTrainer, args, model_dir, tok, monkeypatch)
    cope = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    train_once(stock, batch)  # the PPO step alone: the weights the forecast pass starts from
    status = train_once(cope, experience)
    before, after = forecast_loss_of(stock.actor, samples, tok), forecast_loss_of(cope.actor, samples, tok)
    assert status["cope/forecast_loss"] == pytest.approx(before, rel=1e-4)
    assert status["cope/forecast_samples_trained"] == len(samples)
    assert status["cope/forecast_samples"] == len(samples)  # the samples built on append
    assert after < before
    assert not cope.__dict__.get("cope_forecast_samples")  # used once, then dropped


# --- The actor's packed signals: the values of the per-turn / per-sample references (cope_rlhf/signal_references.py) ---


def mask_dims(model):
    """Attention-mask rank of every forward of ``model`` (4 = a block mask: the packed path ran), with row counts."""
    seen = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["attention_mask"].dim(), args[0].shape[0])),
        with_kwargs=True,
    )
    return seen


def methods_holder(model_dir, args):
    holder = object.__new__(CoPEActorMethods)
    holder.actor, holder.strategy = load_actor(model_dir).eval(), StandInStrategy(args)
    return holder, mask_dims(holder.actor.model)


def test_frozen_signals_equal_per_turn_references(batch, model_dir, tok):
    """Info gain and TE members through the actor's ``cope_frozen_signals`` (its logits: temperature, keep columns)
    against the references run on the same actor's logits, one forward per turn / per forecast sample."""
    holder, dims = methods_holder(model_dir, cli_args())
    inputs = (batch.sequences, batch.attention_mask, batch.action_mask)
    rows = unpadded_trajectories([batch])
    config = CoPEConfig.from_args(cli_args())
    samples = [build_forecast_samples(*rows[p], tok, config.action_forecast_k, row=p) for p in batch.index]
    trajectories = [rows[p] for p in batch.index]
    (packed, packed_metrics), members = holder.cope_frozen_signals(*inputs, samples, trajectories)
    assert dims and {d for d, _ in dims} == {4}
    naive, _, naive_metrics = per_turn_info_gain(holder._cope_logits, *inputs, config.info_probe_tokens,
                                                 config.info_max_turns)
    assert packed_metrics == pytest.approx(naive_metrics, abs=1e-5) and naive_metrics["cope/info_turns_scored"] > 0
    assert naive.abs().max() > 1e-3
    torch.testing.assert_close(packed, naive, atol=1e-5, rtol=0)
    covered = 0
    for p, (got, got_metrics), row_samples in zip(batch.index, members, samples):
        trimmed, logits = per_sample_member_logits(holder._cope_logits, row_samples)
        targets, probs, ids, counts = collect_members(trimmed, logits, {p: rows[p]}, top_m=TOP_M)
        assert got_metrics == pytest.approx(counts, abs=1e-5)
        assert got["positions"].tolist() == [pos for _, pos in targets]
        assert_same_top_m(got["probs"], got["ids"], probs, ids)
        covered += len(targets)
    assert covered > 0


def test_frozen_signals_refuse_what_cannot_be_packed(batch, model_dir):
    inputs = (batch.sequences, batch.attention_mask, batch.action_mask)
    ring, ring_dims = methods_holder(model_dir, cli_args("--ds.ring_attn_size", "2"))
    with pytest.raises(ValueError, match="ring attention"):
        ring.cope_frozen_signals(*inputs)
    holder, dims = methods_holder(model_dir, cli_args())
    holey = batch.attention_mask.clone()
    holey[0, 2] = 0  # a hole: OpenRLHF's experiences never have one, and no block mask can describe it
    with pytest.raises(ValueError, match="has holes"):
        holder.cope_frozen_signals(batch.sequences, holey, batch.action_mask)
    assert ring_dims == dims == []  # refused before any forward


def test_frozen_signals_share_one_packed_row_per_trajectory(batch, model_dir, tok):
    """Info gain and TE members together: the same values as each alone, from one forward (the four trajectories in
    one packed batch) instead of one for each signal."""
    holder, dims = methods_holder(model_dir, cli_args("--cope.info_kl_batch", "8", "--cope.te_micro_batch_size_per_gpu",
                                                      "8"))
    rows = unpadded_trajectories([batch])
    samples = [build_forecast_samples(*rows[p], tok, CoPEConfig().action_forecast_k, row=p) for p in batch.index]
    trajectories = [rows[p] for p in batch.index]
    inputs = (batch.sequences, batch.attention_mask, batch.action_mask)
    (gain, gain_metrics), members = holder.cope_frozen_signals(*inputs, samples, trajectories)
    assert len(dims) == 1 and {d for d, _ in dims} == {4}
    dims.clear()
    (want_gain, want_metrics), none = holder.cope_frozen_signals(*inputs)
    assert none is None
    torch.testing.assert_close(gain, want_gain, atol=1e-5, rtol=0)
    assert gain_metrics == pytest.approx(want_metrics, abs=1e-5) and want_gain.abs().max() > 1e-3
    none, alone = holder.cope_frozen_signals(*inputs, samples, trajectories, info_gain=False)
    assert none is None
    for (got, got_metrics), (want, want_metrics) in zip(members, alone):
        assert got_metrics == pytest.approx(want_metrics, abs=1e-6) and torch.equal(got["positions"], want["positions"])
        assert_same_top_m(got["probs"], got["ids"], want["probs"], want["ids"])
    assert len(dims) == 2  # apart: info gain's forward, then TE's
    assert sum(len(m["positions"]) for m, _ in members) > 0


class AccumulatingStrategy(StandInStrategy):
    """Stand-in for DeepSpeed's gradient accumulation (which needs CUDA here): backward scales the loss by
    1/gas, the optimizer steps on every gas-th ``optimizer_step`` call."""

    def __init__(self, args, gas: int):
        super().__init__(args)
        self.gas, self.calls = gas, 0
        self.accumulated_gradient = gas  # ppo_train's loss-normalisation window

    def backward(self, loss, model, optimizer) -> None:
        (loss / self.gas).backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model") -> None:
        self.calls += 1
        if self.calls % self.gas == 0:
            super().optimizer_step(optimizer, model, scheduler, name)


@pytest.mark.parametrize("gas", [1, 3])
def test_forecast_step_equals_per_sample_reference(batch, model_dir, tok, monkeypatch, gas):
    """The separate forecast step's loss and update, packed (production) and with the per-sample reference loss
    swapped in; packed micro-batches hold whole trajectories, ``gas`` of them (one a zero-weight stand-in)."""
    args = cli_args("--cope.action_forecast_enable", "--cope.action_forecast_gate", "all",
                    "--cope.action_forecast_coef", "1.0")
    samples, _ = forecast_samples_from_experiences([copy.deepcopy(batch)], tok, CoPEConfig.from_args(args), N)
    results = {}
    for path in ("packed", "reference"):
        trainer = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
        trainer.strategy = AccumulatingStrategy(args, gas)
        trainer.actor.model.gradient_accumulation_steps = lambda: gas  # what DeepSpeed's engine answers
        with monkeypatch.context() as m:
            if path == "reference":  # the model's own attention, one collated row per sample
                m.setattr(trainer, "_cope_attention", lambda: contextlib.nullcontext(None))
                m.setattr(actor_forecast, "forecast_loss", lambda logits_fn, part, coef, build, device:
                          per_sample_forecast_loss(logits_fn, part, coef, tok.pad_token_id, device))
            dims = mask_dims(trainer.actor.model)
            before = params(trainer)
            trainer.cope_forecast_samples = list(samples)
            status = trainer.cope_forecast_step()
        results[path] = status, params(trainer), dims
        assert status["cope/forecast_samples_trained"] == len(samples) >= 4
        assert any(not torch.equal(before[k], v) for k, v in results[path][1].items())
    (packed, packed_params, packed_dims), (naive, naive_params, naive_dims) = results["packed"], results["reference"]
    assert packed["cope/forecast_loss"] == pytest.approx(naive["cope/forecast_loss"], abs=1e-5)
    for name, value in naive_params.items():
        torch.testing.assert_close(packed_params[name], value, atol=1e-5, rtol=0, msg=name)
    assert [rows for _, rows in packed_dims] == ([4] if gas == 1 else [2, 2, 1])  # one row per trajectory
    assert {d for d, _ in packed_dims} == {4} and {d for d, _ in naive_dims} == {2}


# --- GRPO_FILTER_DEGENERATE: filtered samples stay in the buffer (same micro-steps on every rank) ---------------


def mixed_batch(tok, model_dir, rewards):
    """Each group plays both episodes (identical trajectories with opposite advantages would cancel out)."""
    return grpo_batch(tok, model_dir, rewards, episode_of=lambda i: i % len(EPISODES))


def degenerate_rows(experience) -> list:
    """The filter on ``experience`` (advantages of degenerate groups zeroed) and its rows of degenerate groups as
    the rows that leave the loss: these two-group batches are below the filter's keep-the-batch rule (max(2, 10%)
    groups must survive), which tests/test_advantage.py pins; here, what happens to rows that do leave."""
    filter_degenerate_groups([experience], N)
    return [std <= DEGENERATE_STD for std in group_reward_std([experience], N)]


def filtered(tok, model_dir, rewards):
    experience = mixed_batch(tok, model_dir, rewards)
    drops = degenerate_rows(experience)
    experience.action_mask = zero_action_mask(experience.action_mask, drops[0])  # the policy actor's part, on append
    return experience


def finite(status):
    return all(math.isfinite(v) for v in status.values() if isinstance(v, float))


def test_filter_everything_degenerate_trains_nothing(tok, model_dir, monkeypatch, on_cpu):
    """Every group degenerate (common early on, when nothing succeeds): OpenRLHF's own step divides by zero."""
    experience = filtered(tok, model_dir, [1.0, 1.0, 0.0, 0.0])
    assert not experience.action_mask.any()
    args = cli_args("--cope.grpo_filter_degenerate", "--train.micro_batch_size", "2")
    stock = make_trainer(ActorPPOTrainer, args, model_dir, tok, monkeypatch)
    with pytest.raises(ZeroDivisionError):
        train_once(stock, experience)
    cope = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    before = params(cope)
    status = train_once(cope, experience)
    assert finite(status) and status["policy_loss"] == 0.0 and status["ppo_kl"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in params(cope).items())  # zero gradient, plain SGD


def test_filter_empty_micro_batches_equal_training_on_kept_samples(tok, model_dir, monkeypatch, on_cpu):
    """One sample per micro-batch, one window of 4: the two filtered micro-batches change neither the update
    nor the token metrics, against stock OpenRLHF trained on the two kept samples alone."""
    experience = filtered(tok, model_dir, [1.0, 1.0, 0.0, 1.0])
    assert experience.action_mask[:2].sum() == 0 and experience.action_mask[2:].sum(dim=1).min() > 0
    kept = make_experience_batch(split_experience_batch(mixed_batch(tok, model_dir, [1.0, 1.0, 0.0, 1.0]))[2:])
    results = {}
    for name, cls, data, gas in (("cope", CoPEActorPPOTrainer, experience, 4), ("stock", ActorPPOTrainer, kept, 2)):
        args = cli_args("--cope.grpo_filter_degenerate", "--train.micro_batch_size", "1")
        trainer = make_trainer(cls, args, model_dir, tok, monkeypatch)
        trainer.strategy = AccumulatingStrategy(args, gas)
        before = params(trainer)
        results[name] = train_once(trainer, data), params(trainer)
        assert any(not torch.equal(before[k], v) for k, v in results[name][1].items())
    (cope_status, cope_params), (stock_status, stock_params) = results["cope"], results["stock"]
    assert finite(cope_status)
    for key in ("ppo_kl", "ppo_clip_ratio"):
        assert cope_status[key] == pytest.approx(stock_status[key], rel=1e-5, abs=1e-7), key
    # OpenRLHF logs a micro-batch's policy loss as its share of the window's token mean, times gas
    assert cope_status["policy_loss"] / 4 == pytest.approx(stock_status["policy_loss"] / 2, rel=1e-5)
    for name, value in stock_params.items():
        torch.testing.assert_close(cope_params[name], value, atol=1e-6, rtol=1e-5, msg=name)


def append_filtered(tok, model_dir, monkeypatch, rewards, *flags):
    """A trainer with TE on (lambda 1, no warm-up, every trajectory drawn) and ``flags``, handed a two-group batch
    that the filter marked as the maker does; returns (trainer, the rows it marked, whether each row got members)."""
    experience = mixed_batch(tok, model_dir, rewards)
    drops = degenerate_rows(experience)
    experience.info[FILTERED_KEY] = drops[0]  # the maker's mark
    experience.info[INFO_BETA_KEY] = info_gates([experience], N, 0.1, 0.05)[0]  # read only with info gain on
    args = cli_args("--cope.grpo_filter_degenerate", "--cope.te_enable", "--cope.te_lambda", "1.0",
                    "--cope.te_warmup_steps", "0", *flags)
    trainer = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    actor = object.__new__(CoPEPolicyModelActor.__ray_actor_class__)
    actor.trainer = trainer
    actor.append(copy.deepcopy(experience))
    covered = [len(trainer.cope_signals[int(item.info[SIGNALS_KEY])]["members"]["positions"]) > 0
               for item in trainer.replay_buffer.items]
    return trainer, drops[0].tolist(), covered


@pytest.mark.parametrize("rewards", [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
def test_filter_takes_rows_out_of_the_te_term(rewards, tok, model_dir, monkeypatch, on_cpu):
    """A row of a degenerate group leaves TE's term too (not only PPO's): append zeroes its action mask and it gets
    no TE members, so with every group degenerate TE changes no weight; kept rows keep theirs."""
    trainer, drops, covered = append_filtered(tok, model_dir, monkeypatch, rewards, "--train.micro_batch_size", "2")
    assert covered == [not drop for drop in drops]
    before = params(trainer)
    torch.manual_seed(0)
    status = trainer.ppo_train(kl_ctl=0.0)
    assert finite(status)
    if not any(covered):
        assert status["cope/te_slots"] == 0
        assert all(torch.equal(before[k], v) for k, v in params(trainer).items())  # zero gradient, plain SGD
    else:
        assert status["cope/te_slots"] > 0 and status["cope/te_kl"] > 0


def test_filter_with_info_gain_keeps_the_mask_but_gives_no_te_term(tok, model_dir, monkeypatch, on_cpu):
    """With information gain on, a degenerate group's rows keep their action mask (their advantage is the info term
    alone) but, having no extrinsic signal, get no TE members (they used to: TE pulled on rows with zero advantage)."""
    trainer, drops, covered = append_filtered(tok, model_dir, monkeypatch, [1.0, 1.0, 0.0, 1.0],
                                              "--cope.info_intrinsic_weight", "0.1")
    assert all(item.action_mask.any() for item in trainer.replay_buffer.items)  # every mask kept, filtered rows' too
    assert any(drops) and covered == [not drop for drop in drops]


def test_filter_empty_window_without_precomputed_normaliser(tok, model_dir, monkeypatch, on_cpu):
    """training_step called without loss_batch_info (OpenRLHF's dynamic-batch path) on an emptied micro-batch."""
    experience = filtered(tok, model_dir, [1.0, 1.0, 0.0, 0.0])
    args = cli_args("--cope.grpo_filter_degenerate")
    cope = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    status = cope.training_step(copy.deepcopy(experience), 0.0, 0, None)
    assert status["num_action_tokens"] > 0 and float(status["metrics"]["policy_loss"]) == 0.0
    assert all(p.grad is None or not p.grad.isnan().any() for p in cope.actor.parameters())


# --- TE warm-up across a resume: the PPO-update count travels in the DeepSpeed checkpoint's client states ------


class RecordingCheckpointStrategy(StandInStrategy):
    """Stand-in for DeepspeedStrategy.save_ckpt / load_ckpt (which need CUDA here): keeps the client states."""

    saved: dict = {}

    def save_ckpt(self, model, path, tag, max_num, max_mem, client_states, **kwargs) -> None:
        RecordingCheckpointStrategy.saved = dict(client_states)


def test_te_warmup_count_survives_resume(model_dir, tok, monkeypatch):
    args = cli_args("--cope.te_enable", "--cope.te_lambda", "1.0", "--cope.te_warmup_steps", "3")
    before = object.__new__(CoPEPolicyModelActor.__ray_actor_class__)
    before.strategy, before.disable_ds_ckpt, before.save_hf_ckpt = RecordingCheckpointStrategy(args), False, False
    before.actor, before.trainer = load_actor(model_dir), make_trainer(CoPEActorPPOTrainer, args, model_dir, tok,
                                                                       monkeypatch)
    before.trainer.cope_updates = 4
    monkeypatch.setattr(ppo_actor, "torch_dist_barrier_and_cuda_sync", lambda: None)  # one rank, no process group
    before.save_checkpoint("global_step4", {"consumed_samples": 32})
    assert RecordingCheckpointStrategy.saved == {"consumed_samples": 32, UPDATES_STATE: 4}

    def upstream_init(self, *_, **__):  # what PolicyModelActor's own init leaves behind (it needs DeepSpeed, CUDA)
        self.checkpoint_states = dict(RecordingCheckpointStrategy.saved)
        self.trainer = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)

    monkeypatch.setattr(PolicyModelActor.__ray_actor_class__, "init_model_from_pretrained", upstream_init)
    resumed = object.__new__(CoPEPolicyModelActor.__ray_actor_class__)
    resumed.init_model_from_pretrained()
    assert resumed.trainer.cope_updates == 4
    assert te_lambda(resumed.trainer.cope, resumed.trainer.cope_updates) == 1.0  # warm-up (3) is over
    fresh = object.__new__(CoPEPolicyModelActor.__ray_actor_class__)
    RecordingCheckpointStrategy.saved = {}
    fresh.init_model_from_pretrained()
    assert fresh.trainer.cope_updates == 0 and te_lambda(fresh.trainer.cope, 0) == 0.0


@pytest.mark.parametrize("world_size, cores, expected", [(1, 2, 2), (2, 2, 1), (2, 8, 4), (3, 2, 1)])
def test_cpu_ppo_pass_trains_on_the_hosts_cores(world_size, cores, expected, monkeypatch):
    """On CPU, Ray starts each rank with OMP_NUM_THREADS=1 (one logical CPU each); while the policy trains, the engines
    and the reference rank wait, so ``fit`` gives the PPO pass the host's cores shared among the policy ranks, and
    gives the rank its own thread count back afterwards (for its share of make_experience)."""
    seen = []

    class Trainer:
        replay_buffer = []  # fit clears it

        def ppo_train(self, kl_ctl):
            seen.append(torch.get_num_threads())
            return {"policy_loss": 0.0}

    actor = object.__new__(CoPEPolicyModelActor.__ray_actor_class__)
    actor.actor, actor.trainer = torch.nn.Linear(1, 1), Trainer()
    monkeypatch.setattr("cope_rlhf.actor.torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("cope_rlhf.actor.os.cpu_count", lambda: cores)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setattr(ppo_actor.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(ppo_actor.torch.cuda, "synchronize", lambda: None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert actor.fit(0.01) == {"policy_loss": 0.0}
        assert seen == [expected] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)


# --- ACTION_FORECAST_MODE: separate (own optimizer steps, upstream) vs joint (inside PPO's window) ----------------




def adam_update(batch, model_dir, tok, monkeypatch, *flags):
    """Weights moved by one training step (PPO, plus the forecast as ``flags`` say) under Adam, lr 1e-3."""
    args = cli_args(*flags)
    trainer = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    trainer.actor_optim = torch.optim.Adam(trainer.actor.parameters(), lr=1e-3)
    trainer.actor_scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.actor_optim, lambda step: 1.0)
    before = params(trainer)
    experience, _ = with_forecast_weights(batch, tok, args)
    status = train_once(trainer, experience)
    after = params(trainer)
    return torch.cat([(after[k] - before[k]).flatten() for k in before]), status


def test_separate_forecast_step_replays_the_ppo_step_joint_does_not(model_dir, tok, monkeypatch, on_cpu):
    """The momentum effect: a separate Adam step on a forecast gradient scaled to almost nothing (coef 1e-4) still
    moves the weights ~0.67x as far as the PPO step did, in the PPO step's direction (Adam's first and second
    moments carry the PPO gradient). In joint mode the forecast joins the PPO step: the update barely changes."""
    forecast = ["--cope.action_forecast_enable", "--cope.action_forecast_gate", "all",
                "--cope.action_forecast_coef", "1e-4"]
    batch = mixed_batch(tok, model_dir, [1.0, 0.0, 1.0, 0.0])  # each episode wins or loses in both groups
    ppo, _ = adam_update(batch, model_dir, tok, monkeypatch)
    separate, sep_status = adam_update(batch, model_dir, tok, monkeypatch, *forecast)
    joint, joint_status = adam_update(batch, model_dir, tok, monkeypatch, *forecast, "--cope.action_forecast_mode",
                                      "joint")
    extra = separate - ppo
    ratio, cosine = float(extra.norm() / ppo.norm()), float(torch.nn.functional.cosine_similarity(extra, ppo, 0))
    assert ratio > 0.5 and cosine > 0.9, (ratio, cosine)
    assert float((joint - ppo).norm() / ppo.norm()) < 0.1 * ratio
    assert sep_status["cope/forecast_optimizer_steps"] == 1 and joint_status["cope/forecast_optimizer_steps"] == 0
    assert sep_status["cope/forecast_samples_trained"] == joint_status["cope/forecast_samples_trained"] > 0
    assert joint_status["cope/forecast_loss"] > 0


@pytest.mark.parametrize("micro_batch", [4, 2, 1])
def test_joint_mode_adds_the_forecast_gradient_to_the_ppo_step(micro_batch, model_dir, tok, monkeypatch, on_cpu):
    """Joint mode, SGD, one window of 4 / micro_batch micro-steps: the update equals PPO's plus lr * grad(coef *
    L_AF) at the pre-update weights, and the logged policy loss stays OpenRLHF's. The forecast rides in PPO's own
    forward: one model forward per micro-step (the packed rows' layout mask, wider than the micro-batch)."""
    coef = ["--cope.action_forecast_enable", "--cope.action_forecast_gate", "all", "--cope.action_forecast_coef", "0.5"]
    size = ["--train.micro_batch_size", str(micro_batch)]
    args = cli_args(*coef, "--cope.action_forecast_mode", "joint", *size)
    stock = make_trainer(ActorPPOTrainer, cli_args(*size), model_dir, tok, monkeypatch)
    trainer = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    for t in (stock, trainer):
        t.strategy = AccumulatingStrategy(t.args, 4 // micro_batch)
    reference = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    batch = mixed_batch(tok, model_dir, [1.0, 0.0, 1.0, 0.0])  # PPO gradients that do not cancel
    before = params(trainer)
    experience, samples = with_forecast_weights(batch, tok, args)
    stock_status = train_once(stock, batch)
    forwards, heads = [], []  # what the transformer and its LM head are handed, once per forward
    trainer.actor.model.model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append((kwargs["attention_mask"].dim(), *kwargs["input_ids"].shape)),
        with_kwargs=True)
    trainer.actor.model.lm_head.register_forward_pre_hook(lambda module, args: heads.append(args[0].shape[1]))
    status = train_once(trainer, experience)
    assert len(forwards) == len(heads) == 4 // micro_batch
    assert all(dims == 4 and rows == micro_batch for dims, rows, _ in forwards)
    assert sum(width for _, _, width in forwards) > experience.sequences.shape[1] * 4 // micro_batch  # + branches
    # the LM head runs at the trunk's columns and the target-predicting ones, not at the branches' prompts
    assert all(experience.sequences.shape[1] < head < width for head, (_, _, width) in zip(heads, forwards))
    assert status["cope/forecast_samples_trained"] == len(samples) and status["cope/forecast_optimizer_steps"] == 0
    reference.actor.train()
    loss = reference._forecast_share(samples, float(sum(sum(s.loss_mask[1:]) for s in samples)))
    loss.backward()
    grads = {name: p.grad for name, p in reference.actor.named_parameters()}
    assert status["cope/forecast_loss"] == pytest.approx(float(loss), rel=1e-5)
    assert status["policy_loss"] == pytest.approx(stock_status["policy_loss"], rel=1e-5, abs=1e-7)
    moved = params(trainer)
    for name, grad in grads.items():  # (a tied LM head is the embedding: not a parameter of its own)
        grad = torch.zeros_like(moved[name]) if grad is None else grad
        torch.testing.assert_close(moved[name], params(stock)[name] - LR * grad, atol=1e-6, rtol=1e-4, msg=name)
    assert any(not torch.equal(params(trainer)[k], v) for k, v in params(stock).items())
    assert any(not torch.equal(before[k], v) for k, v in params(trainer).items())


def test_sft_mini_batches_and_learning_rate_scale(batch, model_dir, tok, monkeypatch, on_cpu):
    """Separate mode: one optimizer step per SFT_MINI_BATCH_SIZE samples (every rank the same count), at the
    actor's lr times ACTION_FORECAST_LR_SCALE; the lr is restored afterwards."""
    flags = ["--cope.action_forecast_enable", "--cope.action_forecast_gate", "all", "--cope.action_forecast_coef",
             "1.0", "--cope.sft_mini_batch_size", "3"]
    args = cli_args(*flags)
    trainer = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
    trainer.strategy = AccumulatingStrategy(args, 1)
    _, samples = with_forecast_weights(batch, tok, args)
    trainer.cope_forecast_samples = samples
    status = trainer.cope_forecast_step()
    assert status["cope/forecast_optimizer_steps"] == math.ceil(len(samples) / 3) == trainer.strategy.calls
    # lr scale 0: the forecast pass moves nothing (plain SGD keeps no state), and the lr comes back
    frozen = make_trainer(CoPEActorPPOTrainer, cli_args(*flags, "--cope.action_forecast_lr_scale", "0"), model_dir,
                          tok, monkeypatch)
    before = params(frozen)
    frozen.cope_forecast_samples = samples
    assert frozen.cope_forecast_step()["cope/forecast_loss"] > 0
    assert all(torch.equal(before[k], v) for k, v in params(frozen).items())
    assert frozen.actor_optim.param_groups[0]["lr"] == LR


def test_separate_forecast_step_refuses_a_partial_accumulation_window(batch, model_dir, tok, monkeypatch, on_cpu):
    """DeepSpeed counts micro-steps across calls: with a window of 2, a PPO pass of one micro-step (4 samples,
    micro-batch 4) leaves the window open, and the forecast step must not start (its first micro-batch would join the
    PPO optimizer step). Two micro-steps (micro-batch 2) close it, and the forecast step runs."""
    flags = ["--cope.action_forecast_enable", "--cope.action_forecast_gate", "all"]
    for micro_batch, whole_windows in (("4", False), ("2", True)):
        args = cli_args(*flags, "--train.micro_batch_size", micro_batch)
        trainer = make_trainer(CoPEActorPPOTrainer, args, model_dir, tok, monkeypatch)
        trainer.strategy = AccumulatingStrategy(args, 2)
        experience, _ = with_forecast_weights(batch, tok, args)
        if whole_windows:
            assert train_once(trainer, experience)["cope/forecast_optimizer_steps"] == 1
            assert trainer.strategy.calls == 2 + 2  # PPO's window, then the forecast's
        else:
            with pytest.raises(RuntimeError, match=r"ran 1 micro-steps on this rank, not a multiple of the window \(2"):
                train_once(trainer, experience)
            assert trainer.strategy.calls == 1  # the PPO micro-step only: no forecast micro-batch ran
