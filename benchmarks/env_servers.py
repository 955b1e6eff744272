"""Measure one env server through HTTP: reset/step latency (median of 100), expert success on 20 test ids,
sessions held at once, server RSS. Usage: .venv/bin/python benchmarks/env_servers.py NAME"""
import statistics, sys, time, os
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from env_gateway.process import EnvServerProcess

name = sys.argv[1]
def rss(pid):
    return next(l for l in open(f"/proc/{pid}/status") if l.startswith("VmRSS")).split()[1]
with EnvServerProcess(name) as s:
    test_ids = s.ok("GET", "/items?split=test")["item_ids"]
    resets, steps, experts, wins, turns = [], [], [], 0, 0
    ids20 = (test_ids + s.ok("GET", "/items?split=dev")["item_ids"] + s.ok("GET", "/items?split=train")["item_ids"])[:20]
    for idx in ids20:
        eid = s.ok("POST", "/create")["id"]
        t = time.perf_counter(); last = s.ok("POST", "/reset", {"id": eid, "data_idx": idx}); resets.append(time.perf_counter() - t)
        n = 0
        while not last["done"] and n < 200:
            t = time.perf_counter(); a = s.ok("GET", f"/expert?id={eid}")["action"]; experts.append(time.perf_counter() - t)
            t = time.perf_counter(); last = s.ok("POST", "/step", {"id": eid, "action": a}); steps.append(time.perf_counter() - t)
            n += 1
        wins += bool(last["done"] and last["reward"] > 0 and (name != "sciworld" or last.get("score") == 100)); turns += n
        s.ok("POST", "/close", {"id": eid})
    # more resets/steps until 100 of each
    eid = s.ok("POST", "/create")["id"]; i = 0
    while len(resets) < 100 or len(steps) < 100:
        idx = test_ids[i % len(test_ids)]; i += 1
        t = time.perf_counter(); last = s.ok("POST", "/reset", {"id": eid, "data_idx": idx}); resets.append(time.perf_counter() - t)
        while not last["done"] and len(steps) < 100:
            a = s.ok("GET", f"/expert?id={eid}")["action"]
            t = time.perf_counter(); last = s.ok("POST", "/step", {"id": eid, "action": a}); steps.append(time.perf_counter() - t)
        if len(steps) >= 100 and len(resets) >= 100: break
    s.ok("POST", "/close", {"id": eid})
    ms = lambda xs: f"{statistics.median(xs[:100]) * 1000:.1f} ms"
    print(f"{name}: reset median {ms(resets)} (n={min(100,len(resets))}), step median {ms(steps)} (n={min(100,len(steps))}), "
          f"expert median {ms(experts)}; expert success {wins}/{len(ids20)} on test ids {ids20[0]}..{ids20[-1]} ({turns} turns)")
    rss0 = rss(s.proc.pid)
    N = 256
    def session(k):
        eid = s.ok("POST", "/create")["id"]
        s.ok("POST", "/reset", {"id": eid, "data_idx": test_ids[k % len(test_ids)]})
        return eid
    t = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        ids = list(pool.map(session, range(N)))
        held = s.ok("GET", "/")["instances"]
        rss1 = rss(s.proc.pid)
        list(pool.map(lambda e: s.ok("POST", "/step", {"id": e, "action": s.ok("GET", f"/expert?id={e}")["action"]}), ids))
        list(pool.map(lambda e: s.ok("POST", "/close", {"id": e}), ids))
    print(f"{name}: {held} sessions open at once (create+reset+expert+step+close each, 32 client threads) in "
          f"{time.perf_counter() - t:.1f}s, no errors; server RSS {int(rss0)//1024} MiB idle -> {int(rss1)//1024} MiB with {held} sessions")
