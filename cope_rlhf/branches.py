"""Branch packing: a trajectory once, then short branches off it, all in one sequence.

A branch is a run of tokens that continues a prefix of the trajectory (the *trunk*): it sits at given position
ids and sees the trunk tokens ``[0, trunk_end)`` and its own earlier tokens, nothing else. A packed row is

    trunk | branch 1 | branch 2 | ... | padding

    sees(q, k) = (k <= q and segment[k] == segment[q])      causal inside the trunk and inside each branch
              or k < trunk_end[q]                          a branch reads its prefix of the trunk

with ``segment`` 0 on the trunk, i on branch i, -1 on padding, and ``trunk_end`` 0 on trunk and padding.
A causal LM's output at a token depends only on the tokens it sees and their position ids, so branch token j
gets exactly the logits it would get in the unpacked sequence ``trunk[:trunk_end] + branch`` (same positions),
and trunk tokens get the trajectory's own logits: one forward of the row costs about the trunk plus the sum of
the branch lengths, instead of one forward of a whole prefix per branch.

The rule reaches the model as a 4D mask, built by ``dense_mask`` (boolean, ``(rows, 1, L, L)``, what HF's sdpa
attention takes), ``additive_mask`` (0 / dtype-min, for eager attention) or ``flex_mask`` (a flex-attention
``BlockMask``, block-sparse, for GPUs). ``block_attention(model)`` switches a HF model to an attention
implementation that takes such a mask for the duration of a call (flex attention on CUDA when PyTorch has it,
sdpa otherwise) and yields the matching mask builder; flash-attention kernels cannot take one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator, List, NamedTuple, Sequence, Tuple

import torch

PAD_SEGMENT = -1


class Branch(NamedTuple):
    tokens: Sequence[int]
    position: int  # position id of the first token; the others follow one by one
    trunk_end: int  # the branch sees trunk tokens [0, trunk_end)


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # (R, L)
    position_ids: torch.Tensor  # (R, L)
    segment: torch.Tensor  # (R, L): 0 trunk, i branch i (1-based), -1 padding
    trunk_end: torch.Tensor  # (R, L): trunk tokens [0, trunk_end) visible besides the own segment
    starts: List[List[int]]  # starts[r][i]: column of branch i's first token in row r (the trunk starts at 0)

    def column(self, row: int, branch: int, j: int) -> int:
        """Column of token j of branch ``branch`` of ``row``; ``branch=-1`` means the trunk."""
        return j if branch < 0 else self.starts[row][branch] + j


def pack_rows(
    trunks: Sequence[Sequence[int]], branches: Sequence[Sequence[Branch]], pad_token_id: int = 0
) -> PackedRows:
    """One right-padded row per trunk; the trunk sits at positions 0, 1, ..."""
    if len(trunks) != len(branches):
        raise ValueError(f"{len(trunks)} trunks but {len(branches)} branch lists: give one list per trunk")
    lengths = [len(t) + sum(len(b.tokens) for b in bs) for t, bs in zip(trunks, branches)]
    width = max(lengths, default=0)
    shape = (len(trunks), width)
    input_ids = torch.full(shape, pad_token_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    segment = torch.full(shape, PAD_SEGMENT, dtype=torch.long)
    trunk_end = torch.zeros(shape, dtype=torch.long)
    starts = []
    for r, (trunk, row_branches) in enumerate(zip(trunks, branches)):
        n = len(trunk)
        input_ids[r, :n] = torch.as_tensor(list(trunk), dtype=torch.long)
        position_ids[r, :n] = torch.arange(n)
        segment[r, :n] = 0
        row_starts, at = [], n
        for i, b in enumerate(row_branches):
            if not 0 <= b.trunk_end <= n:
                raise ValueError(f"branch {i} of row {r} sees trunk[:{b.trunk_end}], but the trunk has {n} tokens")
            m = len(b.tokens)
            input_ids[r, at : at + m] = torch.as_tensor(list(b.tokens), dtype=torch.long)
            position_ids[r, at : at + m] = torch.arange(b.position, b.position + m)
            segment[r, at : at + m] = i + 1
            trunk_end[r, at : at + m] = b.trunk_end
            row_starts.append(at)
            at += m
        starts.append(row_starts)
    return PackedRows(input_ids, position_ids, segment, trunk_end, starts)


def dense_mask(packed: PackedRows, device=None) -> torch.Tensor:
    """Boolean ``(R, 1, L, L)``, True where query q sees key k (padding sees the padding before it)."""
    segment, trunk_end = packed.segment.to(device), packed.trunk_end.to(device)
    k = torch.arange(segment.shape[1], device=segment.device)
    causal = k[None, :] <= k[:, None]
    same = segment[:, :, None] == segment[:, None, :]
    return ((same & causal) | (k[None, None, :] < trunk_end[:, :, None])).unsqueeze(1)


def additive_mask(packed: PackedRows, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """``dense_mask`` as HF eager attention wants it: 0 where seen, the dtype's minimum elsewhere."""
    seen = dense_mask(packed, device)
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:
        return False
    return True


def flex_mask(packed: PackedRows, device=None):
    """The same rule as a flex-attention ``BlockMask`` (blocks nobody sees are skipped, never computed)."""
    from torch.nn.attention.flex_attention import create_block_mask

    segment, trunk_end = packed.segment.to(device), packed.trunk_end.to(device)

    def sees(b, h, q, k):
        return ((k <= q) & (segment[b, k] == segment[b, q])) | (k < trunk_end[b, q])

    rows, length = segment.shape
    return create_block_mask(sees, rows, None, length, length, device=segment.device)


BlockMaskFn = Callable[[PackedRows], object]


def _config(model):
    for candidate in (model, getattr(model, "module", None), getattr(getattr(model, "module", None), "model", None),
                      getattr(model, "model", None)):
        config = getattr(candidate, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            return config
    raise ValueError(f"{type(model).__name__} has no HF config with an attention implementation to switch")


@contextlib.contextmanager
def block_attention(model, prefer_flex: bool = True) -> Iterator[BlockMaskFn]:
    """Run ``model`` (HF, or wrapped by DeepSpeed / OpenRLHF's Actor) with an attention implementation that takes a
    block mask, and yield the mask builder to feed it: flex attention on CUDA when PyTorch has it (and
    ``prefer_flex``), else sdpa. The weights are untouched; the model's own implementation comes back after."""
    config = _config(model)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    before = config._attn_implementation
    if prefer_flex and device.type == "cuda" and flex_available():
        config._attn_implementation, build = "flex_attention", lambda p: flex_mask(p, device)
    elif before == "eager":
        build = lambda p: additive_mask(p, dtype, device)  # noqa: E731
    else:
        config._attn_implementation, build = "sdpa", lambda p: dense_mask(p, device)
    try:
        yield build
    finally:
        config._attn_implementation = before


def contiguous_span(attention_mask_row: torch.Tensor) -> Tuple[int, int]:
    """(first, end) of the row's valid tokens; they must be one run (OpenRLHF's left or right padding)."""
    valid = attention_mask_row.bool().nonzero().flatten()
    if len(valid) == 0:
        return 0, 0
    first, end = int(valid[0]), int(valid[-1]) + 1
    if end - first != len(valid):
        raise ValueError(
            "branch packing needs each row's attention_mask to be one run of ones (left or right padding only); "
            "this row has holes: use branch_pack=False (BRANCH_PACK=0) for such batches"
        )
    return first, end
