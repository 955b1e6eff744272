"""Preflight: everything that would stop a launch, found in seconds before anything is allocated, all at once.

    python -m cope_rlhf.cli.train_ppo_ray ARGS   runs it right after parsing: every problem and its fix, exit 2
    python -m cope_rlhf.preflight ARGS           the same checks alone, exit 2 or 0 (the launchers run it before
                                                 `ray job submit`, and before starting servers with --no-gateway)
    COPE_SKIP_PREFLIGHT=1                        skips it (the CLI's own flag checks still run)

``problems(args) -> [str]``, each "what is wrong: what to do". The checks:

  flags    the CoPE combination and the CPU preset (``combination_error``, ``cpu_preset_error``)
  gpus     GPUs the flags place: actor, ref (when the KL coefficient is > 0), critic, reward (unless remote or an
           agent func gives the rewards), vLLM
           engines x TP, with the colocation flags sharing them; against this host's CUDA devices. On a host
           without CUDA a Ray started here gets logical GPUs (``cpu_ray_resources``); a cluster (RAY_ADDRESS) is
           checked once Ray is up (``cluster_gpu_problem``), and placement groups wait at most RAY_PG_TIMEOUT_S.
  model    every ``*.model_name_or_path``: a local folder with config.json and a tokenizer, or a hub id that is
           in the local HF cache or with huggingface.co reachable
  data     ``--data.prompt_dataset`` and ``--eval.dataset``: each local file exists, is JSON lines, is not empty
           and its first row has ``--data.input_key`` (and ``--data.label_key`` when set); hub ids as for models
  agent    ``--train.agent_func_path`` loads and defines ``AgentExecutor``
  gateway  for an agent func on the gateway (``agent_funcs/base.py``): ``COPE_GATEWAY_URL`` answers
           ``/v1/health`` within 3 s and lists a healthy replica of the agent's env
  secrets  ``COPE_GATEWAY_TOKEN_FILE`` and ``.secrets/wandb_api_key``, when present: one line, mode 600
  folders  ``--ckpt.path``, ``--ckpt.output_dir``, ``--logger.tensorboard_dir`` can be created and written, and
           the disk under ``--ckpt.path`` has room for one checkpoint: 7x the model's weights on disk (bf16
           weights + fp32 master weights and two Adam moments = 2 + 12 bytes per parameter)
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import socket
import sys
import urllib.error
import urllib.request
from typing import List, Optional

if __name__ == "__main__":  # run as a command: known-benign library notices off before torch prints one (quiet.py)
    from cope_rlhf.quiet import hide_benign_notices

    hide_benign_notices()

from cope_rlhf.cli.args import build_parser, combination_error, cpu_preset_error  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUB = ("huggingface.co", 443)
CHECKPOINT_PER_WEIGHT_BYTE = 7  # (2 bf16 + 4 fp32 master + 2 x 4 Adam) / 2 bytes per parameter of the bf16 weights


def make_data(path: str) -> str:
    """The command that writes the item-id file ``path`` (``<folder>/<env>_<split>.jsonl``)."""
    env, _, split = os.path.basename(path).removesuffix(".jsonl").rpartition("_")
    folder = os.path.dirname(path) or "."
    if env and split in ("train", "dev", "test"):
        return f"make it with `.venv/bin/python scripts/make_itemids.py --env {env} --split {split} --out {folder}`"
    return ("make one with `.venv/bin/python scripts/make_itemids.py --env ENV --split train --out FOLDER` "
            "(FOLDER/ENV_train.jsonl: one {\"prompt\": \"<env>/<item>\", \"label\": \"<item>\"} per line)")


def flag(args: argparse.Namespace, name: str):
    return getattr(args, name, None)


def gpus_needed(args: argparse.Namespace) -> int:
    """Physical GPUs the placement of OpenRLHF's train_ppo_ray asks for (openrlhf/cli/train_ppo_ray.py)."""
    n = lambda group: (flag(args, f"{group}.num_nodes") or 0) * (flag(args, f"{group}.num_gpus_per_node") or 0)  # noqa: E731
    colocate_all = bool(flag(args, "train.colocate_all"))
    actor = n("actor")
    ref = n("ref") if (flag(args, "algo.kl.init_coef") or 0) > 0 else 0
    total = actor if (colocate_all or flag(args, "train.colocate_actor_ref")) else actor + ref
    engines = (flag(args, "vllm.num_engines") or 0) * max(flag(args, "vllm.tensor_parallel_size") or 1, 1)
    if not (colocate_all and not flag(args, "train.async_enable")):
        total += engines
    critic = n("critic") if flag(args, "critic.model_name_or_path") else 0
    # an agent func gives the rewards: OpenRLHF then sets --reward.remote_url "agent" and starts no reward group
    reward = 0 if flag(args, "reward.remote_url") or flag(args, "train.agent_func_path") else n("reward")
    total += max(critic, reward) if flag(args, "train.colocate_critic_reward") else critic + reward
    return total


def gpu_problems(args: argparse.Namespace) -> List[str]:
    import torch

    if not torch.cuda.is_available() or os.environ.get("RAY_ADDRESS"):
        return []  # logical GPUs here (cpu_ray_resources); a cluster's are checked once Ray is up
    need, have = gpus_needed(args), torch.cuda.device_count()
    if need > have:
        return [f"the flags place {need} GPUs (actor, ref, critic, reward, vLLM engines x TP; colocation shares "
                f"them) and this host has {have}: lower --actor.num_gpus_per_node / --vllm.num_engines, colocate "
                "(--train.colocate_all), or join a cluster (RAY_ADDRESS=..., scripts/ray_cluster_head.sh)"]
    return []


def cluster_gpu_problem(args: argparse.Namespace, resources: dict) -> Optional[str]:
    """After ``ray.init``: the cluster's GPUs (``ray.cluster_resources()``) against what the flags place."""
    need, have = gpus_needed(args), int(resources.get("GPU", 0))
    if need <= have:
        return None
    return (f"the flags place {need} GPUs and the Ray cluster has {have} ({resources}): add nodes "
            "(scripts/ray_cluster_worker.sh), or lower --actor.num_gpus_per_node / --vllm.num_engines")


def hub_reachable() -> bool:
    try:
        socket.create_connection(HUB, timeout=3).close()
        return True
    except OSError:
        return False


def in_hf_cache(repo_id: str, kind: str) -> bool:
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    return os.path.isdir(os.path.join(home, "hub", f"{kind}--{repo_id.replace('/', '--')}"))


def looks_like_path(name: str) -> bool:
    """A local path rather than a hub id ("org/name"): it starts like one, has a data file's suffix, has other than
    one "/", or its first part is a local folder."""
    return name.startswith((".", "/", "~")) or name.endswith((".json", ".jsonl", ".parquet", ".csv")) or \
        name.count("/") != 1 or os.path.isdir(name.split("/")[0])


def model_problems(args: argparse.Namespace) -> List[str]:
    found = []
    for name in ("actor.model_name_or_path", "critic.model_name_or_path", "reward.model_name_or_path"):
        path = flag(args, name)
        if not path or (name == "reward.model_name_or_path" and flag(args, "reward.remote_url")):
            continue
        if os.path.isdir(path):
            tokenizer = any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
            if not os.path.isfile(os.path.join(path, "config.json")) or not tokenizer:
                found.append(f"--{name} {path}: a model folder needs config.json and a tokenizer (tokenizer.json or "
                             "tokenizer_config.json): point it at a `save_pretrained` folder")
        elif looks_like_path(path):
            found.append(f"--{name} {path}: no such folder: build a model first (e.g. `bash scripts/quickstart.sh` "
                         "writes runs/quickstart/model-sft) or give a hub id")
        elif not in_hf_cache(path, "models") and not hub_reachable():
            found.append(f"--{name} {path}: not in the local Hugging Face cache and huggingface.co cannot be reached: "
                         "download it where there is a network (`huggingface-cli download` ...) and pass the folder")
    return found


def dataset_problems(args: argparse.Namespace) -> List[str]:
    found = []
    input_key, label_key = flag(args, "data.input_key"), flag(args, "data.label_key")
    for name in ("data.prompt_dataset", "eval.dataset"):
        for entry in filter(None, (flag(args, name) or "").split(",")):
            entry = entry.strip()
            files = sorted(glob.glob(os.path.join(entry, "*.json*"))) if os.path.isdir(entry) else [entry]
            if not os.path.exists(entry):
                if looks_like_path(entry):
                    found.append(f"--{name} {entry}: no such file: {make_data(entry)}")
                elif not in_hf_cache(entry, "datasets") and not hub_reachable():
                    found.append(f"--{name} {entry}: not a local file, and huggingface.co cannot be reached: "
                                 f"{make_data(entry)}")
                continue
            if not files:
                found.append(f"--{name} {entry}: a folder without .json/.jsonl files: {make_data(entry)}")
                continue
            with open(files[0], encoding="utf-8", errors="replace") as f:
                first = next((line for line in f if line.strip()), None)
            if first is None:
                found.append(f"--{name} {files[0]}: empty: {make_data(files[0])}")
                continue
            try:
                row = json.loads(first)
            except json.JSONDecodeError as e:
                found.append(f"--{name} {files[0]}: the first line is not JSON ({e}): the prompts are JSON lines")
                continue
            missing = [k for k in (input_key, label_key) if k and (not isinstance(row, dict) or k not in row)]
            if missing:
                keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                found.append(f"--{name} {files[0]}: its rows have {keys}, not {missing}: set --data.input_key / "
                             "--data.label_key to the file's keys (the agent funcs' files: prompt / label)")
    return found


def load_agent_executor(path: str):
    spec = importlib.util.spec_from_file_location("cope_preflight_agent_func", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, "AgentExecutor", None)


def agent_and_gateway_problems(args: argparse.Namespace, check_gateway: bool) -> List[str]:
    path = flag(args, "train.agent_func_path")
    if not path:
        return []
    if not os.path.isfile(path):
        return [f"--train.agent_func_path {path}: no such file (the built-in ones: agent_funcs/<env>.py)"]
    try:
        executor = load_agent_executor(path)
    except Exception as e:  # noqa: BLE001 - any failure to load the file is the user's to fix
        return [f"--train.agent_func_path {path} does not load: {type(e).__name__}: {e}"]
    if executor is None:
        return [f"--train.agent_func_path {path} defines no AgentExecutor (OpenRLHF looks for that class)"]
    env = getattr(getattr(executor, "agent_cls", None), "env", None)
    if not check_gateway or not isinstance(env, str):
        return []  # not an agent func on the gateway
    url = os.environ.get("COPE_GATEWAY_URL", "http://127.0.0.1:8800").rstrip("/")
    start = (f"start it with `bash scripts/launch_{env}_grpo_tmux.sh` (servers, gateway and training) or "
             f"`python -m env_gateway --env {env}=URL`, or set COPE_GATEWAY_URL")
    try:
        with urllib.request.urlopen(f"{url}/v1/health", timeout=3) as r:
            health = json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503: some env has no healthy replica
        health = json.loads(e.read() or b"{}")
    except (OSError, ValueError) as e:
        return [f"no gateway answers at COPE_GATEWAY_URL={url} ({e}): {start}"]
    replicas = health.get("envs", {}).get(env)
    if replicas is None:
        return [f"the gateway at {url} has no env {env!r} (it has {sorted(health.get('envs', {}))}): {start}"]
    if not replicas.get("healthy_replicas"):
        return [f"the gateway at {url} has no healthy {env} replica (0 of {replicas.get('replicas')}): start or "
                f"restart the {env} server (`python -m env_gateway.servers.{env}`, from .venvs/{env})"]
    return []


def secret_problems() -> List[str]:
    from env_gateway.secret_file import read_secret_file

    found = []
    files = [os.environ.get("COPE_GATEWAY_TOKEN_FILE")]
    wandb = os.path.join(os.environ.get("COPE_SECRETS_DIR", os.path.join(ROOT, ".secrets")), "wandb_api_key")
    files.append(wandb if os.path.exists(wandb) else None)
    for path in filter(None, files):
        try:
            read_secret_file(path)
        except ValueError as e:
            found.append(f"secret file: {e}")
    return found


def folder_problems(args: argparse.Namespace) -> List[str]:
    found = []
    for name in ("ckpt.path", "ckpt.output_dir", "logger.tensorboard_dir"):
        path = flag(args, name)
        if not path:
            continue
        existing = os.path.abspath(path)
        while not os.path.exists(existing):  # the folder is made later: the nearest existing parent must be writable
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            found.append(f"--{name} {path}: {existing} cannot be written: choose a folder you own (OUTPUT_DIR=...)")
    model, ckpt = flag(args, "actor.model_name_or_path"), flag(args, "ckpt.path")
    if model and ckpt and os.path.isdir(model):
        weights = sum(os.path.getsize(f) for pattern in ("*.safetensors", "*.bin")
                      for f in glob.glob(os.path.join(model, pattern)))
        existing = os.path.abspath(ckpt)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        free, need = shutil.disk_usage(existing).free, CHECKPOINT_PER_WEIGHT_BYTE * weights
        if need > free:
            found.append(f"--ckpt.path {ckpt}: one checkpoint of this model needs ~{need / 2**30:.1f} GiB "
                         f"(7x its {weights / 2**30:.1f} GiB of weights) and {existing} has {free / 2**30:.1f} GiB "
                         "free: free space or point --ckpt.path elsewhere")
    return found


def problems(args: argparse.Namespace, check_gateway: bool = True) -> List[str]:
    """Every problem the preflight finds in these (flat, parsed) ``train_ppo_ray`` args; [] when none."""
    found = [p for p in (combination_error(args), cpu_preset_error(args)) if p]
    for check in (gpu_problems, model_problems, dataset_problems, folder_problems):
        found += check(args)
    found += agent_and_gateway_problems(args, check_gateway) + secret_problems()
    return found


def bound_placement_groups() -> None:
    """Make ``ray.get(pg.ready())`` (how OpenRLHF waits for its placement groups) give up after RAY_PG_TIMEOUT_S
    seconds (default 600: a node may still be joining) with a SystemExit naming what was asked and what is free,
    instead of waiting forever while Ray's autoscaler repeats that no node type fits."""
    import ray
    from ray.util.placement_group import PlacementGroup

    if getattr(PlacementGroup.ready, "bounded", False):
        return
    ready = PlacementGroup.ready

    def bounded_ready(self):
        timeout = float(os.environ.get("RAY_PG_TIMEOUT_S", "600"))
        if not self.wait(timeout_seconds=timeout):
            asked = {}
            for bundle in self.bundle_specs:
                for key, value in bundle.items():
                    asked[key] = asked.get(key, 0) + value
            asked = dict(sorted(asked.items()))
            raise SystemExit(f"Ray could not place {len(self.bundle_specs)} bundles ({asked} in all) within "
                             f"{timeout:g}s (RAY_PG_TIMEOUT_S); free in the cluster: {ray.available_resources()}. "
                             "Add nodes (scripts/ray_cluster_worker.sh) or ask for fewer GPUs")
        return ready(self)

    bounded_ready.bounded = True
    PlacementGroup.ready = bounded_ready


def report(found: List[str]) -> str:
    lines = [f"preflight: {len(found)} problem{'s' if len(found) > 1 else ''} would stop this run "
             "(COPE_SKIP_PREFLIGHT=1 skips these checks):"]
    lines += [f"  {i}. {p}" for i, p in enumerate(found, 1)]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    check_gateway = "--no-gateway" not in argv
    argv = [a for a in argv if a != "--no-gateway"]
    args = build_parser().parse_args(argv)
    found = problems(args, check_gateway)
    if found:
        print(report(found), file=sys.stderr)
        return 2
    print("preflight: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
