"""``document_plan`` in one Triton launch: the runs of a ``[B, T]`` table of document ids.

The plan's aten form is some fifteen small kernels (twenty with the sort its contiguity check
needs), and their host launches, 0.5-0.8 ms measured on an H200, are time the GPU waits at a
step's first attention. One program walks the ``B*T`` tokens in blocks, carrying the run count
and the open run's start from block to block:

    start[n]  = t == 0 or ids[b, t] != ids[b, t - 1]         (n = b*T + t)
    cu[rank]  = n for each start (rank: starts before it), then cu[count:] = B*T
    longest   = max over n of n - (the last start at or before n) + 1
    monotone  = ids never fall within a row; rising = positions rise within each run

and, where the ids are bounds (``document_attention.BOUNDS``), that each run holds its first
(``BOUNDS`` 1) or its last (2) index; and writes ``meta`` = [count, longest, contiguous, unsure]
(int64, on device):
``contiguous`` where ids that never fall (or need no check) meet positions that rise;
``unsure`` where ids that are checked fall somewhere: contiguous or not, only the sort can tell
(``document_attention`` runs it then, once, on the host's request).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _larger(a, b):
    return tl.maximum(a, b)


@triton.jit
def _document_plan_kernel(ids, ids_row, ids_col, pos, pos_row, pos_col, cu, meta, tokens, total,
                          CHECK: tl.constexpr, HAS_POSITIONS: tl.constexpr, BOUNDS: tl.constexpr, BLOCK: tl.constexpr):
    zero = tl.program_id(0) * 0  # int32 scalars carried across blocks
    count, open_start, longest = zero, zero - 1, zero
    monotone, rising, bounded = zero + 1, zero + 1, zero + 1
    for first in range(0, total, BLOCK):
        n = first + tl.arange(0, BLOCK)
        live = n < total
        b, t = n // tokens, n % tokens
        row_start = t == 0
        cur = tl.load(ids + b * ids_row + t * ids_col, mask=live, other=0)
        prev = tl.load(ids + b * ids_row + (t - 1) * ids_col, mask=live & ~row_start, other=0)
        start = live & (row_start | (cur != prev))
        rank = count + tl.cumsum(start.to(tl.int32), 0) - 1
        tl.store(cu + rank, n, mask=start)
        run_start = tl.maximum(tl.associative_scan(tl.where(start, n, -1), 0, _larger), open_start)
        longest = tl.maximum(longest, tl.max(tl.where(live, n - run_start + 1, 0), 0))
        open_start = tl.max(run_start, 0)
        monotone = monotone & tl.min((~live | row_start | (cur >= prev)).to(tl.int32), 0)
        if HAS_POSITIONS:
            p = tl.load(pos + b * pos_row + t * pos_col, mask=live, other=0)
            p_prev = tl.load(pos + b * pos_row + (t - 1) * pos_col, mask=live & ~row_start, other=0)
            rising = rising & tl.min((~live | start | (p > p_prev)).to(tl.int32), 0)
        if BOUNDS == 1:  # each run starts at the index it holds
            bounded = bounded & tl.min((~start | (cur == t)).to(tl.int32), 0)
        if BOUNDS == 2:  # each run ends at the index it holds
            row_end = t == tokens - 1
            after = tl.load(ids + b * ids_row + (t + 1) * ids_col, mask=live & ~row_end, other=0)
            ends = live & (row_end | (after != cur))
            bounded = bounded & tl.min((~ends | (cur == t)).to(tl.int32), 0)
        count += tl.sum(start.to(tl.int32), 0)
    for first in range(0, total + 1, BLOCK):
        i = first + tl.arange(0, BLOCK)
        tl.store(cu + i, total, mask=(i >= count) & (i <= total))
    sure = monotone if CHECK else zero + 1
    tl.store(meta + 0, count.to(tl.int64))
    tl.store(meta + 1, longest.to(tl.int64))
    tl.store(meta + 2, (sure & rising & bounded).to(tl.int64))
    tl.store(meta + 3, ((1 - sure) & rising & bounded).to(tl.int64))


def document_plan(rows: torch.Tensor, positions: torch.Tensor | None, check: bool,
                  bounds: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (and ``positions``) ``[B, T]``, any strides: (``cu_seqlens`` ``[B*T + 1]`` int32,
    ``meta`` ``[4]`` int64), both on ``rows``' device."""
    batch, tokens = rows.shape
    total = batch * tokens
    cu = torch.empty(total + 1, dtype=torch.int32, device=rows.device)
    meta = torch.empty(4, dtype=torch.int64, device=rows.device)
    pos = rows if positions is None else positions
    _document_plan_kernel[(1,)](rows, rows.stride(0), rows.stride(1), pos, pos.stride(0), pos.stride(1), cu, meta,
                                tokens, total, CHECK=check, HAS_POSITIONS=positions is not None, BOUNDS=bounds,
                                BLOCK=BLOCK)
    return cu, meta
