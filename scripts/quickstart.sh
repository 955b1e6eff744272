#!/usr/bin/env bash
# The first command: watch a small agent learn BabyAI with GRPO + CoPE on one CPU machine (no GPU, no model hub).
#
#   bash scripts/quickstart.sh
#
# 1. set-up (scripts/setup.sh: the trainer venv and the BabyAI server's venv; a second run installs nothing)
# 2. BabyAI item ids; the quickstart uses level 1 (GoToRedBallGrey, item id = 0 mod 40): train split for training,
#    test + dev splits as the held-out evaluation set
# 3. expert demos of training items from the real server (scripts/make_demos.py's episode)
# 4. a small model built offline (scripts/make_tiny_model.py), warm-started on the demos (python -m cope_rlhf.local sft)
# 5. GRPO + every CoPE signal (python -m cope_rlhf.local train), evaluated on the held-out items before and after
# Then it prints where the TensorBoard logs are and the held-out success rate before and after RL.
#
# Environment: QUICKSTART_DIR (default runs/quickstart), QUICKSTART_STEPS (RL steps, default 24), QUICKSTART_DEMOS
# (default 300), QUICKSTART_SKIP_SETUP=1 (use the venvs as they are). Everything it starts is stopped on exit.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DIR="${QUICKSTART_DIR:-runs/quickstart}"
STEPS="${QUICKSTART_STEPS:-24}"
DEMOS="${QUICKSTART_DEMOS:-300}"
PY="$ROOT/.venv/bin/python"
T0=$SECONDS
CHILD=""

cleanup() {
  local code=$?
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

step() {  # step NAME command...: run it in its own process group (so cleanup can stop all of it), log, time it
  local name="$1" t=$SECONDS; shift
  echo "[quickstart] $name ..."
  setsid "$@" <&0 > "$DIR/logs/$name.log" 2>&1 &  # <&0: a heredoc reaches the command
  CHILD=$!
  if ! wait "$CHILD"; then
    CHILD=""
    echo "[quickstart] $name failed; the end of $DIR/logs/$name.log:" >&2
    tail -n 25 "$DIR/logs/$name.log" >&2
    exit 1
  fi
  CHILD=""
  echo "[quickstart] $name: done in $((SECONDS - t)) s"
}

if [[ "${QUICKSTART_SKIP_SETUP:-0}" != 1 ]]; then
  COPE_ENV_SERVERS="${COPE_ENV_SERVERS:-babyai}" bash scripts/setup.sh
fi
[[ -x "$PY" ]] || { echo "[quickstart] no $PY: run bash scripts/setup.sh" >&2; exit 1; }
[[ -x .venvs/babyai/bin/python ]] || { echo "[quickstart] no BabyAI server venv: run bash scripts/setup_env.sh babyai" >&2; exit 1; }
mkdir -p "$DIR/logs" "$DIR/data"

step itemids "$PY" scripts/make_itemids.py --env babyai --split train dev test --out "$DIR/data"
"$PY" - "$DIR/data" <<'EOF'
import json, sys
d = sys.argv[1]
def level1(splits, out):
    rows = [json.loads(line) for s in splits for line in open(f"{d}/babyai_{s}.jsonl")]
    rows = [r for r in rows if int(r["label"]) % 40 == 0]
    with open(f"{d}/{out}", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"[quickstart] {len(rows)} level-1 items -> {d}/{out}")
level1(["train"], "babyai_l1_train.jsonl")
level1(["test", "dev"], "babyai_l1_heldout.jsonl")
EOF

step demos "$PY" - "$DIR/data/babyai_l1_demos.jsonl" "$DEMOS" <<'EOF'
import importlib.util, json, sys
sys.path.insert(0, ".")
from tests.env_server_proc import EnvServerProcess
spec = importlib.util.spec_from_file_location("make_demos", "scripts/make_demos.py")
make_demos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_demos)
out, n = sys.argv[1], int(sys.argv[2])
ids = [json.loads(line)["label"] for line in open(out.replace("_demos.jsonl", "_train.jsonl"))][:n]
with EnvServerProcess("babyai") as server, open(out, "w") as f:
    demos = [make_demos.episode(server.url, "babyai", int(i), 30) for i in ids]
    f.writelines(json.dumps(d) + "\n" for d in demos)
print(f"{sum(d['success'] for d in demos)}/{len(demos)} successful demos -> {out}")
EOF

step model "$PY" scripts/make_tiny_model.py --out "$DIR/model" --corpus "$DIR/data/babyai_l1_demos.jsonl"
step sft "$PY" -m cope_rlhf.local sft --demos "$DIR/data/babyai_l1_demos.jsonl" --model "$DIR/model" \
  --out "$DIR/model-sft" --epochs 3
rm -rf "$DIR/ckpt" "$DIR/tensorboard"
step train "$PY" -m cope_rlhf.local train --env babyai \
  --actor.model_name_or_path "$DIR/model-sft" \
  --data.prompt_dataset "$DIR/data/babyai_l1_train.jsonl" --eval.dataset "$DIR/data/babyai_l1_heldout.jsonl" \
  --local.steps "$STEPS" --local.max_turns 6 --rollout.batch_size 4 --rollout.n_samples_per_prompt 4 \
  --actor.adam.lr 1e-4 --algo.kl.init_coef 0.001 --algo.kl.use_loss --algo.kl.estimator k3 \
  --eval.steps 12 --ckpt.save_steps 12 --ckpt.path "$DIR/ckpt" --ckpt.output_dir "$DIR/model-rl" \
  --logger.tensorboard_dir "$DIR/tensorboard" \
  --cope.action_forecast_enable --cope.te_enable --cope.te_lambda 0.1 --cope.te_warmup_steps 0 \
  --cope.info_intrinsic_weight 0.1 \
  --cope.grpo_filter_degenerate

"$PY" - "$DIR" $((SECONDS - T0)) <<'EOF'
import json, sys
d, seconds = sys.argv[1], int(sys.argv[2])
s = json.load(open(f"{d}/ckpt/summary.json"))
print(f"""
[quickstart] done in {seconds // 60} min {seconds % 60} s
  held-out success rate (BabyAI level 1, greedy): before RL {s['eval_before']:.2f} -> after {s['steps']} steps {s['eval_after']:.2f}
  TensorBoard logs:  {s['tensorboard_dir']}   (.venv/bin/tensorboard --logdir {s['tensorboard_dir']})
  trained model:     {s['model']}
  train log:         {d}/logs/train.log""")
EOF
