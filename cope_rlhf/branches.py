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
attention takes), ``additive_mask`` (0 / dtype-min, for eager attention), ``flex_mask`` (a flex-attention
``BlockMask``, block-sparse, for GPUs) or ``layout_mask`` (the layout itself, ``(rows, 1, 2, L)``: segment and
trunk_end, read by ``branch_attention``). A dense mask makes every query pay for all L keys; ``branch_attention``
(registered with HF as ``cope_branch_sdpa``) spares the trunk that: the trunk as one causal sdpa call, then the
M = sum_i m_i branch tokens as one masked call over the row's first n + M columns, i.e. about n^2/2 + M (n + M)
instead of (n + M)^2, on views of the keys and values (one sdpa call per branch over ``trunk[:trunk_end] + itself``
would need a copy of that trunk prefix per branch, kept until the backward; ``benchmarks/signal_cost.py`` measures
the memory).
``block_attention(model)`` switches a HF model to an attention implementation that takes a block mask for the
duration of a call (flex attention on CUDA when PyTorch has it; eager models keep eager with the additive mask;
``cope_branch_sdpa`` otherwise) and yields the matching mask builder; flash-attention kernels cannot take one.
"""

from __future__ import annotations

import contextlib
import functools
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
    trunks: Sequence[Sequence[int]], branches: Sequence[Sequence[Branch]], pad_token_id: int = 0, width: int = 0
) -> PackedRows:
    """One right-padded row per trunk, at least ``width`` columns wide; the trunk sits at positions 0, 1, ..."""
    if len(trunks) != len(branches):
        raise ValueError(f"{len(trunks)} trunks but {len(branches)} branch lists: give one list per trunk")
    lengths = [len(t) + sum(len(b.tokens) for b in bs) for t, bs in zip(trunks, branches)]
    width = max([width, *lengths])
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


class RowRequest(NamedTuple):
    """One consumer's share of a trajectory's packed row: the trajectory tokens it needs as trunk (a prefix of the
    trajectory), its branches, and ``columns(starts)``: the columns whose logits it reads, given the first column
    of each of its branches (trunk columns are trunk positions)."""

    trunk: Sequence[int]
    branches: Sequence[Branch]
    columns: Callable[[List[int]], torch.Tensor]


def run_requests(logits_fn: Callable, requests: Sequence[Sequence[RowRequest]], block_mask: "BlockMaskFn",
                 rows_per_forward: int, device=None) -> List[List[torch.Tensor]]:
    """Several consumers off the same trajectories in one forward per ``rows_per_forward`` trajectories.
    ``requests[r]`` are trajectory r's consumers; row r's trunk is the longest of their trunks (the others must be
    its prefixes), its branches theirs one after another. Returns ``out[r][c]``: consumer c's logits at its
    columns, ``(len(columns), V)``; the LM head runs at those columns only (``logit_columns``)."""
    out: List[List[torch.Tensor]] = []
    for c in range(0, len(requests), rows_per_forward):
        chunk = requests[c : c + rows_per_forward]
        trunks, branches, spans = [], [], []
        for consumers in chunk:
            trunk = max((list(q.trunk) for q in consumers), key=len)
            for q in consumers:
                if list(q.trunk) != trunk[: len(q.trunk)]:
                    raise ValueError("requests off one trajectory disagree on its tokens: give each trajectory its "
                                     "own row, its trunks prefixes of its own tokens")
            row_branches, row_spans = [], []
            for q in consumers:
                row_spans.append((len(row_branches), len(q.branches)))
                row_branches.extend(q.branches)
            trunks.append(trunk)
            branches.append(row_branches)
            spans.append(row_spans)
        packed = pack_rows(trunks, branches)
        columns = [[q.columns(packed.starts[i][a : a + n]) for q, (a, n) in zip(consumers, spans[i])]
                   for i, consumers in enumerate(chunk)]
        keep, where = logit_columns(torch.cat([col for row in columns for col in row]), packed.input_ids.shape[1])
        mask = block_mask(packed)
        mask = mask.to(device) if isinstance(mask, torch.Tensor) else mask
        logits = logits_fn(packed.input_ids.to(device), mask, packed.position_ids.to(device), keep.to(device))
        out.extend([logits[i, where[col].to(logits.device)] for col in row] for i, row in enumerate(columns))
        del logits
    return out


def logit_columns(columns: torch.Tensor, width: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(keep, where): the distinct ``columns`` (sorted) whose logits a consumer reads, to hand the model as HF's
    ``logits_to_keep`` (the LM head then runs there only: a packed row's full (L, V) logits would not fit a GPU
    at a real vocabulary), and ``where[c]``, the index of column c among them (-1: not kept)."""
    keep = torch.unique(columns.flatten())
    where = torch.full((width,), -1, dtype=torch.long)
    where[keep] = torch.arange(len(keep))
    return keep, where


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

BRANCH_ATTENTION = "cope_branch_sdpa"


def layout_mask(packed: PackedRows) -> torch.Tensor:
    """``(R, 1, 2, L)`` long: segment and trunk_end (``branch_attention`` reads its runs as lists, in every layer)."""
    return torch.stack([packed.segment, packed.trunk_end], dim=1).unsqueeze(1)


def branch_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """HF attention function for ``layout_mask`` rows (see the module docstring); query ``(R, H, L, D)``, key and
    value ``(R, Hkv, L, D)``; returns ``(R, L, H, D)`` as HF's sdpa does. Padding columns get zeros.

    Per row, two sdpa calls on views of the row (no copies of keys or values, whose copies would live until the
    backward): the trunk, causal; then every branch at once, its queries over the row's columns up to the last
    branch under the ``sees`` rule as a boolean mask ((sum_i m_i) x (n + sum_i m_i), built once per row and layer).
    The layout puts branches right after the trunk and padding only at the end (``pack_rows``)."""
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[2] != 2:
        raise ValueError(f"attention implementation {BRANCH_ATTENTION!r} takes layout_mask(packed) as its attention "
                         "mask; run the model inside block_attention(model) and give it the builder's mask")
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, dropout_p=dropout, scale=scaling,
                             enable_gqa=query.shape[1] != key.shape[1])
    rows = []
    for r in range(query.shape[0]):
        q, k, v = query[r : r + 1], key[r : r + 1], value[r : r + 1]
        segment, trunk_end = attention_mask[r, 0, 0], attention_mask[r, 0, 1]
        n = int((segment == 0).sum())  # trunk tokens, at the row's start
        end = int((segment != PAD_SEGMENT).sum())  # the last branch's end: padding only follows it
        pieces = []
        if n:  # the trunk: plain causal attention, the kernel skips the upper triangle
            pieces.append(sdpa(q[:, :, :n], k[:, :, :n], v[:, :, :n], is_causal=True))
        if end > n:
            column = torch.arange(end, device=q.device)
            own = (segment[None, :end] == segment[n:end, None]) & (column[None, :] <= column[n:end, None])
            seen = own | (column[None, :] < trunk_end[n:end, None])
            pieces.append(sdpa(q[:, :, n:end], k[:, :, :end], v[:, :, :end], attn_mask=seen))
        if end < query.shape[2]:
            pieces.append(q.new_zeros(1, q.shape[1], query.shape[2] - end, q.shape[3]))
        rows.append(torch.cat(pieces, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


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
        from transformers import AttentionInterface

        # A layout mask is 4D, so HF hands it to the attention function untouched (no mask builder needed).
        AttentionInterface.register(BRANCH_ATTENTION, branch_attention)
        config._attn_implementation, build = BRANCH_ATTENTION, layout_mask
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
            f"the CoPE signals pack each row as one run of tokens, but this row's attention_mask has holes (valid "
            f"tokens {first}..{end - 1} with {end - first - len(valid)} masked among them); OpenRLHF's experiences "
            "are left- or right-padded only: build rows whose valid tokens are contiguous"
        )
    return first, end
