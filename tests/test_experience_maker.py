"""CoPEExperienceMaker.make_experience_batch, for real on CPU: OpenRLHF's RayActorGroup of CPU stand-in model
actors (tests/ray_cpu_groups.py) around a small local HF model, on multi-turn Experiences made by OpenRLHF's
own SamplesGenerator._process_response_into_experience. Flags off: element-wise equal to OpenRLHF's stock
RemoteExperienceMaker. Each flag on: the added fields and metrics equal the signal-core reference functions
run here in the driver."""

import copy
import logging
import os
from types import SimpleNamespace

import pytest
import ray
import torch
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
from openrlhf.utils.config import hierarchize

from cope_rlhf.actor import CoPEActorPPOTrainer, CoPEPolicyModelActor
from cope_rlhf.batch_keys import FILTERED_KEY, FORECAST_WEIGHT_KEY, INFO_BETA_KEY
from cope_rlhf.advantage import filter_degenerate_groups, info_gates
from cope_rlhf.cli.args import build_parser
from cope_rlhf.config import CoPEConfig
from cope_rlhf.cpu_cluster import CPUReplayBuffer
from cope_rlhf.experience_maker import CoPEExperienceMaker
from cope_rlhf.turns import turn_spans
from tests.conftest import ROOT
from tests.ray_cpu_groups import StandInStrategy, load_actor
from cope_rlhf.signal_references import (add_info_gated_advantage, forecast_samples_from_experiences,
                                         per_turn_info_gain)
from tests.tiny_hf import agent_response, to_experience

AGENT_FUNC = os.path.join(ROOT, "agent_funcs", "babyai.py")  # the maker reads its action format
N = 4  # samples per prompt
KL_COEF = 0.01
EPISODES = [  # (observations, actions); len(observations) == len(actions) + 1
    (["You are in a room. Go to the red ball.", "You see a door.", "Nothing happens.", "The door opens."],
     ["Thought:\nlook.\n\nAction:\nlook around", "Action:\nopen door", "Action:\ntoggle and go through door"]),
    (["Craft a stick.", "Got 1 bone."], ["Action:\nget 1 bone"]),
    (["Pick up the key.", "You see a key.", "Invalid action.", "You see a blue key.", "Done."],
     ["Action:\nlook around", "Action:\npick key", "Action:\nlook around", "Action:\npick up key"]),
    (["Go to the red ball.", "You see a red ball.", "You are at the red ball."],
     ["Action:\nturn left", "Action:\ngo to red ball 1"]),
]
# Three prompt groups: mixed, degenerate (all failed), mixed.
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]


def cli_args(*argv: str) -> SimpleNamespace:
    """Args as the CoPE CLI parses them (OpenRLHF's parser + the CoPE group), hierarchized like OpenRLHF."""
    base = ["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", str(N),
            "--rollout.micro_batch_size", "4", "--algo.kl.init_coef", str(KL_COEF),
            "--train.agent_func_path", AGENT_FUNC]
    return hierarchize(build_parser().parse_args(base + list(argv)))


@pytest.fixture(scope="module")
def group_args():
    return cli_args()


@pytest.fixture(scope="module")
def policy(checkpoints):
    return load_actor(checkpoints[0]).eval()


def rollout(tok):
    """Twelve fresh single-sample Experiences (3 prompts x 4), as SamplesGenerator yields them."""
    return [to_experience(agent_response(tok, *EPISODES[(i + i // N) % len(EPISODES)], reward=r))
            for i, r in enumerate(REWARDS)]


def make(maker_class, groups, tok, *argv):
    actor_group, ref_group = groups
    maker = maker_class(actor_group, None, None, ref_group, FixedKLController(KL_COEF),
                        StandInStrategy(cli_args(*argv)), tok)
    return maker.make_experience_batch(rollout(tok))


@pytest.fixture(scope="module")
def stock(groups, tok):
    return make(RemoteExperienceMaker, groups, tok)


def fresh(stock):
    return copy.deepcopy(stock)


def assert_same_experiences(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in ("sequences", "attention_mask", "action_mask", "action_log_probs", "base_action_log_probs",
                     "advantages", "returns", "rewards"):
            u, v = getattr(x, name), getattr(y, name)
            assert (u is None and v is None) or torch.equal(u, v), name
        assert x.index == y.index
        assert x.info.keys() == y.info.keys()
        for key in x.info:
            assert torch.equal(x.info[key], y.info[key]), key


def test_ray_worker_uses_patched_classes(groups):
    """The hook ran in the worker: OpenRLHF's modules there hold the CoPE classes (the driver has no apply())."""
    assert ray.get(groups[0]._actor_handlers[0].classes_in_use.remote(), timeout=120) == {
        "RemoteExperienceMaker": "CoPEExperienceMaker", "ActorPPOTrainer": "CoPEActorPPOTrainer",
        "PolicyModelActor": "CoPEPolicyModelActor"}


def test_flags_off_equals_stock(groups, tok, stock):
    cope = make(CoPEExperienceMaker, groups, tok)
    assert_same_experiences(cope, stock)
    assert not any(k.startswith("cope") for k in cope[0].info)
    assert any(e.advantages.abs().sum() > 0 for e in stock)  # the comparison is not between zeros


def test_group_norm_rounding_is_warned_once_and_not_with_the_filter(groups, tok, caplog):
    """Eight equal wins of BabyAI's 1 - 0.9 * 1 / 64: stock group_norm gives all eight one advantage of ~0.9 made
    of float32 rounding; the maker says so once per run, and not when the filter is on."""
    wins = [to_experience(agent_response(tok, *EPISODES[3], reward=1 - 0.9 / 64)) for _ in range(8)]
    for argv, warnings in (((), 1), (("--cope.grpo_filter_degenerate",), 0)):
        maker = CoPEExperienceMaker(*groups[:1], None, None, groups[1], FixedKLController(KL_COEF),
                                    StandInStrategy(cli_args("--rollout.n_samples_per_prompt", "8", *argv)), tok)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="cope_rlhf.experience_maker"):
            first = maker.make_experience_batch(copy.deepcopy(wins))
            maker.make_experience_batch(copy.deepcopy(wins))
        said = [r.getMessage() for r in caplog.records if "grpo_filter_degenerate" in r.getMessage()]
        assert len(said) == warnings and all("100% of this batch's groups" in m for m in said)
        advantages = torch.cat([e.advantages[e.action_mask.bool()] for e in first])
        if warnings:
            assert advantages.abs().min() > 0.5  # the premise: stock GRPO's advantage here is rounding, not ~0
        else:  # the filter zeroed the group's advantage; the batch's only group did not survive, so the batch
            # stays whole (max(2, 10%) groups must survive): no row is marked for the actor to mask out
            assert not advantages.any() and not any(bool(e.info[FILTERED_KEY].any()) for e in first)


def test_filter_warns_when_it_takes_every_group_batch_after_batch(groups, tok, caplog):
    """A policy that plays every prompt the same way gives all-equal groups only: with the filter on, such a step
    has no policy-gradient term and the run cannot leave that state, so the maker says so after ALL_FILTERED_WARN
    batches in a row (not before, and not when one batch in between had a mixed group)."""
    from cope_rlhf.experience_maker import ALL_FILTERED_WARN

    wins = [to_experience(agent_response(tok, *EPISODES[3], reward=1.0)) for _ in range(N)]
    maker = CoPEExperienceMaker(*groups[:1], None, None, groups[1], FixedKLController(KL_COEF),
                                StandInStrategy(cli_args("--cope.grpo_filter_degenerate")), tok)
    said = []
    with caplog.at_level(logging.WARNING, logger="cope_rlhf.experience_maker"):
        for batch in ["equal"] * (ALL_FILTERED_WARN - 1) + ["mixed"] + ["equal"] * ALL_FILTERED_WARN:
            caplog.clear()
            maker.make_experience_batch(copy.deepcopy(wins) if batch == "equal" else rollout(tok))
            said.append([r.getMessage() for r in caplog.records if "no policy-gradient term" in r.getMessage()])
    assert said[:-1] == [[]] * (len(said) - 1)
    assert len(said[-1]) == 1 and f"in the last {ALL_FILTERED_WARN} batches" in said[-1][0]


def test_filter_zeroes_degenerate_group(groups, tok, stock, checkpoints):
    cope = make(CoPEExperienceMaker, groups, tok, "--cope.grpo_filter_degenerate")
    reference = fresh(stock)
    drops, metrics = filter_degenerate_groups(reference, N)
    assert metrics["cope/filtered_frac"] == pytest.approx(4 / 12)
    for got, want, base, drop in zip(cope, reference, stock, drops):
        assert torch.equal(got.action_mask, base.action_mask)  # masked by the actor, once it has the forecast samples
        assert torch.equal(got.advantages, want.advantages) and torch.equal(got.info[FILTERED_KEY], drop)
        assert torch.equal(got.info["cope/filtered_frac"], torch.full((len(got.index),), 4 / 12))
    dropped = [p for e in cope for b, p in enumerate(e.index) if e.info[FILTERED_KEY][b]]
    assert sorted(dropped) == [4, 5, 6, 7]
    items = through_the_actor(cope, tok, checkpoints[0], "--cope.grpo_filter_degenerate").replay_buffer.items
    rows = [p for e in cope for p in e.index]
    assert sorted(p for p, item in zip(rows, items) if not item.action_mask.any()) == [4, 5, 6, 7]


def test_kl_all_rows_is_the_whole_batch_drift_when_the_filter_takes_rows_out_of_train_kl(groups, tok):
    """With the KL as a loss, train/kl averages the rows left in the loss, and the filter takes the degenerate group
    out: cope/kl_all_rows is the mean over all 12 rows of each row's token-mean k3 KL(rollout policy || reference)."""
    # rollout()'s groups each play all four episodes, so every group has the same mean KL; here the degenerate
    # group (rows 4-7) plays the one-turn episode only, so the whole batch's mean and the kept rows' mean differ
    episodes = [EPISODES[i % len(EPISODES)] if i // N != 1 else EPISODES[1] for i in range(len(REWARDS))]
    actor_group, ref_group = groups
    maker = CoPEExperienceMaker(actor_group, None, None, ref_group, FixedKLController(KL_COEF), StandInStrategy(
        cli_args("--cope.grpo_filter_degenerate", "--algo.kl.use_loss", "--algo.kl.estimator", "k3")), tok)
    cope = maker.make_experience_batch([to_experience(agent_response(tok, *episode, reward=r))
                                        for episode, r in zip(episodes, REWARDS)])
    per_row = []
    for e in cope:
        log_ref_over_policy = e.base_action_log_probs.float() - e.action_log_probs.float()
        k3 = log_ref_over_policy.exp() - 1 - log_ref_over_policy  # r - 1 - log r, r = p_ref / p
        k3 = k3.clamp(max=10)  # per token, as the loss's estimator caps it (these random tiny models reach it)
        per_row += ((k3 * e.action_mask).sum(-1) / e.action_mask.sum(-1)).tolist()
    dropped = {p for e in cope for b, p in enumerate(e.index) if e.info[FILTERED_KEY][b]}
    assert dropped == {4, 5, 6, 7} and len(per_row) == 12
    kept = [k for p, k in zip([p for e in cope for p in e.index], per_row) if p not in dropped]
    want = sum(per_row) / 12
    assert want > 0 and abs(want - sum(kept) / len(kept)) > 1e-3  # the two populations differ here
    for e in cope:
        assert torch.allclose(e.info["cope/kl_all_rows"], torch.full((len(e.index),), want), rtol=1e-4)
    without_loss = make(CoPEExperienceMaker, groups, tok, "--cope.grpo_filter_degenerate")
    assert all("cope/kl_all_rows" not in e.info for e in without_loss)  # KL in the reward: train/kl has every row
    # KL coefficient 0: the trainer starts no reference model, so there is no base log-prob and no KL to log
    no_reference = CoPEExperienceMaker(actor_group, None, None, None, FixedKLController(0.0), StandInStrategy(
        cli_args("--cope.grpo_filter_degenerate", "--algo.kl.use_loss", "--algo.kl.init_coef", "0")), tok)
    assert all("cope/kl_all_rows" not in e.info for e in no_reference.make_experience_batch(rollout(tok)))


def through_the_actor(experiences, tok, checkpoint: str, *argv: str) -> CoPEActorPPOTrainer:
    """The maker's experiences as the CoPE policy actor trains on them: appended (its frozen signals computed under
    the weights of ``checkpoint``, the actor group's), then the info term added to the buffered items' advantages,
    as ``ppo_train`` does first. Returns the trainer (its buffer's items: one per sample, right-trimmed)."""
    args = cli_args(*argv)
    trainer = object.__new__(CoPEActorPPOTrainer)
    trainer.strategy, trainer.args, trainer.tokenizer = StandInStrategy(args), args, tok
    trainer.actor = load_actor(checkpoint)
    trainer.replay_buffer = CPUReplayBuffer(4, 0, False, False, False)
    actor = object.__new__(CoPEPolicyModelActor.__ray_actor_class__)
    actor.trainer = trainer
    for e in copy.deepcopy(experiences):
        actor.append(e)
    if trainer.cope.info_gain_enable:
        trainer._add_info_bonus()
    return trainer


def test_info_gain_gates_in_the_maker_the_bonus_in_the_actor(groups, tok, stock, policy, checkpoints):
    """The maker adds each sample's gate beta_g; the actor, handed the experiences, adds beta_g * Â_intr to their
    advantages: together, the reference's info-gated advantage of the whole batch (intrinsic rewards per turn)."""
    info = ["--cope.info_intrinsic_weight", "0.1"]
    cope = make(CoPEExperienceMaker, groups, tok, *info)
    config = CoPEConfig()
    for got, base, beta in zip(cope, stock, info_gates(stock, N, 0.1, config.info_gate_temp)):
        assert torch.equal(got.advantages, base.advantages)  # the maker leaves them: the term is the actor's
        torch.testing.assert_close(got.info[INFO_BETA_KEY], beta)
    logits_fn = lambda s, a, p, k: policy.model(input_ids=s, attention_mask=a, position_ids=p,  # noqa: E731
                                                logits_to_keep=0 if k is None else k).logits.float()
    reference = fresh(stock)
    intrinsic = [per_turn_info_gain(logits_fn, e.sequences, e.attention_mask, e.action_mask, config.info_probe_tokens,
                                    config.info_max_turns)[0] for e in reference]
    assert sum(float(x.abs().sum()) for x in intrinsic) > 0
    add_info_gated_advantage(reference, intrinsic, N, 0.1, config.info_gate_temp)
    items = through_the_actor(cope, tok, checkpoints[0], *info).replay_buffer.items
    rows = [(e, b) for e in reference for b in range(len(e.index))]
    assert len(items) == len(rows)
    for item, (want, b) in zip(items, rows):
        torch.testing.assert_close(item.advantages, want.advantages[b][: len(item.advantages)], rtol=1e-5, atol=1e-6)
        assert torch.equal(item.returns, want.returns[b][: len(item.returns)])  # the bonus goes into advantages only
    before = [e.advantages[b][: len(i.advantages)] for i, (e, b) in
              zip(items, [(e, b) for e in stock for b in range(len(e.index))])]
    assert not all(torch.equal(i.advantages, a) for i, a in zip(items, before))


def test_filter_with_info_gain_leaves_degenerate_groups_the_intrinsic_term(groups, tok, stock, checkpoints):
    """Both switches on: the degenerate group (rows 4-7) loses its extrinsic advantage, keeps its action mask, and
    gets beta = w (the gate fully open) times the normalised intrinsic reward, in the actor."""
    info = ["--cope.info_intrinsic_weight", "0.1"]
    both = make(CoPEExperienceMaker, groups, tok, *info, "--cope.grpo_filter_degenerate")
    for got, base in zip(both, stock):
        assert torch.equal(got.action_mask, base.action_mask)
        torch.testing.assert_close(got.info["cope/filtered_frac"], torch.full((len(got.index),), 4 / 12))
        for b, row in enumerate(got.index):
            if 4 <= row < 8:
                assert not got.returns[b].any() and not got.advantages[b].any()  # the extrinsic term is gone
                assert float(got.info[INFO_BETA_KEY][b]) == pytest.approx(0.1)  # the gate fully open
            else:
                torch.testing.assert_close(got.advantages[b], base.advantages[b])
    assert float(both[0].info["cope/info_beta_mean"][0]) > 0.1 * 4 / 12 * 0.99  # w on a third of the samples
    items = through_the_actor(both, tok, checkpoints[0], *info, "--cope.grpo_filter_degenerate").replay_buffer.items
    rows = [row for e in both for row in e.index]
    reached = sum(int(item.advantages[item.action_mask.bool()].abs().sum() > 0)
                  for item, row in zip(items, rows) if 4 <= row < 8)
    assert reached >= 2  # the info term reaches the sigma = 0 group (turn 0 of a row scores 0; others do not)


def test_forecast_samples_built_by_the_actor(groups, tok, stock, checkpoints):
    """The maker weighs the rows (gate "wins", group norm) before the filter; the actor builds their samples on append
    and rescales the weights: the whole-batch reference's samples."""
    argv = ["--cope.action_forecast_enable", "--cope.action_forecast_gate", "wins",
            "--cope.action_forecast_group_norm", "--cope.grpo_filter_degenerate"]
    cope = make(CoPEExperienceMaker, groups, tok, *argv)
    config = CoPEConfig.from_args(cli_args(*argv))
    samples, _ = forecast_samples_from_experiences(fresh(stock), tok, config, N)
    args = cli_args(*argv)
    trainer = object.__new__(CoPEActorPPOTrainer)
    trainer.strategy, trainer.args, trainer.tokenizer = StandInStrategy(args), args, tok
    trainer.replay_buffer = CPUReplayBuffer(4, 0, False, False, False)
    for e in copy.deepcopy(cope):
        trainer.take_experience(e)
        assert FORECAST_WEIGHT_KEY not in e.info and FILTERED_KEY not in e.info  # nothing of it reaches the buffer
    assert trainer._rescale_forecast_weights() == len(samples) > 0
    got = trainer.cope_forecast_samples
    key = lambda s: (s.row, s.turn)  # noqa: E731
    assert [(s.input_ids, s.loss_mask, s.slots) for s in sorted(got, key=key)] == \
        [(s.input_ids, s.loss_mask, s.slots) for s in sorted(samples, key=key)]
    assert [s.weight for s in sorted(got, key=key)] == pytest.approx([s.weight for s in sorted(samples, key=key)])
    # gate "wins", with the all-win group 2 (rows 8-11 win 3 of 4: mixed) and the all-lose group 1 (rows 4-7)
    assert {s.row for s in got} == {i for i, r in enumerate(REWARDS) if r > 0.5}
    for got_e, base in zip(cope, stock):  # advantages untouched by the forecast
        assert torch.equal(got_e.advantages, base.advantages) or not got_e.advantages.any()


def test_te_is_left_to_the_actor(groups, tok, stock):
    """TE's members are the policy actor's own (computed when it is handed the experience): the maker adds nothing
    for TE, not a key in info, not a change to the advantages."""
    cope = make(CoPEExperienceMaker, groups, tok, "--cope.te_enable", "--cope.te_lambda", "0.1")
    assert_same_experiences(cope, stock)


def test_show_stock_vs_cope(groups, tok, stock, checkpoints):
    """One batch, printed (run with -s): per sample, stock GRPO advantages, CoPE with forecast + TE + info gain,
    and CoPE with the degenerate-group filter too (the advantages the policy actor trains on: the maker's plus the
    actor's info term); then the maker's CoPE metrics of the all-on run."""
    signals = ["--cope.action_forecast_enable", "--cope.info_intrinsic_weight", "0.1", "--cope.te_enable",
               "--cope.te_lambda", "0.1"]
    no_filter = make(CoPEExperienceMaker, groups, tok, *signals)
    all_on = make(CoPEExperienceMaker, groups, tok, *signals, "--cope.grpo_filter_degenerate")
    actors = {"no_filter": through_the_actor(no_filter, tok, checkpoints[0], *signals),
              "all_on": through_the_actor(all_on, tok, checkpoints[0], *signals, "--cope.grpo_filter_degenerate")}
    trained = {name: trainer.replay_buffer.items for name, trainer in actors.items()}
    forecasts = {}
    for sample in actors["all_on"].cope_forecast_samples:
        forecasts[sample.row] = forecasts.get(sample.row, 0) + 1

    def show(advantages, mask):
        adv = advantages[: len(mask)][mask.bool()]
        return f"{adv.mean():+.4f} ({adv.min():+.3f}..{adv.max():+.3f})" if adv.numel() else "filtered"

    print(f"\n{'row':>3} {'reward':>6} {'turns':>5} {'stock GRPO adv: mean (min..max)':>31} "
          f"{'CoPE, no filter':>27} {'CoPE, all on':>27} {'forecasts':>9}")
    i = 0
    for s_e, c_e in zip(stock, all_on):
        spans = turn_spans(s_e.action_mask, s_e.sequences.shape[1], s_e.attention_mask)
        for b, row in enumerate(c_e.index):
            a_i, c_i = trained["no_filter"][i], trained["all_on"][i]
            print(f"{row:>3} {float(c_e.rewards[b]):>6.1f} {len(spans[b]):>5} "
                  f"{show(s_e.advantages[b], s_e.action_mask[b]):>31} {show(a_i.advantages, a_i.action_mask):>27} "
                  f"{show(c_i.advantages, c_i.action_mask):>27} {forecasts.get(row, 0):>9}")
            assert c_i.action_mask.any()  # with info gain on, the filter keeps every action mask
            i += 1
    metrics = {k: float(v[0]) for k, v in all_on[0].info.items() if k.startswith("cope/")}
    print("The maker's CoPE metrics, all on (broadcast per sample into info; the actor averages them into its "
          "status, next to its own: info gain's reward and turns, TE's coverage, the forecast samples):")
    for key, value in sorted(metrics.items()):
        print(f"  {key:<28} {value:.4f}")
    assert {"cope/filtered_frac", "cope/info_beta_mean", "cope/forecast_kept_frac"} <= metrics.keys()
    rows = [(e, b) for e in stock for b in range(len(e.index))]
    degenerate = [(item.advantages, e.advantages[b][: len(item.advantages)])
                  for item, (e, b) in zip(trained["no_filter"], rows) if 4 <= e.index[b] < 8]
    assert not all(torch.equal(x, y) for x, y in degenerate)  # the gate opened there
