#!/usr/bin/env bash
# The first command: train a small agent on BabyAI with GRPO on one CPU machine (no GPU, no model hub) and see its
# held-out success before and after, with intervals. What it shows: docs/RESULTS.md, "The quickstart".
#
#   bash scripts/quickstart.sh
#
# 1. set-up (scripts/setup.sh: the trainer venv and the BabyAI server's venv; a second run installs nothing)
# 2. the warm start (scripts/prepare_warm_start.py): BabyAI level 1 (GoToRedBallGrey) item ids of the train split,
#    the last 200 held out for evaluation (never trained on), demos of 300 training items from a demonstrator that
#    reads only the text view and hesitates: when the view lists the red ball it goes there only half of the time,
#    otherwise (and whenever the ball is out of view) it searches at random (turn left / turn right / move forward);
#    a small model built offline, 16 epochs of SFT on the demos (cosine learning rate; fewer epochs leave the model
#    unable to tell whether the ball is in view). The warm start imitates the hesitation, so it starts well below
#    what the room allows, and RL has to find out that going to the ball when it is in view pays.
# 3. GRPO (python -m cope_rlhf.local train: the cluster trainer, python -m cope_rlhf.cli.train_ppo_ray, in its CPU
#    mode, with one policy rank, one reference rank and one vLLM engine): 3 turns per episode, 50 steps of 8 items
#    x 8 episodes, 2 updates a step (micro-batches of 8), advantages normalised within each item's group (group_norm) with CoPE's
#    degenerate-group filter on (groups whose eight rewards are equal train nothing: OpenRLHF's group_norm would
#    hand each of them one shared advantage of up to +-60 made of float rounding, since BabyAI's wins pay
#    1 - 0.9 * steps / max_steps; they leave the loss unless fewer than two of the eight groups survive, and then
#    the batch stays whole, so that one group does not take a full update alone),
#    each episode's loss the mean over its own tokens (seq-mean-token-mean), KL loss 0.01 to the warm start,
#    learning rate 1e-4 after a warm-up, held constant (at 3e-4 cosine decay gained +0.165 where constant gave
#    +0.307, but one of two seeds turned deterministic at steps 27-29 and ended below its start, and the other drifted
#    further from the warm start than either run at 1e-4: docs/RESULTS.md, "The quickstart");
#    held-out evaluation at temperature 1 (2 episodes per item) before training and every 10 steps
# 4. scripts/run_report.py: held-out success before -> after with 95% intervals (the gain paired by item), and a
#    PNG of rollout and held-out success per step
#
# Environment: QUICKSTART_DIR (default runs/quickstart), QUICKSTART_STEPS (RL steps, default 50),
# QUICKSTART_EVAL_EVERY (default 10), QUICKSTART_DEMOS (default 300), QUICKSTART_HELDOUT (default 200),
# QUICKSTART_COPE_FLAGS (more trainer flags added to the run, after the recipe's, so that a flag given twice takes
# this value: e.g. "--cope.info_intrinsic_weight 0.1", or "--actor.adam.lr 3e-4 --train.seed 1"; default none: the
# recipe is measured with GRPO and the degenerate-group filter only),
# QUICKSTART_SKIP_SETUP=1 (use the venvs as they are). Everything it starts is stopped on exit.
#
# The terminal shows each stage's progress (scripts/quickstart_progress.py: a line per SFT epoch and per GRPO step,
# each held-out eval, time elapsed and left, and at least a line a minute); each stage's whole output is in
# QUICKSTART_DIR/logs/<stage>.log.
case " $* " in *" -h "* | *" --help "*) exec bash "$(dirname "${BASH_SOURCE[0]}")/lib/help.sh" "${BASH_SOURCE[0]}" ;; esac
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DIR="${QUICKSTART_DIR:-runs/quickstart}"
STEPS="${QUICKSTART_STEPS:-50}"
EVAL_EVERY="${QUICKSTART_EVAL_EVERY:-10}"
DEMOS="${QUICKSTART_DEMOS:-300}"
HELDOUT="${QUICKSTART_HELDOUT:-200}"
EPOCHS=16  # the warm start's SFT epochs (the recipe: stage 2 above)
read -r -a COPE_FLAGS <<< "${QUICKSTART_COPE_FLAGS:-}"  # words, as on a command line
PY="$ROOT/.venv/bin/python"
# The recipe was tuned on the BabyAI server's compact text (env_gateway/servers/babyai.py); its default is AgentGym's.
# Every server started below (warm start, trainer, evals) inherits the variable.
export BABYAI_TEXT="${BABYAI_TEXT:-compact}"
T0=$SECONDS
CHILD="" WATCHER=""

stop_watcher() {
  if [[ -n "$WATCHER" ]]; then kill -TERM "$WATCHER" 2>/dev/null || true; wait "$WATCHER" 2>/dev/null || true; fi
  WATCHER=""
}

cleanup() {
  local code=$?
  stop_watcher
  if [[ -n "$CHILD" ]] && kill -0 "$CHILD" 2>/dev/null; then
    echo "[quickstart] stopping the running step (pid $CHILD) ..." >&2
    kill -TERM -- "-$CHILD" 2>/dev/null || true
    for _ in $(seq 1 20); do kill -0 "$CHILD" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$CHILD" 2>/dev/null || true
  fi
  (( code == 0 )) || echo "[quickstart] failed (exit $code) after $((SECONDS - T0)) s; logs under $DIR/logs" >&2
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# step NAME TOTAL command...: run it in its own process group (so cleanup can stop all of it), its whole output in
# the stage's log, its progress (TOTAL: SFT epochs or GRPO steps) on the terminal; time it
step() {
  local name="$1" total="$2" t=$SECONDS; shift 2
  echo "[quickstart] $name ... (everything it prints: $DIR/logs/$name.log)"
  setsid "$@" <&0 > "$DIR/logs/$name.log" 2>&1 &  # <&0: a heredoc reaches the command
  CHILD=$!
  "$PY" scripts/quickstart_progress.py "$name" "$DIR/logs/$name.log" --total "$total" --pid "$CHILD" \
    --eval-every "$EVAL_EVERY" </dev/null &
  WATCHER=$!
  if ! wait "$CHILD"; then
    CHILD=""
    stop_watcher
    echo "[quickstart] $name failed; the end of $DIR/logs/$name.log:" >&2
    tail -n 25 "$DIR/logs/$name.log" >&2
    exit 1
  fi
  CHILD=""
  wait "$WATCHER" || true  # it prints what is left of the log, then ends: the stage's process is gone
  WATCHER=""
  echo "[quickstart] $name: done in $((SECONDS - t)) s"
}

if [[ "${QUICKSTART_SKIP_SETUP:-0}" != 1 ]]; then
  COPE_ENV_SERVERS="${COPE_ENV_SERVERS:-babyai}" bash scripts/setup.sh
fi
[[ -x "$PY" ]] || { echo "[quickstart] no $PY: run bash scripts/setup.sh" >&2; exit 1; }
[[ -x .venvs/babyai/bin/python ]] || { echo "[quickstart] no BabyAI server venv: run bash scripts/setup_env.sh babyai" >&2; exit 1; }
mkdir -p "$DIR/logs"

step warmstart "$EPOCHS" "$PY" scripts/prepare_warm_start.py --env babyai --levels 1 --heldout "$HELDOUT" \
  --demos "$DEMOS" --demo-policy view-hesitant --epochs "$EPOCHS" --sft-schedule cosine --out "$DIR"
rm -rf "$DIR/ckpt" "$DIR/tensorboard"
step train "$STEPS" "$PY" -m cope_rlhf.local train --env babyai \
  --actor.model_name_or_path "$DIR/model-sft" \
  --data.prompt_dataset "$DIR/data/train.jsonl" --eval.dataset "$DIR/data/heldout.jsonl" \
  --local.steps "$STEPS" --local.max_turns 3 --eval.steps "$EVAL_EVERY" --ckpt.save_steps "$EVAL_EVERY" \
  --eval.temperature 1.0 --eval.n_samples_per_prompt 2 \
  --rollout.batch_size 8 --rollout.n_samples_per_prompt 8 --train.batch_size 32 \
  --train.micro_batch_size 8 --rollout.micro_batch_size 8 \
  --algo.advantage.estimator group_norm --actor.loss_agg_mode seq-mean-token-mean \
  --cope.grpo_filter_degenerate true \
  --actor.adam.lr 1e-4 --actor.lr_warmup_ratio 0.1 --actor.lr_scheduler constant_with_warmup \
  --algo.kl.init_coef 0.01 --algo.kl.use_loss --algo.kl.estimator k3 --vllm.enable_prefix_caching \
  --ckpt.path "$DIR/ckpt" --ckpt.output_dir "$DIR/model-rl" --logger.tensorboard_dir "$DIR/tensorboard" \
  "${COPE_FLAGS[@]}"

"$PY" scripts/run_report.py --ckpt "$DIR/ckpt" --png "$DIR/learning_curve.png" --json "$DIR/report.json" \
  > "$DIR/logs/report.log"
"$PY" - "$DIR" $((SECONDS - T0)) <<'EOF'
import json, sys
d, seconds = sys.argv[1], int(sys.argv[2])
s, r = json.load(open(f"{d}/ckpt/summary.json")), json.load(open(f"{d}/report.json"))
first, last, g = r["evals"][0], r["evals"][-1], r["gain"]
print(f"""
[quickstart] done in {seconds // 60} min {seconds % 60} s
  held-out success (BabyAI level 1, {first['items']} items never trained on, {first['episodes'] // first['items']} episodes each at temperature 1), 95% intervals:
    before RL           {first['success']:.3f}  [{first['low']:.3f}, {first['high']:.3f}]
    after {last['step']:>3} steps     {last['success']:.3f}  [{last['low']:.3f}, {last['high']:.3f}]
    gain                {g['gain']:+.3f}  [{g['low']:+.3f}, {g['high']:+.3f}]  (paired by item)
  learning curve:    {d}/learning_curve.png
  TensorBoard logs:  {s['tensorboard_dir']}   (.venv/bin/tensorboard --logdir {s['tensorboard_dir']})
  trained model:     {s['model']}
  train log:         {d}/logs/train.log""")
EOF
