"""ScienceWorld's package step against the server's ``fast_step``, in one JVM, on the same gold paths (by hand).

``ScienceWorldEnv.step`` asks the simulator for the valid-action list and more after every action; the server's
``env_gateway.servers.sciworld.fast_step`` (what ``/step`` runs) makes four calls: step, score, completed, moves.
For each of ``TASKS`` (task, variation), in each of ``--repeats`` repeats, the gold path is played once through each
(package first, then fast, from a fresh load); a repeat's ratio is the median package step over the median fast
step across all its steps. Printed: the medians of both with the median of the per-repeat ratios [min-max], and
whether the two gave the same score and done after every action (the speed is worth nothing otherwise).

    .venvs/sciworld/bin/python benchmarks/sciworld_step_bench.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TASKS = [("boil", 0), ("use-thermometer", 3), ("find-living-thing", 1), ("chemistry-mix", 2),
         ("test-conductivity", 5), ("identify-life-stages-1", 0)]
STEP_LIMIT = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="times each task's gold path is played by each")
    args = parser.parse_args()

    from scienceworld import ScienceWorldEnv  # .venvs/sciworld's: --help answers without it

    from env_gateway.servers.sciworld import fast_step

    env = ScienceWorldEnv("", envStepLimit=STEP_LIMIT)
    gold = {}
    for task, variation in TASKS:
        env.load(task, variation, "", generateGoldPath=True)
        gold[task, variation] = env.get_gold_action_sequence()
    package_ms: list[float] = []
    fast_ms: list[float] = []
    ratios: list[float] = []
    same = True
    for repeat in range(args.repeats):
        package_times: list[float] = []
        fast_times: list[float] = []
        for (task, variation), actions in gold.items():
            env.load(task, variation, "")
            env.server.step("look around")  # as the server's reset does, before the first action
            env.lastStepScore = 0
            by_package = []
            for action in actions:
                start = time.perf_counter()
                _, _, done, info = env.step(action)
                package_times.append(time.perf_counter() - start)
                by_package.append((info["score"], done))
            env.load(task, variation, "")
            env.server.step("look around")
            by_fast = []
            for action in actions:
                start = time.perf_counter()
                _, score, completed, moves = fast_step(env, action)
                fast_times.append(time.perf_counter() - start)
                by_fast.append((score, bool(completed) or score < 0 or moves > STEP_LIMIT))
            same &= by_package == by_fast
        package_ms.append(1000 * statistics.median(package_times))
        fast_ms.append(1000 * statistics.median(fast_times))
        ratios.append(package_ms[-1] / fast_ms[-1])
        print(f"repeat {repeat + 1}/{args.repeats}: package {package_ms[-1]:.1f} ms, fast {fast_ms[-1]:.1f} ms, "
              f"{ratios[-1]:.2f}x", file=sys.stderr, flush=True)  # progress (.venvs/sciworld has no tqdm)
    env.close()
    steps = sum(len(actions) for actions in gold.values())
    print(f"package step {statistics.median(package_ms):.1f} ms, fast step {statistics.median(fast_ms):.1f} ms "
          f"(medians over {steps} steps per repeat); package / fast: {statistics.median(ratios):.2f}x "
          f"[{min(ratios):.2f}-{max(ratios):.2f}] over {args.repeats} repeats; same score and done: {same}")


if __name__ == "__main__":
    main()
