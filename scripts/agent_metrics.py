"""Episode metrics over items played several times (trials), as τ²-bench and AgentGym report them.

For item i with n_i trials, c_i successes and rewards r_i1 … r_in (m items):
    success_rate = Σ_i c_i / Σ_i n_i                 mean_reward = mean of every r_ij
    Avg@k        = (1/m) Σ_i (1/n_i) Σ_j r_ij        (mean reward over the item's k trials, then over items)
    pass^k       = (1/m) Σ_i C(c_i, k) / C(n_i, k)   (chance that k trials drawn without replacement all succeed)
pass^k needs n_i ≥ k for every item: a run with fewer trials cannot estimate it, so it raises.
"""

from __future__ import annotations

from math import comb
from typing import Sequence


def pass_hat_k(trials: Sequence[tuple[int, int]], k: int) -> float:
    """pass^k from (n_i, c_i) pairs."""
    if k < 1 or not trials:
        raise ValueError(f"pass^k needs k >= 1 and at least one item (k={k}, items={len(trials)})")
    short = [n for n, _ in trials if n < k]
    if short:
        raise ValueError(f"pass^{k} needs at least {k} trials per item; {len(short)} items have fewer")
    return sum(comb(c, k) / comb(n, k) for n, c in trials) / len(trials)


def avg_at_k(rewards_per_item: Sequence[Sequence[float]]) -> float:
    """Avg@k: the mean over items of each item's mean reward over its trials."""
    if not rewards_per_item or any(len(r) == 0 for r in rewards_per_item):
        raise ValueError("Avg@k needs at least one item and at least one trial per item")
    return sum(sum(r) / len(r) for r in rewards_per_item) / len(rewards_per_item)


def summarize(rewards_per_item: Sequence[Sequence[float]], successes_per_item: Sequence[Sequence[bool]],
              k: int) -> dict:
    """success_rate, mean_reward, Avg@k and pass^1 … pass^k of one run."""
    trials = [(len(s), sum(bool(x) for x in s)) for s in successes_per_item]
    episodes = sum(n for n, _ in trials)
    metrics = {"success_rate": sum(c for _, c in trials) / episodes,
               "mean_reward": sum(sum(r) for r in rewards_per_item) / episodes,
               f"avg@{k}": avg_at_k(rewards_per_item)}
    metrics.update({f"pass^{j}": pass_hat_k(trials, j) for j in range(1, k + 1)})
    return metrics
