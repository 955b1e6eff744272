"""The learning study: stock GRPO against each CoPE signal, over seeds and envs, from one warm start per env.

    .venv/bin/python benchmarks/learning_curve.py [--envs babyai textcraft] [--configs grpo filter forecast te info all]
        [--seeds 0 1 2] [--steps 60] [--eval-every 10] [--max-turns N] [--lr X] [--samples-per-prompt N]
        [--prompts-per-step N] [--micro-batch N] [--base-model DIR --sft-lr X --sft-epochs N --sft-demos N]
        [--gradient-checkpointing] [--out runs/learning_curve]

Per env, ``scripts/prepare_warm_start.py`` runs once (``WARM_START[env]``: item ids, held-out ids, demos (BabyAI: the
quickstart's view-hesitant demonstrator, on the compact text: ``BABYAI_TEXT=compact`` unless set), a tiny model and its
SFT) unless ``<out>/<env>/warm_start/model-sft`` exists. ``--base-model DIR`` warm-starts that pretrained checkpoint
instead of a tiny model (SmolLM2-135M-Instruct: ``scripts/get_smollm2.py``), with ``--sft-lr``, ``--sft-epochs`` and
``--sft-demos`` in place of the warm start's (a pretrained model wants a far lower rate than a tiny one's 2e-3, and
``--lr`` for RL likewise; its SFT costs far more per demo, and its memory wants ``--gradient-checkpointing``); such a
study gets its own ``--out``. Then every (config, seed) is its own ``python -m cope_rlhf.local train`` process from that
model: the quickstart's recipe (``RECIPE``; ``--lr``, ``--samples-per-prompt``, ``--prompts-per-step`` and
``--micro-batch`` put another value in place of its own, and such a study gets its own ``--out``;
``--gradient-checkpointing`` adds OpenRLHF's ``--actor.gradient_checkpointing_enable``, which changes memory, not the
recipe), ``TURNS[env]`` turns (``--max-turns``: that many, in training and in every eval; an eval cached in ``--out`` at
another limit is kept, so a study at another limit gets its own ``--out``), held-out evals every ``--eval-every`` steps,
and only the CoPE switches (``CONFIGS``; the forecast in joint mode) and ``--train.seed`` differing. A run whose
``summary.json`` (or record) exists is kept, so rerunning the command finishes an interrupted study (a run stopped
before it starts over); each run keeps how it trained (``recipe.json``: the recipe with those flags' values, the turn
limit), and a command that would train another way is refused before anything starts. ``--report-only`` trains nothing
(not even a missing warm start) and reports the runs that finished (each config over the seeds it has).

``--record DIR`` keeps, small, what the report reads: per finished run its ``run_record.json`` (``run_record``: the
step metrics of the tables, the held-out curve, each held-out episode's (item, success) at the first and the last
eval, the final models' eval metrics), per warm start its evals' metrics and its item ids, laid out as in ``--out``.
``--report-only --evals --out DIR`` then rebuilds the tables and the plot from DIR alone; the raw records
(TensorBoard events, episode files, models) stay in ``--out``. A study moved to a new machine resumes where it
stopped once DIR is copied into its ``--out`` (DIR's runs count as finished) and the warm start's ``model-sft`` is put
back beside it (from the machine that built it, or the git history named in docs/RESULTS.md).

Once a run is trained, ``scripts/eval.py`` scores its final model (``model/``) on the env's held-out items twice, each
with the training runs' turn limit and token budgets (``EVALS``, ``eval_command``): greedy (temperature 0, one
episode per item) into ``<run>/eval_greedy.json`` and sampled (temperature 1, 4 episodes per item: Avg@4, pass^1..4)
into ``<run>/eval_sampled_k4.json``; the warm start's ``model-sft`` gets the same two into ``<out>/<env>/warm_start/``
(the "before"). Each eval also leaves its ``.episodes.jsonl`` and ``.log`` there. An eval whose JSON exists is kept;
one in which the env server failed an episode is set aside as ``*.failed.json`` and stops the study (a rerun redoes
it). The evals share one gateway + env server per env (``EnvStack``). They run on vLLM: measured on BabyAI's 200
held-out items, 2 CPU cores, with another study's training running alongside, greedy took 238 s (12 s of it playing,
the rest vLLM's start) and sampled 204 s (75 s playing), so ~7 min per model; vLLM's start alone varied from ~40 to
~225 s with the load.

Writes ``<out>/learning_curve.png``: per env, held-out success (temperature 1, 2 episodes per item) per eval step, mean
over seeds ± 95% t-interval (as a band), one line per config (OpenRLHF evaluates at most ``--steps`` x
``--prompts-per-step`` held-out items, so a shorter study's runs play the first that many, written to
``<run>/heldout_in_training.jsonl``); and ``<out>/learning_curve.md``: per env and config, held-out success before and
at the last step (mean ± 95% half-width over seeds), the first eval step whose mean reaches GRPO's final mean ("never"
if none), and seconds per training step (median over all steps of all seeds, rollout + update), then the final models'
held-out evals: greedy success of the warm start → after training (mean ± 95% half-width over seeds) and sampled Avg@4
after training (mean reward over each item's 4 episodes, then over items; mean ± 95%), and a second table of how the
runs trained (``TRAINING``: rollout success and the env's rejected actions over each run's first and last 10 steps, KL
to the reference over the last 10 (the loss's ``train/kl``, which under the filter covers the mixed groups' rows only,
and the whole batch's ``cope/kl_all_rows``), the share of groups the degenerate filter took, TE's members' probability
of the action taken). Each run also gets its own scripts/run_report.py PNG. Slow: every run starts Ray and vLLM (~1 min)
and evaluates 400 episodes every ``--eval-every`` steps (~1 min each); a BabyAI step of stock GRPO takes 7-35 s on 2 CPU
cores (the fast end with AMX), so a 60-step run takes 15 to 45 minutes. With SmolLM2-135M (``--base-model``,
``--micro-batch 2``) a step of 32 episodes takes ~14 minutes there (docs/results/smollm2.md, "The study")."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repository's packages, and scripts/ as scripts.<name>

# Stock GRPO, GRPO + the degenerate-group filter (the quickstart's recipe), each CoPE signal on top of that filter,
# and all together. The signals sit on "filter", not on stock GRPO: stock GRPO's group_norm turns float rounding in
# all-equal groups into advantages up to +-60 (docs/METHOD.md, the filter), and a run that
# collapses from that would say nothing about the signal.
FILTER = ["--cope.grpo_filter_degenerate"]
# The recorded configs ran before skip-invalid became the default: it is off in them, so that they still mean what
# their records mean (their TE ran the earlier recipe: members' union top-M, a token-mean scale, long slots' first 16
# tokens, TE on filtered rows; that code is in git history, docs/RESULTS.md names the commit).
FORECAST = ["--cope.action_forecast_enable", "--cope.action_forecast_mode", "joint",
            "--cope.action_forecast_skip_invalid", "off"]
TE = ["--cope.te_enable", "--cope.te_lambda", "0.1", "--cope.te_warmup_steps", "0"]
INFO = ["--cope.info_intrinsic_weight", "0.1"]
# TE as upstream CoPE runs it (docs/METHOD.md): skip-invalid (the default now) for the forecast's targets and TE's
# members and targets, and a warm-up: upstream's 50 steps of its ~300-step runs (three ScalingInter-RL stages of
# 100), scaled to this study's 40-60 steps. te_up_l0 measures the members without pulling on the policy.
FORECAST_UP = ["--cope.action_forecast_enable", "--cope.action_forecast_mode", "joint"]
TE_UP = ["--cope.te_enable", "--cope.te_lambda", "0.1", "--cope.te_warmup_steps", "10"]
TE_UP_L0 = ["--cope.te_enable", "--cope.te_lambda", "0", "--cope.te_warmup_steps", "10"]
# "all_but_te": every signal except TE, because TE is what makes "all" fall (docs/RESULTS.md).
CONFIGS = {"grpo": [], "filter": FILTER, "forecast": FILTER + FORECAST, "te": FILTER + FORECAST + TE,
           "info": FILTER + INFO, "all": FILTER + FORECAST + TE + INFO, "all_but_te": FILTER + FORECAST + INFO,
           "te_up": FILTER + FORECAST_UP + TE_UP, "te_up_l0": FILTER + FORECAST_UP + TE_UP_L0,
           "all_up": FILTER + FORECAST_UP + TE_UP + INFO}
WARM_START = {"babyai": ["--levels", "1", "--heldout", "200", "--demos", "300", "--demo-policy", "view-hesitant",
                         "--epochs", "16"],
              # 344 training items; 200 demos x 16 epochs left the tiny model at greedy 0.03 / sampled 0.01 held-out and
              # 0-0.02 rollout success (no room to learn), 300 x 32 at 0.07 / 0.05 and 0.13-0.34; a 4.68M model
              # (--hidden-size 256 --layers 4) scored no better (0.05 / 0.04)
              "textcraft": ["--heldout", "100", "--demos", "300", "--epochs", "32"]}
TURNS = {"babyai": 3, "textcraft": 10}
# The quickstart's recipe less its CoPE switch (scripts/quickstart.sh; tests/test_learning_curve.py keeps the two
# equal, flag for flag).
RECIPE = ["--algo.advantage.estimator", "group_norm", "--actor.loss_agg_mode", "seq-mean-token-mean",
          "--rollout.batch_size", "8", "--rollout.n_samples_per_prompt", "8", "--train.batch_size", "32",
          "--train.micro_batch_size", "8", "--rollout.micro_batch_size", "8", "--actor.adam.lr", "1e-4",
          "--actor.lr_warmup_ratio", "0.1",
          "--actor.lr_scheduler", "constant_with_warmup", "--algo.kl.init_coef", "0.01",
          "--algo.kl.use_loss", "--algo.kl.estimator", "k3", "--vllm.enable_prefix_caching",
          "--eval.temperature", "1.0", "--eval.n_samples_per_prompt", "2"]
# The held-out evals of a final model (scripts/eval.py): name -> (file in the run's folder, how it plays). Greedy scores
# the model's most likely actions, free of sampling luck; sampled plays at the temperature of training and of its
# in-training evals, 4 episodes per item for Avg@4 and pass^k.
EVALS = {"greedy": ("eval_greedy.json", ["--temperature", "0", "--k", "1"]),
         "sampled": ("eval_sampled_k4.json", ["--temperature", "1", "--k", "4"])}
# Token budgets as the training runs had them. The trainer's rollout.max_new_tokens (64) does not bind there: OpenRLHF's
# MultiTurnAgentExecutor sets each turn's max_tokens to what is left of data.max_len (2048) after the conversation so
# far, and trained models use that room (BabyAI grpo seed 0 on 5 held-out items: 29 of 48 sampled replies and 7 of 8
# greedy ones over 64 tokens, up to 291). eval.py caps a turn at min(--max-new-tokens, what is left), so both at 2048
# play the episodes as training played them.
EVAL_BUDGET = ["--max-new-tokens", "2048", "--max-length", "2048"]
# vLLM rather than HF generate, measured on 20 held-out BabyAI items of a warm start (2 CPU cores, another study
# training alongside): vLLM needs ~40-225 s to start, then played 20 greedy episodes in 11 s and 80 sampled ones in
# 12 s; HF starts in ~5 s but took 24 s and 60 s (each batch padded to its longest reply, fp32, no paged KV cache),
# and a trained model's long replies slow it further (40 replies of up to 305 tokens: 252 s). For 200 items that is
# ~4 + ~3.5 min with vLLM (measured) against an estimated ~2.5-4 + ~10 min with HF. vLLM is also what training
# samples with (bf16). One fixed seed for every model, so before and after are scored alike.
EVAL_ENGINE = ["--engine", "vllm", "--seed", "0"]
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def half_width(values: list[float]) -> float:
    """95% t-interval half-width of the mean (0 for a single value)."""
    if len(values) < 2:
        return 0.0
    return T975.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def run_child(cmd: list[str], log=None, env: dict | None = None) -> int:
    """Run ``cmd`` to its end and return its exit code; if this process is stopped meanwhile (Ctrl-C, or SIGTERM,
    which ``main`` turns into SystemExit), the child gets SIGTERM and up to 60 s to stop what it started (the
    trainer: gateway, env servers, Ray, vLLM) before SIGKILL. subprocess.run would SIGKILL it at once."""
    from env_gateway.process import stop_process

    child = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT if log else None)
    try:
        return child.wait()
    except BaseException:
        stop_process(child, grace=60)
        raise


def warm_start(env: str, out: str, args: argparse.Namespace) -> str:
    folder = os.path.join(out, env, "warm_start")
    if not os.path.isdir(os.path.join(folder, "model-sft")):
        flags = list(WARM_START[env])
        for flag, value in (("--epochs", args.sft_epochs), ("--demos", args.sft_demos)):
            if value is not None:
                flags[flags.index(flag) + 1] = str(value)
        flags += [*(["--sft-lr", str(args.sft_lr)] if args.sft_lr is not None else []),
                  *(["--sft-gradient-checkpointing"] if args.gradient_checkpointing else []),
                  *(["--base-model", args.base_model] if args.base_model is not None else [])]
        cmd = [sys.executable, os.path.join(ROOT, "scripts", "prepare_warm_start.py"), "--env", env, "--out", folder,
               *flags]
        print(f"[learning_curve] {env}: warm start -> {folder}", flush=True)
        if run_child(cmd) != 0:
            raise RuntimeError(f"{env}: the warm start failed; see its output above")
    return folder


def study_recipe(args: argparse.Namespace, turns: int) -> dict:
    """How every run of a study trains, whatever its config and seed: RECIPE with --lr / --samples-per-prompt /
    --prompts-per-step / --micro-batch's value in place of its own (the same words when a flag repeats RECIPE's value),
    and the turn limit. Kept in each run's ``RECIPE_FILE``."""
    words = list(RECIPE)
    for flag, value in (("--actor.adam.lr", args.lr), ("--rollout.n_samples_per_prompt", args.samples_per_prompt),
                        ("--rollout.batch_size", args.prompts_per_step),
                        ("--train.micro_batch_size", args.micro_batch),
                        ("--rollout.micro_batch_size", args.micro_batch)):
        if value is not None and float(value) != float(words[words.index(flag) + 1]):
            words[words.index(flag) + 1] = str(value)
    return {"recipe": words, "max_turns": turns}


RECIPE_FILE = "recipe.json"


def check_recipe(env_folder: str, wanted: dict) -> None:
    """Refuse to add runs to a study whose runs trained another way (their curves would share a table and a plot as
    if alike): every ``RECIPE_FILE`` under ``env_folder`` must equal ``wanted``. Runs recorded before the file existed
    cannot be checked; they are named."""
    unchecked = []
    for run in sorted(os.listdir(env_folder)) if os.path.isdir(env_folder) else []:
        path = os.path.join(env_folder, run, RECIPE_FILE)
        if not os.path.isfile(path):  # the warm start keeps its evals in a RUN_RECORD too: not a run
            if run != "warm_start" and any(os.path.isfile(os.path.join(env_folder, run, f))
                                           for f in (RUN_RECORD, "ckpt/summary.json")):
                unchecked.append(run)
            continue
        with open(path) as f:
            had = json.load(f)
        if had != wanted:
            # {flag: its value, "on" for a switch} of each recipe's words
            values = [{word: "on" if after.startswith("--") else after
                       for word, after in zip(words, [*words[1:], "--"]) if word.startswith("--")}
                      for words in (had["recipe"], wanted["recipe"])]
            differs = [f"{flag} {values[0].get(flag, 'absent')} there, {values[1].get(flag, 'absent')} now"
                       for flag in sorted({*values[0], *values[1]}) if values[0].get(flag) != values[1].get(flag)]
            if had["max_turns"] != wanted["max_turns"]:
                differs.append(f"--max-turns {had['max_turns']} there, {wanted['max_turns']} now")
            sys.exit(f"learning_curve: {os.path.join(env_folder, run)} trained another way than this command would "
                     f"train ({'; '.join(differs)}). Give the study's own --lr / --samples-per-prompt / "
                     "--prompts-per-step / --micro-batch / --max-turns to add runs to it (docs/RESULTS.md names each "
                     "recorded study's command), or another --out for a new study.")
    if unchecked:
        print(f"[learning_curve] {env_folder}: {', '.join(unchecked)} recorded no {RECIPE_FILE} (trained before it "
              "was kept); check that this command trains as they did (docs/RESULTS.md names each study's command)",
              flush=True)


def run_one(env: str, config: str, seed: int, start: str, out: str, turns: int, args) -> None:
    recipe = study_recipe(args, turns)
    # A run stopped before its summary.json starts over: its TensorBoard events would mix with the new run's.
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    heldout = os.path.join(start, "data", "heldout.jsonl")
    # OpenRLHF caps the eval set at data.max_samples, which the trainer sets to a pass of --steps x prompts a step:
    # a study shorter than its held-out items evaluates the first that many while it trains (its final evals,
    # scripts/eval.py, play every item).
    in_training = args.steps * int(recipe["recipe"][recipe["recipe"].index("--rollout.batch_size") + 1])
    if os.path.isfile(heldout):
        with open(heldout) as f:
            items = f.readlines()
        if len(items) > in_training:
            heldout = os.path.join(out, "heldout_in_training.jsonl")
            with open(heldout, "w") as f:
                f.writelines(items[:in_training])
            print(f"[learning_curve] {env} {config} seed {seed}: the in-training evals play the first {in_training} "
                  f"of the {len(items)} held-out items (--steps x --prompts-per-step)", flush=True)
    cmd = [sys.executable, "-m", "cope_rlhf.local", "train", "--env", env,
           "--actor.model_name_or_path", os.path.join(start, "model-sft"),
           "--data.prompt_dataset", os.path.join(start, "data", "train.jsonl"),
           "--eval.dataset", heldout,
           "--local.steps", str(args.steps), "--eval.steps", str(args.eval_every),
           "--local.max_turns", str(turns), "--train.seed", str(seed),
           "--ckpt.path", os.path.join(out, "ckpt"), "--ckpt.output_dir", os.path.join(out, "model"),
           "--ckpt.save_steps", "-1", "--logger.tensorboard_dir", os.path.join(out, "tb"), *recipe["recipe"],
           *CONFIGS[config], *(["--actor.gradient_checkpointing_enable"] if args.gradient_checkpointing else [])]
    with open(os.path.join(out, RECIPE_FILE), "w") as f:
        json.dump(recipe, f, indent=1)
    t = time.time()
    with open(os.path.join(out, "train.log"), "w") as log:
        code = run_child(cmd, log)
    if code != 0:
        raise RuntimeError(f"{env} {config} seed {seed} failed ({code}); see {out}/train.log")
    print(f"[learning_curve] {env} {config} seed {seed}: {time.time() - t:.0f} s", flush=True)


def eval_command(env: str, model: str, items: str, folder: str, name: str, gateway: str,
                 turns: int) -> tuple[list[str], dict]:
    """scripts/eval.py's command line for ``EVALS[name]`` of ``model`` into ``folder``, and the environment to run it in
    (the training runs' turn limit ``turns``, read by the agent func as MAX_TURNS)."""
    import torch

    from cope_rlhf.cpu_vllm import vllm_cpu_env

    file, sampling = EVALS[name]
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "eval.py"), "--env", env, "--model", model, "--items", items,
           *sampling, *EVAL_BUDGET, *EVAL_ENGINE, "--gateway", gateway, "--out", os.path.join(folder, file)]
    return cmd, {**os.environ, **({} if torch.cuda.is_available() else vllm_cpu_env()), "MAX_TURNS": str(turns)}


def evaluate(env: str, model: str, folder: str, items: str, gateway: str, turns: int,
             names=tuple(EVALS)) -> dict[str, dict]:
    """Per ``EVALS`` name in ``names``, scripts/eval.py's metrics of ``model`` on ``items`` at ``turns`` turns; each
    eval runs once, its JSON cached in ``folder`` (or its metrics in the folder's ``RUN_RECORD``, in a record)."""
    recorded = {}
    if os.path.isfile(os.path.join(folder, RUN_RECORD)):
        with open(os.path.join(folder, RUN_RECORD)) as f:
            recorded = json.load(f).get("evals", {})
    metrics = {}
    for name in names:
        file = EVALS[name][0]
        path = os.path.join(folder, file)
        stem = path[:-len(".json")]
        if not os.path.isfile(path) and name in recorded:
            metrics[name] = recorded[name]
            continue
        if not os.path.isfile(path):
            cmd, env_vars = eval_command(env, model, items, folder, name, gateway, turns)
            t = time.time()
            with open(stem + ".log", "w") as log:
                code = run_child(cmd, log, env_vars)
            if code != 0:
                raise RuntimeError(f"{env} {name} eval of {model} failed ({code}); see {stem}.log")
            with open(path) as f:
                failures = json.load(f)["env_failures"]
            if failures:  # those episodes scored 0 for the env server's fault, not the model's: not a number to keep
                os.replace(path, stem + ".failed.json")
                raise RuntimeError(f"{env} {name} eval of {model}: the env server failed {failures} episodes; see "
                                   f"{stem}.log (rerunning the study redoes it)")
            print(f"[learning_curve] {env} {name} eval of {model}: {time.time() - t:.0f} s", flush=True)
        with open(path) as f:
            metrics[name] = json.load(f)["metrics"]
    return metrics


# What --record keeps of a run's or of the warm start's folder, relative to it: the run's compact record and the warm
# start's item ids (what the runs played).
RUN_RECORD = "run_record.json"
RECORD = [RUN_RECORD, RECIPE_FILE, "data/train.jsonl", "data/heldout.jsonl"]


def record(folder: str, out: str, to: str) -> None:
    """Copy each ``RECORD`` file that ``folder`` (inside ``out``) has to the same place under ``to``."""
    for name in RECORD:
        source = os.path.join(folder, name)
        if os.path.isfile(source):
            target = os.path.join(to, os.path.relpath(source, out))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, target)


def held_out_episodes(out: str) -> dict[int, list]:
    """{step: [[item, success], ...]} of the run's first and last in-training eval (``ckpt/eval_episodes.jsonl``),
    enough for a gain paired by item."""
    path = os.path.join(out, "ckpt", "eval_episodes.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = sorted({r["step"] for r in rows})
    return {s: [[r["item_id"], r.get("success", r["reward"])] for r in rows if r["step"] == s]
            for s in {steps[0], steps[-1]}} if steps else {}


def run_record(out: str, evals: dict[str, dict]) -> dict:
    """What the report reads of a finished run: ``read_run``'s step metrics, ``evals`` (the final models' eval
    metrics) and ``held_out_episodes``; written to ``<out>/run_record.json`` while the raw records are there, read
    back from it when they are not (a --record folder)."""
    path = os.path.join(out, RUN_RECORD)
    if os.path.isfile(os.path.join(out, "ckpt", "summary.json")):
        data = {**read_run(out), "evals": evals, "episodes": held_out_episodes(out)}
        with open(path, "w") as f:
            json.dump(data, f, indent=None, separators=(",", ":"))
    with open(path) as f:  # read back in both cases, so that a record and a fresh report see the same numbers
        data = json.load(f)
    as_steps = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731 (JSON keys are strings)
    return {"eval": as_steps(data["eval"]), "step_s": data["step_s"],
            "train": {tag: as_steps(values) for tag, values in data["train"].items()},
            "episodes": as_steps(data["episodes"]), **{**data["evals"], **evals}}


def warm_start_evals(start: str, evals: dict[str, dict]) -> dict[str, dict]:
    """The warm start's eval metrics: ``evals`` (run or cached), recorded in its ``run_record.json`` with those of an
    earlier report (a --record folder keeps only that file)."""
    path = os.path.join(start, RUN_RECORD)
    kept = {}
    if os.path.isfile(path):
        with open(path) as f:
            kept = json.load(f)["evals"]
    kept.update(evals)
    if os.path.isdir(start):
        with open(path, "w") as f:
            json.dump({"evals": kept}, f, indent=1)
    return kept


def cached(folder: str, names: list) -> list:
    """``names``, plus every eval already cached in ``folder`` (reading it costs nothing)."""
    return [name for name, (file, _) in EVALS.items()
            if name in names or os.path.isfile(os.path.join(folder, file))]


# How each run trained, from its step metrics: what a collapse shows before the held-out evals do (TE's: its members'
# probability of the taken action climbs, then the env rejects several times as many actions and the filter takes
# every group).
TRAINING = {"success": "train/rollout/success_rate", "rejected": "train/rollout/rejected_action_rate",
            "kl": "train/kl", "kl_all_rows": "train/cope/kl_all_rows", "filtered": "train/cope/filtered_frac",
            "te_member": "train/cope/te_member_first_token_prob", "te_member_valid": "train/cope/te_member_prob_valid",
            "te_invalid": "train/cope/te_invalid_target_frac"}
WINDOW = 10  # steps averaged at the start and at the end of a run
# train/kl is the KL loss's term, over the rows left in the loss: under the filter only the mixed groups' rows, so the
# whole batch's KL (cope/kl_all_rows, logged since 02b83cd) gets its own column; "—" for runs from before it.
TRAINING_HEADER = [f"| env | config | seeds | rollout success, steps 1-{WINDOW} → last {WINDOW} "
                   f"| actions the env rejected, steps 1-{WINDOW} → last {WINDOW} "
                   f"| kl to the reference in the loss (train/kl; the filter on: its rows only), last {WINDOW} "
                   f"| kl to the reference, every row (cope/kl_all_rows), last {WINDOW} "
                   "| groups the filter took, all steps | TE members' probability of the taken action's first token, "
                   f"last {WINDOW} | the same over actions the env accepted (cope/te_member_prob_valid), "
                   f"steps 1-{WINDOW} → last {WINDOW} | TE slots whose action the env rejected, last {WINDOW} |",
                   "|---|---|---|---|---|---|---|---|---|---|---|"]


def read_run(out: str) -> dict:
    """{"eval": {step: success}, "step_s": [seconds per step], "train": {tag: {step: value}} for the ``TRAINING``
    tags the run logged} from the run's TensorBoard events."""
    from cope_rlhf.tb_scalars import read_scalars

    scalars = read_scalars(os.path.join(out, "tb"))
    if "train/timing/step_total" in scalars:  # OpenRLHF's own step timing (one driver, after commit 6e0d933)
        step_s = list(scalars["train/timing/step_total"].values())
    else:  # runs of the retired local loop: rollout and update timed apart
        rollout, update = scalars["rollout/time_s"], scalars["train/time_s"]
        step_s = [rollout[s] + update[s] for s in rollout if s in update]
    return {"eval": scalars["eval/success_rate"], "step_s": step_s,
            "train": {tag: scalars[tag] for tag in TRAINING.values() if tag in scalars}}


HEADER = ["| env | config | seeds | held-out success before | after the last step (mean ± 95%) "
          "| first eval step at GRPO's final | s / step | greedy success before → after (mean ± 95%) "
          "| sampled Avg@4 after (mean ± 95%) |", "|---|---|---|---|---|---|---|---|---|"]


def summarize(env: str, runs: dict[str, list[dict]], greedy_before: float | None) -> tuple[list[str], dict]:
    """Table rows for one env, and per config the curve (steps, means, half-widths). A run is ``read_run``'s dict plus
    its final model's ``evaluate`` metrics ("greedy", "sampled"; "not run" in the table where a seed lacks one);
    ``greedy_before``: the warm start's greedy success (None: not run)."""
    def cell(values: list, before: str = "") -> str:
        if any(v is None for v in values):
            return "not run"
        spread = f" ± {half_width(values):.3f}" if len(values) > 1 else " (one seed)"
        return f"{before}{statistics.fmean(values):.3f}{spread}"

    curves, rows = {}, []
    for config, seeds in runs.items():
        steps = sorted(set.intersection(*(set(r["eval"]) for r in seeds)))
        values = {s: [r["eval"][s] for r in seeds] for s in steps}
        curves[config] = (steps, [statistics.fmean(values[s]) for s in steps], [half_width(values[s]) for s in steps])
    goal = curves["grpo"][1][-1] if "grpo" in curves else None
    for config, (steps, means, halves) in curves.items():
        reach = next((s for s, m in zip(steps, means) if goal is not None and m >= goal), None)
        step_s = statistics.median(t for r in runs[config] for t in r["step_s"])
        greedy = [r["greedy"]["success_rate"] if "greedy" in r else None for r in runs[config]]
        sampled = [r["sampled"]["avg@4"] if "sampled" in r else None for r in runs[config]]
        before = "not run" if greedy_before is None else f"{greedy_before:.3f}"
        final = [r["eval"][steps[-1]] for r in runs[config]]
        rows.append(f"| {env} | {config} | {len(runs[config])} | {means[0]:.3f} | {cell(final)} "
                    f"| {'never' if reach is None else reach} | {step_s:.1f} "
                    f"| {cell(greedy, f'{before} → ')} | {cell(sampled)} |")
    return rows, curves


def training_rows(env: str, runs: dict[str, list[dict]]) -> list[str]:
    """``TRAINING_HEADER``'s rows: per config, each ``TRAINING`` metric averaged over a window of each run's steps
    (its first ``WINDOW``, its last ``WINDOW`` or all), then over the seeds that logged it; "—" where no seed logged
    the metric (the filter's share without the filter, TE's probability without TE), "(k of n seeds)" after a mean
    that fewer than the row's seeds logged (a metric added between the runs of one config)."""
    def window(config: str, name: str, part: str) -> str:
        values = []
        for run in runs[config]:
            logged = run["train"].get(TRAINING[name], {})
            steps = sorted(logged)
            steps = {"first": steps[:WINDOW], "last": steps[-WINDOW:], "all": steps}[part]
            if steps:
                values.append(statistics.fmean(logged[s] for s in steps))
        if not values:
            return "—"
        seeds = "" if len(values) == len(runs[config]) else f" ({len(values)} of {len(runs[config])} seeds)"
        return f"{statistics.fmean(values):.3f}{seeds}"

    return [f"| {env} | {config} | {len(seeds)} | {window(config, 'success', 'first')} → "
            f"{window(config, 'success', 'last')} | {window(config, 'rejected', 'first')} → "
            f"{window(config, 'rejected', 'last')} | {window(config, 'kl', 'last')} "
            f"| {window(config, 'kl_all_rows', 'last')} "
            f"| {window(config, 'filtered', 'all')} | {window(config, 'te_member', 'last')} "
            f"| {window(config, 'te_member_valid', 'first')} → {window(config, 'te_member_valid', 'last')} "
            f"| {window(config, 'te_invalid', 'last')} |"
            for config, seeds in runs.items()]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", default=list(WARM_START), choices=list(WARM_START))
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", default="runs/learning_curve")
    parser.add_argument("--max-turns", type=int,
                        help="turn limit of every episode, in training and in the evals (default: TURNS per env)")
    parser.add_argument("--lr", type=float, help="the actor's learning rate (default: RECIPE's, 1e-4; the studies "
                                                  "recorded under docs/results ran at 3e-4)")
    parser.add_argument("--samples-per-prompt", type=int,
                        help="episodes per prompt, GRPO's group (default: RECIPE's, 8)")
    parser.add_argument("--prompts-per-step", type=int, help="prompts per training step (default: RECIPE's, 8)")
    # In the recipe, not a memory switch: with the degenerate filter's dropped rows a batch's micro-batches differ
    # in size, and OpenRLHF averages the loss per micro-batch.
    parser.add_argument("--micro-batch", type=int,
                        help="sequences per forward/backward pass of the policy and the reference (default: RECIPE's, "
                             "8; a divisor of its --train.batch_size 32): SmolLM2's 49152-token vocabulary at 8 "
                             "sequences of ~760 tokens took the policy past 15 GB")
    parser.add_argument("--base-model", help="warm-start this pretrained checkpoint folder (e.g. SmolLM2 from "
                                             "scripts/get_smollm2.py) instead of a tiny model built per env")
    parser.add_argument("--sft-lr", type=float, help="the warm start's SFT learning rate (default: "
                                                     "prepare_warm_start.py's, 2e-3, for a tiny model)")
    parser.add_argument("--sft-epochs", type=int, help="the warm start's SFT epochs (default: WARM_START's per env)")
    parser.add_argument("--sft-demos", type=int, help="the warm start's expert episodes (default: WARM_START's per "
                                                      "env, 300; a 135M model's SFT takes ~1 min per 8 on 2 cores)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="the warm start's SFT and every run's policy recompute each decoder layer's activations "
                             "in the backward pass: the same numbers in far less memory, for a deep model such as "
                             "SmolLM2 (not part of recipe.json: a study may turn it on or off between runs)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: report the (config, seed) runs that finished (and run their evals)")
    parser.add_argument("--evals", nargs="*", default=list(EVALS), choices=list(EVALS),
                        help="the final models' held-out evals to run (cached ones are read anyway; none: --evals)")
    parser.add_argument("--record", help="copy what the report reads of each finished run and of each warm start "
                                         "(its evals' metrics and item ids; no model) into this folder, laid out as "
                                         "in --out (docs/results/learning_study)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.eval_every < 1 or (args.max_turns is not None and args.max_turns < 1):
        parser.error("--steps, --eval-every and --max-turns must be >= 1")
    recipe = dict(zip(RECIPE, RECIPE[1:]))
    train_batch = int(recipe["--train.batch_size"])
    episodes = ((args.samples_per_prompt or int(recipe["--rollout.n_samples_per_prompt"]))
                * (args.prompts_per_step or int(recipe["--rollout.batch_size"])))
    if (args.lr is not None and args.lr <= 0) or episodes % train_batch:
        parser.error(f"--lr must be > 0, and --samples-per-prompt x --prompts-per-step (now {episodes} episodes a "
                     f"step) a multiple of the recipe's --train.batch_size {train_batch}")
    if args.micro_batch is not None and (args.micro_batch < 1 or train_batch % args.micro_batch):
        parser.error(f"--micro-batch {args.micro_batch}: give a divisor of the recipe's --train.batch_size "
                     f"{train_batch} (1, 2, 4, 8, ...)")
    if (args.sft_lr is not None and args.sft_lr <= 0) or any(n is not None and n < 1
                                                            for n in (args.sft_epochs, args.sft_demos)):
        parser.error("--sft-lr must be > 0, and --sft-epochs and --sft-demos >= 1")
    if args.base_model is not None and not os.path.isfile(os.path.join(args.base_model, "config.json")):
        parser.error(f"--base-model {args.base_model}: no config.json there; give a Hugging Face checkpoint folder "
                     "(SmolLM2: python scripts/get_smollm2.py --out DIR)")
    if args.record and os.path.abspath(args.record) == os.path.abspath(args.out):
        parser.error("--record must be another folder than --out (the runs are already there)")
    if not args.report_only:  # before anything trains: runs of another recipe are refused, not mixed into the study
        for env in args.envs:
            check_recipe(os.path.join(args.out, env), study_recipe(args, args.max_turns or TURNS[env]))
    # SIGTERM (a scheduler, kill) unwinds like Ctrl-C: the child running now and the evals' EnvStack are stopped on
    # the way out (without it, the study died alone and left its trainer or warm start and its gateway running)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # The BabyAI warm start's demonstrator and the recipe were tuned on the compact text
    # (env_gateway/servers/babyai.py); every server the study starts (warm start, trainer, evals) inherits it.
    os.environ.setdefault("BABYAI_TEXT", "compact")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cope_rlhf.local.env_stack import EnvStack
    from scripts.run_report import main as run_report

    rows, trained = list(HEADER), list(TRAINING_HEADER)
    fig, axes = plt.subplots(1, len(args.envs), figsize=(6 * len(args.envs), 4), squeeze=False)
    for ax, env in zip(axes[0], args.envs):
        start = os.path.join(args.out, env, "warm_start") if args.report_only else warm_start(env, args.out, args)
        items = os.path.join(start, "data", "heldout.jsonl")
        turns = args.max_turns or TURNS[env]
        runs = {}
        with EnvStack(env) as stack:  # the evals' gateway (each training run starts its own)
            before = warm_start_evals(start, evaluate(env, os.path.join(start, "model-sft"), start, items, stack.url,
                                                      turns, cached(start, args.evals)))
            if args.record:
                record(start, args.out, args.record)
            for config in args.configs:
                for seed in args.seeds:
                    out = os.path.join(args.out, env, f"{config}_seed{seed}")
                    raw = os.path.isfile(os.path.join(out, "ckpt", "summary.json"))  # finished, its raw records here
                    if not raw and not os.path.isfile(os.path.join(out, RUN_RECORD)):  # not finished (or no record)
                        if args.report_only:
                            continue
                        run_one(env, config, seed, start, out, turns, args)
                        raw = True
                    if raw:  # --tensorboard: the summary names the folder by its path at training time
                        run_report(["--ckpt", os.path.join(out, "ckpt"), "--tensorboard", os.path.join(out, "tb"),
                                    "--png", os.path.join(out, "curve.png")])
                    runs.setdefault(config, []).append(run_record(out, evaluate(
                        env, os.path.join(out, "model"), out, items, stack.url, turns, cached(out, args.evals))))
                    if args.record:
                        record(out, args.out, args.record)
        env_rows, curves = summarize(env, runs, before["greedy"]["success_rate"] if "greedy" in before else None)
        rows += env_rows
        trained += training_rows(env, runs)
        for config, (steps, means, halves) in curves.items():
            n = len(runs[config])
            ax.plot(steps, means, marker="o", label=f"{config} ({n} seed{'s' if n > 1 else ''})")
            ax.fill_between(steps, [m - h for m, h in zip(means, halves)], [m + h for m, h in zip(means, halves)],
                            alpha=0.15)
        seeds = sorted({len(r) for r in runs.values()})
        ax.set_title(f"{env}: held-out success (temperature 1),\nmean ± 95% over {'/'.join(map(str, seeds))} seeds "
                     "per config", fontsize=10)
        ax.set_xlabel("training step")
        ax.set_ylabel("success rate")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "learning_curve.png")
    fig.savefig(png, dpi=120)
    command = "benchmarks/learning_curve.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = "\n".join([f"Command: `{command.strip()}`", "", *rows, "", "How the runs trained (means over each run's "
                       "steps named, then over its seeds):", "", *trained])
    with open(os.path.join(args.out, "learning_curve.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"[learning_curve] plot: {png}")
    with open(os.path.join(args.out, "learning_curve.json"), "w") as f:
        json.dump({"args": vars(args), "table": rows, "training": trained}, f, indent=1)
    return png


if __name__ == "__main__":
    main()
