"""The CoPE actor methods under real DeepSpeed ZeRO-3, two gloo ranks on CPU, with uneven work per rank.

Under ZeRO-3 every forward all-gathers the parameters from all ranks, so every CoPE call must run the same number of
forwards on every rank (DESIGN.md), although ranks hold different rows. Here rank 0 holds multi-turn trajectories
(info-gain probes, forecast samples) and rank 1 a single-turn one (no probe, no later forecast slot) and no forecast
samples, so that rank 1 has no forward of its own to run. Both ranks call, in turn: ``cope_frozen_signals`` (a
trajectory's probes and forecasts in one packed forward, one trajectory per forward), what ``append`` and the start
of ``ppo_train`` do with an experience (``take_experience``, then ``_add_info_bonus``, whose z-score spans
both ranks' action tokens), the forecast weights' rescale (``_rescale_forecast_weights``, a count over both ranks)
and the separate ``cope_forecast_step`` (backward and optimizer step included). Each
rank's results must equal those of one process without DeepSpeed on the same rows (the info term: on both ranks'
rows), and both ranks must have run the same number of forwards.

The three ``stage3_*`` knobs below at 0 make DeepSpeed gather every parameter at every forward, as for a model too
large to keep resident (a tiny model's could otherwise stay resident between forwards). The process group times out
after ``GROUP_TIMEOUT_S``, so a mismatch fails the test within about that long (a gloo timeout error raised in a rank)
instead of hanging for OpenRLHF's 60 minutes.
"""

import cope_rlhf.compat  # noqa: F401  (first: the spawned ranks import this module without conftest)

import copy
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.utils.config import hierarchize
from openrlhf.utils.deepspeed import DeepspeedStrategy
from transformers import AutoTokenizer

from cope_rlhf.actor import CoPEActorPPOTrainer
from cope_rlhf.batch_keys import INFO_BETA_KEY
from cope_rlhf.cli.args import build_parser
from cope_rlhf.cpu_cluster import CPUReplayBuffer
from cope_rlhf.forecast import build_forecast_samples
from cope_rlhf.turns import unpadded_trajectories
from tests.ray_cpu_groups import StandInStrategy, load_actor
from tests.tiny_hf import agent_response, to_experience

GROUP_TIMEOUT_S = 30
AGENT_FUNC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "agent_funcs", "babyai.py")
RANKS = 2
ZERO3 = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},  # torch_adam: no FusedAdam JIT build
    "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
                          "stage3_param_persistence_threshold": 0},
}
EPISODES = [  # (observations, actions); rank 0: two multi-turn episodes, rank 1: one single-turn episode
    [(["Go to the red ball.", "You see a door.", "Nothing happens.", "The door opens."],
      ["Thought:\nlook.\n\nAction:\nlook around", "Action:\nopen door", "Action:\ntoggle and go through door"]),
     (["Pick up the key.", "You see a key.", "You see a blue key.", "Done."],
      ["Action:\nlook around", "Action:\npick key", "Action:\npick up key"])],
    [(["Pick up the key.", "Done."], ["Action:\npick up key"])],
]


def cli_args(*argv):
    """Every signal on, one row per forward (so that rank 0 runs many), one SFT mini-batch for all samples."""
    return hierarchize(build_parser().parse_args(
        ["--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "1",
         "--train.agent_func_path", AGENT_FUNC, "--cope.info_intrinsic_weight", "0.1", "--cope.te_enable",
         "--cope.action_forecast_enable", "--cope.action_forecast_coef", "1.0", "--cope.sft_mini_batch_size", "64",
         "--cope.info_kl_batch", "1", "--cope.te_micro_batch_size_per_gpu", "1", *argv]))


def cope_calls(trainer: CoPEActorPPOTrainer, rank: int, tok) -> dict:
    """The CoPE calls of one rank on its rows (``EPISODES[rank]``), and how many model forwards they ran."""
    forwards = []
    hook = getattr(trainer.actor.model, "module", trainer.actor.model).register_forward_pre_hook(
        lambda *_: forwards.append(1))
    batch = Experience.concat_experiences([to_experience(agent_response(tok, *episode)) for episode in EPISODES[rank]],
                                          tok.pad_token_id)
    batch.index = list(range(len(EPISODES[rank])))
    rows = unpadded_trajectories([batch])
    samples = [build_forecast_samples(*rows[p], tok, 3, row=p) for p in batch.index]  # per row, for TE
    inputs = (batch.sequences, batch.attention_mask, batch.action_mask, samples, [rows[p] for p in batch.index])
    trainer.strategy.args = cli_args()  # the methods read their config from here, per call
    packed = trainer.cope_frozen_signals(*inputs)
    bonus = appended(trainer, [batch], tok)
    # rank 1's trajectory is gated out of the forecast: it has no sample to train, rank 0 has them all
    trainer.cope_forecast_samples = [s for row in samples for s in row] if rank == 0 else []
    forecast = {"cope/forecast_samples": trainer._rescale_forecast_weights(), **trainer.cope_forecast_step()}
    hook.remove()
    return {"packed": packed, "bonus": bonus, "forecast": forecast, "forwards": len(forwards)}


def appended(trainer: CoPEActorPPOTrainer, batches: list, tok) -> tuple:
    """What ``append`` and the start of ``ppo_train`` do with ``batches`` (zero advantages, the gate at w): the
    frozen signals attached, the info term added; (mean intrinsic reward, the buffer items' advantages)."""
    trainer.tokenizer, trainer.replay_buffer = tok, CPUReplayBuffer(1, 0, False, False, False)
    for batch in copy.deepcopy(batches):
        batch.advantages = torch.zeros(batch.action_mask.shape)
        batch.info[INFO_BETA_KEY] = torch.full((len(batch.index),), 0.1)
        trainer.take_experience(batch)
        trainer.replay_buffer.append(batch)
    mean = trainer._add_info_bonus()
    return mean, [item.advantages for item in trainer.replay_buffer.items]


class ZeroStrategy(StandInStrategy):
    """The stand-in strategy with OpenRLHF's own DeepspeedStrategy methods for the calls the CoPE methods make (a real
    DeepspeedStrategy cannot be set up here: ``setup_distributed`` needs CUDA)."""

    all_reduce = DeepspeedStrategy.all_reduce
    backward = DeepspeedStrategy.backward
    optimizer_step = DeepspeedStrategy.optimizer_step
    world_size = RANKS


def run_rank(rank: int, model_dir: str, out_dir: str) -> None:
    """One ZeRO-3 rank (a spawned process): its CoPE calls' results into ``out_dir/rank<rank>.pt``."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS))
    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: "cpu"  # DeepspeedStrategy.all_reduce moves CPU tensors to this device
    import deepspeed

    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (C++, ~90 s on 2 cores) that only tensor-parallel
    # inference uses; ZeRO-3's gathers go through gloo either way
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # the ranks meet through a file in the test's own folder, not a TCP port: a port chosen free here could be taken by
    # another process before rank 0 binds it. Without MASTER_PORT DeepSpeed would look for MPI: auto_mpi_discovery off
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S), rank=rank,
                               world_size=RANKS, init_method=f"file://{out_dir}/rendezvous", auto_mpi_discovery=False)
    args = cli_args()
    trainer = object.__new__(CoPEActorPPOTrainer)
    trainer.strategy, trainer.args = ZeroStrategy(args), args
    trainer.actor = load_actor(model_dir)
    trainer.actor.model, trainer.actor_optim, _, _ = deepspeed.initialize(
        model=trainer.actor.model, model_parameters=trainer.actor.model.parameters(), config=ZERO3)
    torch.save(cope_calls(trainer, rank, AutoTokenizer.from_pretrained(model_dir)), f"{out_dir}/rank{rank}.pt")
    torch.distributed.barrier()  # a rank still gathering parameters fails this one too


def assert_same(got, want, where: str) -> None:
    """Nested results equal: tensors to 1e-5, other values exactly (floats to 1e-5 relative)."""
    if isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m: f"{where}: {m}")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), where
    else:
        assert got == want, where


def test_uneven_ranks_finish_with_single_process_values(model_dir, tmp_path):
    context = mp.start_processes(run_rank, args=(model_dir, str(tmp_path)), nprocs=RANKS, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + 300  # a safety net only: the group timeout fails a mismatch long before
    while not context.join(timeout=5):  # raises ProcessRaisedException with the rank's traceback if one fails
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the ZeRO-3 ranks did not finish in 300 s")
    got = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(RANKS)]

    want = []  # each rank's rows in one process, without DeepSpeed
    tok = AutoTokenizer.from_pretrained(model_dir)  # as the ranks load it (it can split text unlike `tok`)
    for rank in range(RANKS):
        args = cli_args()
        reference = object.__new__(CoPEActorPPOTrainer)
        reference.strategy, reference.args, reference.actor = StandInStrategy(args), args, load_actor(model_dir)
        reference.actor_optim = torch.optim.SGD(reference.actor.parameters(), lr=1e-3)
        want.append(cope_calls(reference, rank, tok))
    # the info term's z-score spans both ranks: one process holding both ranks' rows gives each rank's values
    union = object.__new__(CoPEActorPPOTrainer)
    union.strategy, union.args, union.actor = StandInStrategy(cli_args()), cli_args(), load_actor(model_dir)
    batches = []
    for rank in range(RANKS):
        batch = Experience.concat_experiences([to_experience(agent_response(tok, *e)) for e in EPISODES[rank]],
                                              tok.pad_token_id)
        batch.index = list(range(len(EPISODES[rank])))
        batches.append(batch)
    mean, advantages = appended(union, batches, tok)
    assert_same(got[0]["bonus"], (mean, advantages[:len(EPISODES[0])]), "rank 0 info term")
    assert_same(got[1]["bonus"], (mean, advantages[len(EPISODES[0]):]), "rank 1 info term")
    assert mean > 0 and got[1]["bonus"][0] != want[1]["bonus"][0]  # rank 1 alone has no scored turn: mean 0
    # rank 0 runs no forward beyond its own; rank 1, which has none, pads up to it
    assert got[0]["forwards"] == got[1]["forwards"] == want[0]["forwards"] > 0 and want[1]["forwards"] == 0
    for rank in range(RANKS):
        assert_same(got[rank]["packed"], want[rank]["packed"], f"rank {rank} packed")
        # the forecast metrics are reduced over the ranks: all samples are rank 0's
        assert_same(got[rank]["forecast"], want[0]["forecast"], f"rank {rank} forecast")
    (gain, _), members = got[0]["packed"]
    assert gain.abs().max() > 1e-3 and sum(len(m["positions"]) for m, _ in members) > 0
    assert got[0]["forecast"]["cope/forecast_optimizer_steps"] == 1 and got[0]["forecast"]["cope/forecast_loss"] > 0
