"""``python -m cope_rlhf.cli.train_ppo_ray``: OpenRLHF's ``train_ppo_ray`` CLI plus the ``--cope.*`` group.

OpenRLHF's CLI module runs as ``__main__`` with its ``parse_args`` wrapped (``cli.args.run_openrlhf_cli``): the
wrapper adds the CoPE group (``config.add_cope_args``, one flag per ``CoPEConfig`` field) to OpenRLHF's parser,
parses, and checks the run (``preflight``); OpenRLHF's own post-processing and ``train(args)`` then run unchanged.
``hierarchize`` turns ``cope.x`` into ``args.cope.x``; ``strategy.args`` travels to every Ray worker, where the CoPE
classes read it. Before that, ``patch.apply()`` installs the CoPE classes here, and ``ray.init`` (called by OpenRLHF's
``train``) is wrapped to add ``patch.install`` as the workers' setup hook, keeping OpenRLHF's ``env_vars``.

Every error in a CoPE value, environment variable or combination exits with code 2 and says what to change; so does
everything else that would stop the run (``preflight``: datasets, model, agent func, gateway, GPUs, folders, all at
once; COPE_SKIP_PREFLIGHT=1 skips it), and placement groups wait at most RAY_PG_TIMEOUT_S (600) seconds.

On a host without CUDA the same command runs OpenRLHF's real path on CPU (``cpu_cluster`` / ``cpu_vllm``, swapped
in by ``patch``): ``cpu_preset_error`` names every flag such a run needs that is missing (exit 2), and a Ray that
this command starts itself gets logical GPUs (``cpu_ray_resources``) so that OpenRLHF's GPU bundles can be placed.

A run that fails with a Ray error after a node of the cluster died says which node (its address and Ray's reason)
and how to resume, before the error itself; after an actor error it waits up to ``NODE_LOSS_WAIT_S`` for Ray to
declare the node dead (the actor's calls fail first).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, Optional

if __name__ == "__main__":  # run as a command: known-benign library notices off before torch prints one (quiet.py)
    from cope_rlhf.quiet import hide_benign_notices

    hide_benign_notices()

import ray  # noqa: E402
import torch  # noqa: E402

from cope_rlhf import patch, preflight  # noqa: E402
from cope_rlhf.cli.args import (OPENRLHF_PPO_CLI, combination_error, cpu_preset_error, run_openrlhf_cli,  # noqa: E402
                                with_cope_group)
ACTOR_LOST = (ray.exceptions.ActorDiedError, ray.exceptions.ActorUnavailableError)
NODE_LOSS_WAIT_S = 45  # Ray declares a silent node dead after its health checks fail (~15-30 s by default)


def cpu_ray_resources(args: argparse.Namespace) -> dict:
    """``ray.init`` resources for a Ray this command starts on a host without CUDA. OpenRLHF asks for one GPU per
    model rank and per vLLM engine (bundles ``{"GPU": 1, "CPU": 1}``), which a Ray without GPUs never grants: its
    placement groups wait forever. Logical GPUs, one per rank of every group the flags size (the reward group's too,
    which OpenRLHF does not create when an agent func gives the rewards: a spare logical GPU costs nothing), and as
    many logical CPUs, make them placeable."""
    flag = lambda name: getattr(args, name, None) or 0  # noqa: E731
    gpus = sum(flag(f"{group}.num_nodes") * flag(f"{group}.num_gpus_per_node") for group in ("actor", "ref", "reward"))
    if flag("critic.model_name_or_path"):
        gpus += flag("critic.num_nodes") * flag("critic.num_gpus_per_node")
    gpus += flag("vllm.num_engines") * max(flag("vllm.tensor_parallel_size"), 1)
    return {"num_gpus": gpus, "num_cpus": max(os.cpu_count() or 1, gpus + 2)}


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    original = argparse.ArgumentParser.parse_args
    parsed_args = []

    skip_preflight = os.environ.get("COPE_SKIP_PREFLIGHT", "").strip() not in ("", "0")

    def parse_with_cope(self, args=None, namespace=None):
        parsed = original(with_cope_group(self), argv if args is None else args, namespace)
        if skip_preflight:
            problem = combination_error(parsed) or cpu_preset_error(parsed)
            if problem:
                self.error(problem)
        else:
            found = preflight.problems(parsed)
            if found:
                print(preflight.report(found), file=sys.stderr)
                sys.exit(2)
        parsed_args.append(parsed)
        return parsed

    patch.apply()
    ray_init = ray.init
    hooked_init = patch.ray_init_with_hook(ray_init)

    def init(*args, **kwargs):
        starts_local_ray = not args and not kwargs.get("address") and not os.environ.get("RAY_ADDRESS")
        if starts_local_ray and not torch.cuda.is_available():
            for key, value in cpu_ray_resources(parsed_args[-1]).items():
                kwargs.setdefault(key, value)
        context = hooked_init(*args, **kwargs)
        problem = None if skip_preflight else preflight.cluster_gpu_problem(parsed_args[-1], ray.cluster_resources())
        if problem:
            ray.shutdown()
            print(preflight.report([problem]), file=sys.stderr)
            sys.exit(2)
        return context

    preflight.bound_placement_groups()
    ray.init = init
    try:
        run_openrlhf_cli(OPENRLHF_PPO_CLI, parse_with_cope)
    except ray.exceptions.RayError as error:
        # A lost node fails the run with an actor error that does not say where, often seconds before Ray's health
        # checks declare the node dead: after an actor error, wait up to NODE_LOSS_WAIT_S for a dead node to show.
        lost, deadline = [], time.time() + (NODE_LOSS_WAIT_S if isinstance(error, ACTOR_LOST) else 0)
        while ray.is_initialized():
            try:
                lost = [f"{n.get('NodeManagerAddress', '?')} (node {n.get('NodeID', '?')[:12]}: "
                        f"{n.get('DeathReasonMessage') or 'no heartbeat'})"
                        for n in ray.nodes() if not n.get("Alive", True)]
            except Exception:  # noqa: BLE001 - the GCS itself may be gone; the run's own error follows
                break
            if lost or time.time() >= deadline:
                break
            time.sleep(2)
        if lost:
            print(f"error: the run stopped because Ray lost {len(lost)} node(s): {'; '.join(lost)}. The actors placed "
                  "there are gone with them (an engine, model ranks). Bring the node back (scripts/"
                  "ray_cluster_worker.sh) and resume from the last checkpoint with --ckpt.load_enable.",
                  file=sys.stderr)
        raise
    finally:
        ray.init = ray_init


if __name__ == "__main__":
    main()
