"""τ²-bench conversations of several tagged runs side by side, as one self-contained HTML page.

    python scripts/tau2_viz_trajectories.py "base=<tag>" "trained=<tag>" --out traj.html [--results-dir runs/tau2]

A run is ``NAME=SPEC`` (or just SPEC, named after it). SPEC is a tag of scripts/tau2_align_eval.sh (every
``<results-dir>/<tag>_<domain>.json`` it wrote), a τ² Results file (what ``tau2 run`` saves: ``info``, ``tasks``,
``simulations``), or a folder of such files. Only τ²'s own output is read: per simulation ``task_id``, ``trial``,
``messages`` (role, content, ``tool_calls`` with name and arguments; tool results with ``error``),
``reward_info.reward`` and ``termination_reason``; the domain comes from ``info.environment_info.domain_name``.

The page has one row per task (``<domain>/<task_id>``) and one column per run; each column holds that run's trials
of the task, every message in order: the agent's messages and tool calls, tool results (failed ones marked), the
user's messages, then the reward (success: |reward − 1| ≤ 1e-6) and why the conversation ended. Filters: domain,
task id, and outcome (``all``, ``differ``: tasks whose success rate differs between runs, ``fail-all``), also as
``#domain=retail&outcome=differ`` in the URL. The data is embedded as JSON and drawn by the page's own script;
nothing is loaded from elsewhere. Exit 2 with the reason when a SPEC matches no Results file.
"""

from __future__ import annotations

import argparse
import glob
import html
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOMAINS = ("airline", "retail", "telecom", "mock")


class NoResults(ValueError):
    pass


def results_files(spec: str, results_dir: str) -> list[str]:
    """The τ² Results files a SPEC names: a file, a folder's ``*.json``, or a tag's ``<tag>_<domain>.json``."""
    if os.path.isfile(spec):
        return [spec]
    if os.path.isdir(spec):
        found = sorted(glob.glob(os.path.join(glob.escape(spec), "*.json")))
    else:
        found = [os.path.join(results_dir, f"{spec}_{d}.json") for d in DOMAINS]
        found = [p for p in found if os.path.isfile(p)]
    if not found:
        raise NoResults(f"{spec}: neither a Results file, a folder of them, nor a tag with "
                        f"{os.path.join(results_dir, spec + '_<domain>.json')} (tau2_align_eval.sh TAG=...)")
    return found


def load_run(spec: str, results_dir: str) -> dict[str, list[dict]]:
    """``{"<domain>/<task_id>": [simulation, ...]}`` of one run, each simulation reduced to what the page shows."""
    tasks: dict[str, list[dict]] = {}
    for path in results_files(spec, results_dir):
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
        if not isinstance(results, dict) or "simulations" not in results:
            continue  # not a Results file (e.g. the eval config beside them)
        domain = ((results.get("info") or {}).get("environment_info") or {}).get("domain_name") or "?"
        for sim in results["simulations"]:
            reward = (sim.get("reward_info") or {}).get("reward")
            tasks.setdefault(f"{domain}/{sim['task_id']}", []).append({
                "trial": sim.get("trial"), "reward": reward,
                "success": reward is not None and abs(float(reward) - 1.0) <= 1e-6,
                "ended": sim.get("termination_reason"), "messages": [message(m) for m in sim.get("messages") or []]})
    if not tasks:
        raise NoResults(f"{spec}: its files hold no simulations")
    for sims in tasks.values():
        sims.sort(key=lambda s: (s["trial"] is None, s["trial"]))
    return tasks


def message(m: dict) -> dict:
    calls = [{"name": c.get("name"), "arguments": c.get("arguments")} for c in m.get("tool_calls") or []]
    return {"role": m.get("role"), "content": m.get("content") or "", "calls": calls, "error": bool(m.get("error"))}


PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>%(title)s</title>
<style>
body{font:13px/1.4 system-ui,sans-serif;margin:12px} table{border-collapse:collapse;width:100%%}
td,th{border:1px solid #ccc;vertical-align:top;padding:4px} th{background:#f3f3f3;position:sticky;top:0}
.m{margin:2px 0;padding:3px 5px;border-radius:4px;white-space:pre-wrap;word-break:break-word}
.assistant{background:#e8f0fe}.user{background:#f1f8e9}.tool{background:#fff8e1;font-family:monospace}
.error{background:#fdecea}.call{font-family:monospace;color:#1a237e}.ok{color:#1b5e20;font-weight:bold}
.bad{color:#b71c1c;font-weight:bold}.sim{border-top:2px solid #999;margin-top:6px;padding-top:3px}
</style></head><body>
<h3>%(title)s</h3>
<div>domain <select id="domain"><option value="">all</option></select>
task <input id="task" placeholder="task id contains">
outcome <select id="outcome"><option value="all">all</option><option value="differ">success differs</option>
<option value="fail-all">every run fails</option></select> <span id="count"></span></div>
<table><thead><tr><th>task</th></tr></thead><tbody></tbody></table>
<script id="data" type="application/json">%(data)s</script>
<script>
const D = JSON.parse(document.getElementById('data').textContent);
const head = document.querySelector('thead tr'), body = document.querySelector('tbody');
const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e; };
D.runs.forEach(r => head.appendChild(el('th', '', r)));
[...new Set(D.tasks.map(t => t.split('/')[0]))].forEach(d => {
  const o = el('option', '', d); o.value = d; document.getElementById('domain').appendChild(o); });
const rate = sims => sims && sims.length ? sims.filter(s => s.success).length / sims.length : null;
function draw() {
  const dom = document.getElementById('domain').value, task = document.getElementById('task').value,
        outcome = document.getElementById('outcome').value;
  location.hash = new URLSearchParams({domain: dom, task: task, outcome: outcome}).toString();
  body.innerHTML = ''; let shown = 0;
  for (const t of D.tasks) {
    if (dom && !t.startsWith(dom + '/')) continue;
    if (task && !t.includes(task)) continue;
    const rates = D.runs.map(r => rate(D.by_run[r][t]));
    if (outcome === 'differ' && new Set(rates.map(String)).size < 2) continue;
    if (outcome === 'fail-all' && rates.some(x => x)) continue;
    const tr = el('tr'); tr.appendChild(el('td', '', t)); shown++;
    for (const r of D.runs) {
      const td = el('td');
      for (const s of D.by_run[r][t] || []) {
        const box = el('div', 'sim');
        box.appendChild(el('span', s.success ? 'ok' : 'bad',
          `trial ${s.trial}: reward ${s.reward === null ? 'none' : s.reward} (${s.ended})`));
        for (const m of s.messages) {
          const div = el('div', 'm ' + m.role + (m.error ? ' error' : ''));
          div.appendChild(el('b', '', m.role + (m.error ? ' (error)' : '') + ': '));
          if (m.content) div.appendChild(document.createTextNode(m.content));
          for (const c of m.calls) div.appendChild(el('div', 'call', `${c.name}(${JSON.stringify(c.arguments)})`));
          box.appendChild(div);
        }
        td.appendChild(box);
      }
      if (!td.childNodes.length) td.textContent = '(not run)';
      tr.appendChild(td);
    }
    body.appendChild(tr);
  }
  document.getElementById('count').textContent = `${shown} of ${D.tasks.length} tasks`;
}
const h = new URLSearchParams(location.hash.slice(1));
for (const k of ['domain', 'task', 'outcome']) if (h.get(k)) document.getElementById(k).value = h.get(k);
for (const k of ['domain', 'task', 'outcome']) document.getElementById(k).addEventListener('input', draw);
draw();
</script></body></html>
"""


def render(runs: dict[str, dict[str, list[dict]]], title: str) -> str:
    tasks = sorted({t for run in runs.values() for t in run},
                   key=lambda t: (t.split("/")[0], int(t.split("/", 1)[1]) if t.split("/", 1)[1].isdigit() else 0,
                                  t))
    data = json.dumps({"runs": list(runs), "tasks": tasks, "by_run": runs}, ensure_ascii=False)
    data = data.replace("</", "<\\/")  # a message holding "</script>" cannot end the data block
    return PAGE % {"title": html.escape(title), "data": data}


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="NAME=SPEC or SPEC; SPEC: a tag, a Results file or a folder of them")
    p.add_argument("--out", required=True, help="the HTML file to write")
    p.add_argument("--results-dir", default=os.path.join(ROOT, "runs", "tau2"), help="where tags' results are")
    p.add_argument("--title", default="τ²-bench trajectories")
    args = p.parse_args(argv)
    runs: dict[str, dict[str, list[dict]]] = {}
    try:
        for item in args.runs:
            name, sep, spec = item.partition("=")
            if not sep:
                name, spec = os.path.basename(item.rstrip("/")) or item, item
            if name in runs:
                raise NoResults(f"two runs are named {name}: name them NAME=SPEC")
            runs[name] = load_run(spec, args.results_dir)
    except NoResults as e:
        print(f"tau2_viz_trajectories: {e}", file=sys.stderr)
        sys.exit(2)
    page = render(runs, args.title)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(page)
    n = sum(len(s) for run in runs.values() for s in run.values())
    print(f"tau2_viz_trajectories: {len(runs)} runs, {n} simulations -> {args.out}")
    return page


if __name__ == "__main__":
    main()
