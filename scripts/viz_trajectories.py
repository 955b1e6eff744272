"""Trajectories of several runs side by side, turn by turn, as one self-contained HTML page.

    python scripts/viz_trajectories.py "base=runs/eval/base.episodes.jsonl" "trained=runs/eval/" --out traj.html

A run is ``NAME=PATH`` (or just PATH, named after it): an episode JSONL file, or a directory whose ``*.jsonl`` files
(searched recursively) hold episodes. An episode is a JSON line with ``messages`` in the agent funcs' ReAct chat
format — instruction (user), acknowledgement (assistant), first observation (user), then per turn the reply
(assistant, ``Thought: … Action: …``) and the observation it got (user) — plus ``item_id``, ``reward``,
``success`` and optionally ``trial`` and ``turn_rewards`` (one per turn): what scripts/make_demos.py and
scripts/eval.py write. Lines without ``messages`` are skipped.

The page shows, per item, one column per run; in each, the run's episodes of that item, each turn as
observation → thought → action → reward. Filters: item and outcome (also as ``#item=<id>&outcome=success``
in the URL). Data is embedded as JSON and drawn by the page's own script; nothing is loaded from elsewhere.
"""

from __future__ import annotations

import argparse
import glob
import html
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from agent_funcs.instructions import ACKNOWLEDGEMENT  # noqa: E402


def split_reply(reply: str) -> tuple[str, str]:
    """(thought, action) of a ReAct reply; a reply without ``Action:`` is all action (e.g. a tool call)."""
    head, sep, tail = reply.rpartition("Action:")
    if not sep:
        return "", reply.strip()
    thought = head.strip()
    thought = thought[len("Thought:"):].strip() if thought.startswith("Thought:") else thought
    lines = [line.strip() for line in tail.splitlines() if line.strip()]
    return thought, lines[0] if lines else ""


def turns_of(messages: list[dict], turn_rewards: list | None) -> tuple[str, list[dict], str]:
    """(instruction, turns, final observation) of a chat: each turn is the observation the agent saw, its
    thought, its action and that turn's reward (None when the file has no per-turn rewards)."""
    start, instruction = 0, ""
    if len(messages) >= 3 and messages[1]["role"] == "assistant" and messages[1]["content"] == ACKNOWLEDGEMENT:
        start, instruction = 2, messages[0]["content"]
    elif messages and messages[0]["role"] == "system":
        start, instruction = 1, messages[0]["content"]
    seen, turns = [], []
    for message in messages[start:]:
        if message["role"] != "assistant":
            seen.append(str(message.get("content") or ""))
            continue
        thought, action = split_reply(str(message.get("content") or ""))
        reward = turn_rewards[len(turns)] if turn_rewards and len(turn_rewards) > len(turns) else None
        turns.append({"observation": "\n\n".join(seen), "thought": thought, "action": action, "reward": reward})
        seen = []
    return instruction, turns, "\n\n".join(seen)


def load_run(spec: str) -> tuple[str, list[dict]]:
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = os.path.basename(os.path.normpath(spec)), spec
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(glob.escape(path), "**", "*.jsonl"), recursive=True))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise SystemExit(f"viz_trajectories: run {name!r}: {path} is neither an episode JSONL file nor a directory")
    episodes, trials = [], {}
    for file in files:
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SystemExit(f"viz_trajectories: {file}:{number} is not JSON: {e}") from None
                if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
                    continue
                item = str(row.get("item_id", row.get("label", "?")))
                trial = row.get("trial", trials.get(item, 0))
                trials[item] = trial + 1
                instruction, turns, final = turns_of(row["messages"], row.get("turn_rewards"))
                episodes.append({"item_id": item, "trial": trial, "reward": float(row.get("reward", 0.0)),
                                 "success": bool(row.get("success", False)), "instruction": instruction,
                                 "turns": turns, "final_observation": final, "source": os.path.basename(file)})
    if not episodes:
        raise SystemExit(f"viz_trajectories: run {name!r}: no episodes (JSON lines with \"messages\") in {path}")
    return name, episodes


def item_order(item: str) -> tuple:
    return (0, int(item), "") if item.isdigit() else (1, 0, item)


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1em;color:#222}
h1{font-size:1.3em} h2{font-size:1.1em;margin:1.2em 0 .4em;border-bottom:1px solid #ccc}
.bar{position:sticky;top:0;background:#fff;padding:.5em 0;border-bottom:1px solid #ddd;z-index:1}
.grid{display:grid;gap:1em} .col h3{margin:.2em 0;font-size:1em}
.episode{border:1px solid #bbb;border-radius:4px;margin:.5em 0;padding:.4em}
.episode.success{border-left:6px solid #2a2} .episode.failure{border-left:6px solid #c33}
table{border-collapse:collapse;width:100%} td,th{border-top:1px solid #eee;padding:.2em .4em;vertical-align:top;text-align:left}
pre{white-space:pre-wrap;margin:0;max-height:14em;overflow:auto;font:12px/1.3 monospace}
.action{font-weight:bold;font-family:monospace} .none{color:#888} summary{cursor:pointer;color:#555}
</style></head><body>
<h1>__TITLE__</h1>
<table id="summary"></table>
<div class="bar">item <select id="item"></select> outcome <select id="outcome">
<option value="all">all</option><option value="success">success</option><option value="failure">failure</option>
</select> <span id="count"></span></div>
<main id="main"></main>
<script id="data" type="application/json">__DATA__</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const $ = (id) => document.getElementById(id);
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}
function fmt(x) { return x === null || x === undefined ? "–" : (Math.round(x * 1000) / 1000).toString(); }
function summary() {
  const t = $("summary");
  const head = el("tr");
  ["run", "episodes", "success rate", "mean reward"].forEach((h) => head.append(el("th", null, h)));
  t.append(head);
  for (const run of DATA.runs) {
    const eps = DATA.episodes[run], row = el("tr");
    const wins = eps.filter((e) => e.success).length, total = eps.reduce((s, e) => s + e.reward, 0);
    [run, eps.length, fmt(wins / eps.length), fmt(total / eps.length)].forEach((v) => row.append(el("td", null, String(v))));
    t.append(row);
  }
}
function card(e) {
  const box = el("div", "episode " + (e.success ? "success" : "failure"));
  box.append(el("div", null, `trial ${e.trial} · ${e.success ? "success" : "failure"} · reward ${fmt(e.reward)} · ${e.turns.length} turns`));
  if (e.instruction) {
    const d = el("details"); d.append(el("summary", null, "instruction")); d.append(el("pre", null, e.instruction)); box.append(d);
  }
  const t = el("table"), head = el("tr");
  ["#", "observation", "thought", "action", "reward"].forEach((h) => head.append(el("th", null, h)));
  t.append(head);
  e.turns.forEach((turn, i) => {
    const row = el("tr");
    row.append(el("td", null, String(i + 1)));
    const obs = el("td"); obs.append(el("pre", null, turn.observation)); row.append(obs);
    row.append(el("td", null, turn.thought));
    row.append(el("td", "action", turn.action));
    row.append(el("td", null, fmt(turn.reward)));
    t.append(row);
  });
  if (e.final_observation) {
    const row = el("tr"); row.append(el("td", null, "end"));
    const obs = el("td"); obs.colSpan = 4; obs.append(el("pre", null, e.final_observation)); row.append(obs); t.append(row);
  }
  box.append(t);
  return box;
}
function render() {
  const item = $("item").value, outcome = $("outcome").value, main = $("main");
  main.replaceChildren();
  let shown = 0;
  for (const id of DATA.items) {
    if (item !== "all" && id !== item) continue;
    const cols = DATA.runs.map((run) => DATA.episodes[run].filter((e) => e.item_id === id &&
      (outcome === "all" || (outcome === "success") === e.success)));
    if (cols.every((c) => c.length === 0)) continue;
    const section = el("section", "item"), grid = el("div", "grid");
    section.dataset.item = id;
    section.append(el("h2", null, "item " + id));
    grid.style.gridTemplateColumns = `repeat(${DATA.runs.length}, minmax(0, 1fr))`;
    cols.forEach((eps, i) => {
      const col = el("div", "col");
      col.append(el("h3", null, DATA.runs[i]));
      if (!eps.length) col.append(el("p", "none", "no matching episode"));
      eps.forEach((e) => col.append(card(e)));
      shown += eps.length;
      grid.append(col);
    });
    section.append(grid);
    main.append(section);
  }
  $("count").textContent = `${shown} episodes shown`;
  history.replaceState(null, "", `#item=${encodeURIComponent(item)}&outcome=${outcome}`);
}
const itemSelect = $("item");
["all", ...DATA.items].forEach((id) => { const o = el("option", null, id === "all" ? "all" : id); o.value = id; itemSelect.append(o); });
const params = new URLSearchParams(location.hash.slice(1));
if (DATA.items.includes(params.get("item"))) itemSelect.value = params.get("item");
if (["all", "success", "failure"].includes(params.get("outcome"))) $("outcome").value = params.get("outcome");
itemSelect.addEventListener("change", render);
$("outcome").addEventListener("change", render);
summary();
render();
</script></body></html>
"""


def build_page(runs: list[tuple[str, list[dict]]], title: str) -> str:
    names = [name for name, _ in runs]
    if len(set(names)) != len(names):
        raise SystemExit(f"viz_trajectories: run names must differ, got {names}")
    items = sorted({e["item_id"] for _, eps in runs for e in eps}, key=item_order)
    data = {"runs": names, "items": items, "episodes": {name: eps for name, eps in runs}}
    # Every "<" as \u003c: inside a <script> element the HTML parser reads "</script" as its end and "<!--" followed
    # by "<script" as the start of an escape that swallows the real end tag (the whole page blank), so no "<" may
    # appear in the data block at all; JSON.parse turns \u003c back into "<".
    blob = json.dumps(data).replace("<", "\\u003c")
    return PAGE.replace("__TITLE__", html.escape(title)).replace("__DATA__", blob)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="NAME=PATH", help="episode JSONL file or directory of them")
    p.add_argument("--out", default="traj.html")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    runs = [load_run(spec) for spec in args.runs]
    page = build_page(runs, args.title or "Trajectories: " + " vs ".join(name for name, _ in runs))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(page)
    print(f"viz_trajectories: {sum(len(e) for _, e in runs)} episodes of {len(runs)} runs -> {args.out}")
    return args.out


if __name__ == "__main__":
    main()
