"""Package ScienceWorldEnv.step vs the server's fast_step, same JVM, same gold paths: per-step time and ratio.

    .venvs/sciworld/bin/python benchmarks/sciworld_step_bench.py
"""
import os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scienceworld import ScienceWorldEnv
from env_gateway.servers.sciworld import fast_step
env = ScienceWorldEnv("", envStepLimit=100)
package, fast, same = [], [], True
for task, var in [("boil", 0), ("use-thermometer", 3), ("find-living-thing", 1), ("chemistry-mix", 2), ("test-conductivity", 5), ("identify-life-stages-1", 0)]:
    env.load(task, var, "", generateGoldPath=True); gold = env.get_gold_action_sequence()
    env.load(task, var, ""); env.server.step("look around"); env.lastStepScore = 0
    a_out = []
    for a in gold:
        t = time.perf_counter(); o, r, d, info = env.step(a); package.append(time.perf_counter() - t); a_out.append((info["score"], d))
    env.load(task, var, ""); env.server.step("look around")
    b_out = []
    for a in gold:
        t = time.perf_counter(); o, sc, comp, moves = fast_step(env, a); fast.append(time.perf_counter() - t)
        b_out.append((sc, bool(comp) or sc < 0 or moves > 100))
    same &= a_out == b_out
print(f"package step median {1000 * statistics.median(package):.1f} ms, fast step median {1000 * statistics.median(fast):.1f} ms, "
      f"ratio {statistics.median(package) / statistics.median(fast):.1f}x over {len(fast)} steps; same score/done: {same}")
env.close()
