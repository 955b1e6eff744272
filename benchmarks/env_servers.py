"""One env server measured through its HTTP API, as the gateway uses it (by hand).

- latency: the median of ``--samples`` resets, steps and expert calls, each timed at the client (one session, the
  expert's actions on the test items);
- expert success: the bot expert played to the end on the first ``--episodes`` items (test, then dev, then train),
  at most 200 actions each; on ScienceWorld only a score of 100 counts;
- capacity: ``--sessions`` sessions created, reset, stepped once with the expert's action and closed from
  ``--threads`` client threads, the instances the server reports holding at once, and the server's resident memory
  idle and with them all open.

    .venv/bin/python benchmarks/env_servers.py babyai        # the server runs from .venvs/babyai
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from env_gateway.process import EnvServerProcess  # noqa: E402

SERVERS = ["babyai", "textcraft", "sciworld", "alfworld", "searchqa"]
MAX_ACTIONS = 200


def rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS")).split()[1]) // 1024


def timed(server: EnvServerProcess, method: str, path: str, body: dict | None, into: list[float]) -> dict:
    start = time.perf_counter()
    reply = server.ok(method, path, body)
    into.append(time.perf_counter() - start)
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=SERVERS, help="the env server (its venv: .venvs/<name>)")
    parser.add_argument("--episodes", type=int, default=20, help="expert episodes played to the end")
    parser.add_argument("--samples", type=int, default=100, help="resets, steps and expert calls timed")
    parser.add_argument("--sessions", type=int, default=256, help="sessions open at once in the capacity check")
    parser.add_argument("--threads", type=int, default=32, help="client threads in the capacity check")
    args = parser.parse_args()

    with EnvServerProcess(args.name) as server:
        test_ids = server.ok("GET", "/items?split=test")["item_ids"]
        items = (test_ids + server.ok("GET", "/items?split=dev")["item_ids"]
                 + server.ok("GET", "/items?split=train")["item_ids"])[:args.episodes]
        resets: list[float] = []
        steps: list[float] = []
        experts: list[float] = []
        wins = actions = 0
        for item in tqdm(items, desc="expert episodes", unit="episode"):
            env_id = server.ok("POST", "/create")["id"]
            last = timed(server, "POST", "/reset", {"id": env_id, "data_idx": item}, resets)
            for _ in range(MAX_ACTIONS):
                if last["done"]:
                    break
                action = timed(server, "GET", f"/expert?id={env_id}", None, experts)["action"]
                last = timed(server, "POST", "/step", {"id": env_id, "action": action}, steps)
                actions += 1
            wins += bool(last["done"] and last["reward"] > 0 and (args.name != "sciworld" or last["score"] == 100))
            server.ok("POST", "/close", {"id": env_id})

        env_id = server.ok("POST", "/create")["id"]  # more of each, on the test items, until --samples
        with tqdm(total=2 * args.samples, desc="latency samples") as bar:
            for item in itertools.cycle(test_ids):
                if len(resets) >= args.samples and len(steps) >= args.samples:
                    break
                last = timed(server, "POST", "/reset", {"id": env_id, "data_idx": item}, resets)
                while not last["done"] and len(steps) < args.samples:
                    action = timed(server, "GET", f"/expert?id={env_id}", None, experts)["action"]
                    last = timed(server, "POST", "/step", {"id": env_id, "action": action}, steps)
                bar.n = min(len(resets), args.samples) + min(len(steps), args.samples)
                bar.refresh()
        server.ok("POST", "/close", {"id": env_id})

        def ms(xs: list[float]) -> str:
            return f"{statistics.median(xs[:args.samples]) * 1000:.1f} ms (n={min(len(xs), args.samples)})"

        print(f"{args.name}: reset median {ms(resets)}, step median {ms(steps)}, expert median {ms(experts)}; "
              f"expert success {wins}/{len(items)} on items {items[0]}..{items[-1]} ({actions} actions)")

        def open_session(k: int) -> int:
            env_id = server.ok("POST", "/create")["id"]
            server.ok("POST", "/reset", {"id": env_id, "data_idx": test_ids[k % len(test_ids)]})
            return env_id

        def expert_step(env_id: int) -> None:
            action = server.ok("GET", f"/expert?id={env_id}")["action"]
            server.ok("POST", "/step", {"id": env_id, "action": action})

        idle = rss_mib(server.proc.pid)
        start = time.perf_counter()
        with ThreadPoolExecutor(args.threads) as pool:
            ids = list(tqdm(pool.map(open_session, range(args.sessions)), total=args.sessions, desc="sessions"))
            held, loaded = server.ok("GET", "/")["instances"], rss_mib(server.proc.pid)
            list(pool.map(expert_step, ids))
            list(pool.map(lambda env_id: server.ok("POST", "/close", {"id": env_id}), ids))
        print(f"{args.name}: {held} sessions open at once (create, reset, expert, step, close each; {args.threads} "
              f"client threads) in {time.perf_counter() - start:.1f} s, no errors; server RSS {idle} MiB idle -> "
              f"{loaded} MiB with {held} open")


if __name__ == "__main__":
    main()
