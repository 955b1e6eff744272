"""Information gain's term on a policy rank (``InfoGainBonus``, mixed into ``CoPEActorPPOTrainer``): the bonus of
``advantage.add_info_bonus`` added to the advantages at the start of ``ppo_train``, once every experience of the batch
is appended (their intrinsic rewards computed under the pre-update weights, ``attach_frozen_signals``), with the gate
beta_g from the experience maker (``info[INFO_BETA_KEY]``) and the z-score over every action token of the batch on all
ranks. The intrinsic reward itself: ``cope_rlhf.info_gain``.
"""

from __future__ import annotations

import torch

from cope_rlhf.advantage import add_info_bonus
from cope_rlhf.batch_keys import SIGNALS_KEY


class InfoGainBonus:
    """Needs ``self.replay_buffer``, ``self.cope_signals`` and ``CoPEActorMethods._all_reduce``."""

    def _add_info_bonus(self) -> float:
        """A += beta_g * Â_intr on the action tokens of every replay-buffer item (``advantage.add_info_bonus``),
        Â_intr z-scored over the action tokens of the whole batch, all ranks; returns their mean intrinsic reward.
        The buffer's items are right-trimmed, so each one's intrinsic row is cut to its length."""
        items = self.replay_buffer.items
        signals = [self.cope_signals[int(item.info[SIGNALS_KEY])] for item in items]
        rows = [s.pop("intrinsic")[: len(item.action_mask)] for s, item in zip(signals, items)]
        values = torch.cat([x.double()[item.action_mask.bool()] for x, item in zip(rows, items)] +
                           [torch.zeros(0, dtype=torch.float64)])
        total, squares, count = self._all_reduce(
            torch.tensor([values.sum(), values.pow(2).sum(), values.numel()], dtype=torch.float64), "sum").tolist()
        mean = total / count if count else 0.0
        std = max(squares / count - mean * mean, 0.0) ** 0.5 if count else 0.0
        for x, s, item in zip(rows, signals, items):
            item.advantages = add_info_bonus(item.advantages, x, item.action_mask, s.pop("beta"), mean, std)
        return mean
