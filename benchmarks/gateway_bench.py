"""Gateway throughput and latency against the alternatives, in one run (run by hand; not a test).

For a null backend (instant answers) and a backend with D ms of simulated work per reset/step (the fake
AgentGym server of env_gateway/fake_backend.py, one process), at 1, 64, 256 and 1024 concurrent
episodes (create, reset, S steps, close), it measures episodes/s and p50/p99 step latency of:

  (a) gateway   our GatewayClient through the gateway (python -m env_gateway, its own process)
  (b) direct    our client's transport (one keep-alive aiohttp session per loop) straight to the backend
  (c) requests  a thread pool of blocking `requests.post` calls, a new connection each (AgentGym-RL's rollout)
  (d) fresh     a fresh aiohttp.ClientSession per request (OpenRLHF's reward-function example)
  (e) bare      our GatewayClient through benchmarks/bare_proxy.py: the gateway's request path without any of its
                guarantees (admission control, deadlines, failure handling, metrics), i.e. what those cost
  (f) aiohttp   our GatewayClient through the gateway with aiohttp's ClientSession as its backend transport instead of
                env_gateway/http1.py (its own asyncio protocol, parsing with llhttp through httptools;
                benchmarks/aiohttp_gateway.py): the transport decision

Every cell first runs one untimed episode per concurrent worker (each method opens its connections and warms its
code paths), then times max(waves x concurrency, min-episodes) episodes. Every observation is checked against the
episode's item (no cross-talk), and the backend's own counts of
create/reset/step/close calls must equal what the clients sent (no request lost or duplicated). Prints the
table (with the CPU time each process spent per request, which other load on the machine does not skew),
the ratios a/c, a/b, a/d, a/e and a/f, and the gateway-added latency: the gateway's own p50 (its
cope_gateway_overhead_seconds histogram) and the client-seen difference p50(a) - p50(b). With (f) in the run it ends
on the transport decision: episodes/s a/f and the gateway process's CPU per backend request f/a, per cell.

With ``--repeats R`` every cell runs R times, the methods interleaved (a b c d e f, a b c d e f, ...), so slow spells of
the machine hit every method alike; the ratios are then the median over the R paired runs, with their range.

    .venv/bin/python benchmarks/gateway_bench.py [--waves 2] [--concurrency 1 64 256 1024] [--delays 0 0.005]
                                                 [--repeats 1]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import aiohttp
import requests
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from env_gateway.client import GatewayClient  # noqa: E402
from env_gateway.process import wait_listening  # noqa: E402
from env_gateway.fake_backend import FakeBackendProcess, expected_action, observation_text  # noqa: E402

TIMEOUT = 120.0
METHODS = ("gateway", "direct", "requests", "fresh", "bare", "aiohttp")
PROXIES = ("gateway", "bare", "aiohttp")  # the methods with a process between client and backend


def expected_obs(item: int, t: int, steps: int) -> str:
    return f"episode over: {steps}/{steps} right" if t + 1 >= steps else observation_text(item, t + 1)


class Episodes:
    """Hands out the cell's episodes (item ids) and collects step latencies."""

    def __init__(self, total: int) -> None:
        self.items = itertools.count()
        self.left = total
        self.lat: list[float] = []
        self.done = 0
        self.lock = threading.Lock()

    def take(self) -> bool:
        with self.lock:
            self.left -= 1
            return self.left >= 0

    def next_item(self) -> int:
        with self.lock:
            return next(self.items) % 10_000


def check(item: int, t: int, steps: int, obs: str, reward: float, done: bool) -> None:
    want = expected_obs(item, t, steps)
    if obs != want or done != (t + 1 >= steps) or (done and reward != 1.0):
        raise AssertionError(f"item {item} step {t}: got {obs!r} done={done} reward={reward}, want {want!r}")


# ---- the four ways to run an episode ---------------------------------------------------------------------
async def episode_gateway(client: GatewayClient, ep: Episodes, steps: int) -> None:
    item = ep.next_item()
    async with client.session("bench", item) as s:
        for t in range(steps):
            t0 = time.perf_counter()
            r = await s.step(expected_action(item, t))
            ep.lat.append(time.perf_counter() - t0)
            check(item, t, steps, r.observation, r.reward, r.done)


async def _post(http: aiohttp.ClientSession, url: str, body: dict) -> object:
    async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as resp:
        resp.raise_for_status()
        return await resp.json()


async def episode_direct(http: aiohttp.ClientSession, backend: str, ep: Episodes, steps: int) -> None:
    item = ep.next_item()
    n = (await _post(http, backend + "/create", {}))["id"]
    try:
        await _post(http, backend + "/reset", {"id": n, "data_idx": item})
        for t in range(steps):
            t0 = time.perf_counter()
            r = await _post(http, backend + "/step", {"id": n, "action": expected_action(item, t)})
            ep.lat.append(time.perf_counter() - t0)
            check(item, t, steps, r["observation"], r["reward"], r["done"])
    finally:
        await _post(http, backend + "/close", {"id": n})


async def _post_fresh(url: str, body: dict) -> object:
    async with aiohttp.ClientSession() as http:
        return await _post(http, url, body)


async def episode_fresh(backend: str, ep: Episodes, steps: int) -> None:
    item = ep.next_item()
    n = (await _post_fresh(backend + "/create", {}))["id"]
    try:
        await _post_fresh(backend + "/reset", {"id": n, "data_idx": item})
        for t in range(steps):
            t0 = time.perf_counter()
            r = await _post_fresh(backend + "/step", {"id": n, "action": expected_action(item, t)})
            ep.lat.append(time.perf_counter() - t0)
            check(item, t, steps, r["observation"], r["reward"], r["done"])
    finally:
        await _post_fresh(backend + "/close", {"id": n})


def _post_requests(url: str, body: dict) -> dict:
    resp = requests.post(url, json=body, timeout=TIMEOUT)
    resp.raise_for_status()
    return resp.json()


def episode_requests(backend: str, ep: Episodes, steps: int) -> None:
    item = ep.next_item()
    n = _post_requests(backend + "/create", {})["id"]
    try:
        _post_requests(backend + "/reset", {"id": n, "data_idx": item})
        for t in range(steps):
            t0 = time.perf_counter()
            r = _post_requests(backend + "/step", {"id": n, "action": expected_action(item, t)})
            with ep.lock:
                ep.lat.append(time.perf_counter() - t0)
            check(item, t, steps, r["observation"], r["reward"], r["done"])
    finally:
        _post_requests(backend + "/close", {"id": n})


# ---- running a cell --------------------------------------------------------------------------------------
async def run_async(method: str, conc: int, episodes: int, steps: int, backend: str, gateway: str,
                    start: Callable[[], None]) -> Episodes:
    client = GatewayClient(gateway, timeout=TIMEOUT, limit=max(conc, 100))
    direct = GatewayClient(backend, timeout=TIMEOUT, limit=max(conc, 100))  # only its transport is used

    async def worker(ep: Episodes) -> None:
        while ep.take():
            if method in PROXIES:
                await episode_gateway(client, ep, steps)
            elif method == "direct":
                await episode_direct(direct.http(), backend, ep, steps)
            else:
                await episode_fresh(backend, ep, steps)
            ep.done += 1

    try:
        await asyncio.gather(*(worker(Episodes(1)) for _ in range(conc)))  # warm-up: every connection opened
        start()
        ep = Episodes(episodes)
        await asyncio.gather(*(worker(ep) for _ in range(conc)))
    finally:
        await client.aclose()
        await direct.aclose()
    return ep


def run_threads(conc: int, episodes: int, steps: int, backend: str, start: Callable[[], None]) -> Episodes:
    def worker(ep: Episodes) -> None:
        while ep.take():
            episode_requests(backend, ep, steps)
            with ep.lock:
                ep.done += 1

    with ThreadPoolExecutor(max_workers=conc) as pool:
        for f in [pool.submit(worker, Episodes(1)) for _ in range(conc)]:
            f.result()
        start()
        ep = Episodes(episodes)
        for f in [pool.submit(worker, ep) for _ in range(conc)]:
            f.result()
    return ep


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def paired_median(by: dict, repeats: int, delay_ms: float, conc: int, other: str,
                  value: Callable[[dict, dict], float]) -> str:
    """Median [min-max] over the paired runs of ``value(gateway's row, other's row)``; a run whose ratio has a zero
    denominator (a tiny cell's CPU time can stay under the clock's 10 ms tick) is left out, and says so."""
    vals, undefined = [], 0
    for rep in range(repeats):
        if (delay_ms, conc, rep, other) in by:
            try:
                vals.append(value(by[delay_ms, conc, rep, "gateway"], by[delay_ms, conc, rep, other]))
            except ZeroDivisionError:
                undefined += 1
    vals.sort()
    note = f" ({undefined} run{'s' if undefined > 1 else ''} with a zero denominator left out)" if undefined else ""
    if not vals:
        return "n/a" + note if undefined else ""
    return f"{statistics.median(vals):.2f}" + (f" [{vals[0]:.2f}-{vals[-1]:.2f}]" if len(vals) > 1 else "") + note


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU time of a process (this one when pid is None): independent of other load."""
    if pid is None:
        return time.process_time()
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


def overhead_buckets(gateway: str) -> dict[float, float]:
    """Cumulative bucket counts of the gateway's step overhead histogram."""
    out = {}
    for fam in text_string_to_metric_families(fetch(gateway + "/metrics")):
        if fam.name == "cope_gateway_overhead_seconds":
            for s in fam.samples:
                if s.name.endswith("_bucket") and s.labels.get("endpoint") == "step":
                    out[float(s.labels["le"])] = s.value
    return out


def histogram_p50(before: dict[float, float], after: dict[float, float]) -> float:
    diff = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = diff[-1][1] if diff else 0
    prev_le, prev_c = 0.0, 0.0
    for le, c in diff:
        if c >= total / 2 and total:
            return prev_le + (le - prev_le) * ((total / 2 - prev_c) / max(c - prev_c, 1e-12))
        prev_le, prev_c = le, c
    return float("nan")


class GatewayProc:
    """The process between client and backend of a ``PROXIES`` method: the gateway (python -m env_gateway), the
    reference proxy (``bare``) or the gateway on aiohttp's client (``aiohttp``), on the port it bound (``--port 0``;
    its log names it)."""

    LISTENING = re.compile(rb"listening on http://127\.0\.0\.1:(\d+)")

    def __init__(self, backend: str, method: str = "gateway"):
        flags = ["--port", "0", "--env", f"bench:agentgym={backend}", "--max-concurrency", "100000",
                 "--max-sessions", "100000", "--max-queue", "100000",
                 "--log-level", "INFO"]  # INFO: the listening line; per-request logging is DEBUG
        bare = [os.path.join(ROOT, "benchmarks", "bare_proxy.py"), "--port", "0", "--backend", backend]
        argv = {"gateway": ["-m", "env_gateway", *flags],
                "aiohttp": [os.path.join(ROOT, "benchmarks", "aiohttp_gateway.py"), *flags], "bare": bare}[method]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = wait_listening(self.proc, self.log, self.LISTENING, lambda url: bool(fetch(url + "/v1/health")),
                                  f"the {method} proxy", timeout=60)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waves", type=float, default=2.0, help="episodes per cell = max(waves x concurrency, "
                   "--min-episodes)")
    p.add_argument("--min-episodes", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="steps per episode")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256, 1024])
    p.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.005], help="backend work per call (s)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--repeats", type=int, default=1, help="runs of every cell, the methods interleaved; ratios are "
                   "the median over the paired runs")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    rows = []
    cells = [(d, c, r, m) for d in args.delays for c in args.concurrency for r in range(args.repeats)
             for m in args.methods]
    bar = tqdm(total=len(cells), desc="cells")
    for delay in args.delays:
        with FakeBackendProcess("--delay", str(delay), "--episode-len", str(args.steps)) as backend:
            # the gateway always runs: its histogram gives the gateway-added latency
            procs = {m: GatewayProc(backend.url, m) for m in PROXIES if m == "gateway" or m in args.methods}
            gw = procs["gateway"]
            try:
                for conc, rep, method in itertools.product(args.concurrency, range(args.repeats), args.methods):
                    bar.set_postfix_str(f"delay={delay * 1000:g}ms conc={conc} run {rep + 1} {method}")
                    mark = {}
                    proxy = procs.get(method, gw)  # the "gateway" CPU column: the process in between

                    def start() -> None:  # after the warm-up: the timed part starts here
                        mark["before"] = backend.stats()
                        mark["hist0"] = overhead_buckets(gw.url) if method == "gateway" else None
                        mark["cpu0"] = [cpu_seconds(), cpu_seconds(proxy.proc.pid), cpu_seconds(backend.proc.pid)]
                        mark["t0"] = time.perf_counter()

                    n = max(int(args.waves * conc), args.min_episodes)
                    if method == "requests":
                        ep = run_threads(conc, n, args.steps, backend.url, start)
                    else:
                        ep = asyncio.run(run_async(method, conc, n, args.steps, backend.url, proxy.url, start))
                    elapsed = time.perf_counter() - mark["t0"]
                    cpu = [b - a for a, b in zip(mark["cpu0"], [cpu_seconds(), cpu_seconds(proxy.proc.pid),
                                                                cpu_seconds(backend.proc.pid)])]
                    before, hist0 = mark["before"], mark["hist0"]
                    after = backend.stats()
                    sent = {k: after[k] - before[k] for k in ("create", "reset", "step", "close")}
                    want = {"create": ep.done, "reset": ep.done, "step": ep.done * args.steps, "close": ep.done}
                    if sent != want or len(ep.lat) != ep.done * args.steps:
                        raise AssertionError(f"{method} conc={conc}: backend saw {sent}, clients sent {want}")
                    row = {"delay_ms": delay * 1000, "conc": conc, "rep": rep, "method": method, "episodes": ep.done,
                           "eps_per_s": ep.done / elapsed, "p50_ms": 1000 * percentile(ep.lat, 0.5),
                           "p99_ms": 1000 * percentile(ep.lat, 0.99), "lost_or_dup": 0,
                           # CPU per backend request (create, reset, steps, close), by process
                           "cpu_us": [1e6 * c / sum(sent.values()) for c in cpu]}
                    if hist0 is not None:
                        row["gw_overhead_p50_ms"] = 1000 * histogram_p50(hist0, overhead_buckets(gw.url))
                    rows.append(row)
                    bar.update()
            finally:
                for proc in procs.values():
                    proc.stop()
    bar.close()

    print(f"\n{args.steps}-step episodes; max({args.waves:g} x concurrency, {args.min_episodes}) episodes per cell; "
          f"{os.cpu_count()} CPUs; backend: one aiohttp process (fake AgentGym server); gateway: its own process\n")
    print("CPU us/request: CPU time of each process per backend request (load-independent; the bench process "
          "is the client, and (c)'s threads and (d)'s sessions are in it too)\n")
    print(f"{'backend':>8} {'conc':>5} {'run':>3} {'method':>9} {'episodes':>8} {'eps/s':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'CPU us/req: client':>18} {'gateway':>7} {'backend':>7} {'gw-added p50 ms':>15}")
    for r in rows:
        extra = f"{r['gw_overhead_p50_ms']:15.3f}" if "gw_overhead_p50_ms" in r else ""
        client, gw_cpu, backend_cpu = r["cpu_us"]
        print(f"{r['delay_ms']:>6g}ms {r['conc']:>5} {r['rep'] + 1:>3} {r['method']:>9} {r['episodes']:>8} "
              f"{r['eps_per_s']:>8.1f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} {client:>18.0f} {gw_cpu:>7.0f} "
              f"{backend_cpu:>7.0f} {extra}")
    runs = "" if args.repeats == 1 else f" (median over {args.repeats} paired runs [min-max])"
    print(f"\nratios of episodes/s (gateway vs the others) and client-seen gateway-added p50{runs}:")
    by = {(r["delay_ms"], r["conc"], r["rep"], r["method"]): r for r in rows}

    def paired(delay_ms: float, conc: int, other: str, value: Callable[[dict, dict], float]) -> str:
        return paired_median(by, args.repeats, delay_ms, conc, other, value)

    for delay in args.delays:
        for conc in args.concurrency:
            if (delay * 1000, conc, 0, "gateway") not in by:
                continue
            parts = [f"{delay * 1000:>4g}ms conc={conc:>4}:"]
            for m, label in (("requests", "a/c"), ("direct", "a/b"), ("fresh", "a/d"), ("bare", "a/e"),
                             ("aiohttp", "a/f")):
                ratio = paired(delay * 1000, conc, m, lambda a, o: a["eps_per_s"] / o["eps_per_s"])
                if ratio:
                    parts.append(f"{label} = {ratio}x")
            added = paired(delay * 1000, conc, "direct", lambda a, o: a["p50_ms"] - o["p50_ms"])
            if added:
                parts.append(f"p50(a)-p50(b) = {added} ms")
            print("  ".join(parts))
    if "aiohttp" in args.methods and "gateway" in args.methods:
        print(f"\nbackend transport: env_gateway/http1.py (llhttp via httptools) against aiohttp's client (f){runs}:")
        for delay in args.delays:
            for conc in args.concurrency:
                eps = paired(delay * 1000, conc, "aiohttp", lambda a, o: a["eps_per_s"] / o["eps_per_s"])
                cpu = paired(delay * 1000, conc, "aiohttp", lambda a, o: o["cpu_us"][1] / a["cpu_us"][1])
                if eps:
                    print(f"  {delay * 1000:>4g}ms conc={conc:>4}: episodes/s a/f = {eps}x  gateway CPU per backend "
                          f"request f/a = {cpu}x")
    print("\nno request lost or duplicated: backend call counts equal the clients' in every cell")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
