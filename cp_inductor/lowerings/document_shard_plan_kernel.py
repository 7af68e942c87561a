"""``document_shard_plan`` in one Triton launch: this rank's queries (a CP shard) cut into
segments of one document each, every segment over its document's keys in the gathered pack.

The aten form is some forty small kernels (a sort among them, to number the rounds), and their
host launches are time the GPU waits at a step's first attention, as ``document_plan_kernel.py``
found for the unsharded plan. One program makes four passes, a barrier between each (a pass reads
what the one before wrote), each over its tokens in blocks with what it counts carried from block
to block:

    pack:    run_of[p] = the run (document) of pack token p = b*K + t; cu_docs; the longest run;
             whether ids never fall within a row
    queries: at[i] = b*K + clamp(query_positions[b, j]); a segment starts where at[i]'s run
             changes or at[i] is not at[i-1] + 1 (i = b*Q + j): cu_q; per segment, its
             document's first key (cu_k) and how many keys it reads (used: up to its last query's
             position when causal, the whole document otherwise); the longest segment
    rounds:  segments of one document go to different FA4 calls (their dK/dV would collide in
             one): a segment's round is how many segments of its document come before it. Where
             the runs never fall along the queries (every balancer torch ships cuts a row's
             shard in rising positions), a document's segments are consecutive and that is the
             segment's index less its document's first segment's: a running max, no sort
    keys:    key_rows[j] = b*K + clamp(key_positions[b, t]) and its inverse key_order, a
             permutation where every pack slot is written once (checked: slots start at -1)

``meta`` = [segments, rounds, longest segment, longest document, packable, redo, bounds] (int64,
on device; bounds: what the ids are, ``document_attention.BOUNDS``, each run's first or last
index where the mask is written with them, checked in the pack pass). ``redo`` where this kernel cannot vouch for its plan: runs that fall along the queries
(its rounds would not be the sort's), or checked ids that fall within a row (contiguous or not,
only a sort can tell). The op then runs the aten plan instead, once, on the host's request:
never a different answer.
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
def _load_at(i, n, queries, keys, qpos, qpos_row, qpos_col, run_of, HAS_QPOS: tl.constexpr):
    """Query row ``i``'s pack position (clamped to its row), its run, and whether its position
    lies in the row."""
    live = (i >= 0) & (i < n)
    b, j = i // queries, i % queries
    if HAS_QPOS:  # as the table holds them (no narrowing before the range check)
        q = tl.load(qpos + b * qpos_row + j * qpos_col, mask=live, other=0)
    else:
        q = j
    at = tl.minimum(tl.maximum(q, 0), keys - 1).to(tl.int32) + b * keys
    run = tl.load(run_of + at, mask=live, other=-1)
    return at, run, (q >= 0) & (q < keys)


@triton.jit
def _shard_plan_kernel(ids, ids_row, ids_col, qpos, qpos_row, qpos_col, kpos, kpos_row, kpos_col,
                       run_of, cu_docs, cu_q, cu_k, used, seg_round, row_round, key_order, key_rows, meta,
                       keys, queries, pack, n,
                       CHECK: tl.constexpr, CAUSAL: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KPOS: tl.constexpr,
                       BOUNDS: tl.constexpr, BLOCK: tl.constexpr):
    zero = tl.program_id(0) * 0  # int32 scalars carried across blocks
    # pack: the runs of the ids
    docs, open_doc, longest_doc, monotone, bounded = zero, zero - 1, zero, zero + 1, zero + 1
    for first in range(0, pack, BLOCK):
        p = first + tl.arange(0, BLOCK)
        live = p < pack
        b, t = p // keys, p % keys
        row_start = t == 0
        cur = tl.load(ids + b * ids_row + t * ids_col, mask=live, other=0)
        prev = tl.load(ids + b * ids_row + (t - 1) * ids_col, mask=live & ~row_start, other=0)
        start = live & (row_start | (cur != prev))
        run = docs + tl.cumsum(start.to(tl.int32), 0) - 1
        tl.store(run_of + p, run, mask=live)
        tl.store(cu_docs + run, p, mask=start)
        doc_start = tl.maximum(tl.associative_scan(tl.where(start, p, -1), 0, _larger), open_doc)
        longest_doc = tl.maximum(longest_doc, tl.max(tl.where(live, p - doc_start + 1, 0), 0))
        open_doc = tl.max(doc_start, 0)
        monotone = monotone & tl.min((~live | row_start | (cur >= prev)).to(tl.int32), 0)
        if BOUNDS == 1:  # ids are each run's first index (document_attention.BOUNDS)
            bounded = bounded & tl.min((~start | (cur == t)).to(tl.int32), 0)
        if BOUNDS == 2:  # ... or its last
            row_end = t == keys - 1
            after = tl.load(ids + b * ids_row + (t + 1) * ids_col, mask=live & ~row_end, other=0)
            bounded = bounded & tl.min((~(live & (row_end | (after != cur))) | (cur == t)).to(tl.int32), 0)
        docs += tl.sum(start.to(tl.int32), 0)
    for first in range(0, pack + 1, BLOCK):
        p = first + tl.arange(0, BLOCK)
        tl.store(cu_docs + p, pack, mask=(p >= docs) & (p <= pack))
    tl.debug_barrier()
    # queries: segments, their keys, their rounds
    segments, open_segment, longest_q = zero, zero - 1, zero
    group_first, rounds, ordered, in_range = zero - 1, zero, zero + 1, zero + 1
    for first in range(0, n, BLOCK):
        i = first + tl.arange(0, BLOCK)
        live = i < n
        at, run, inside = _load_at(i, n, queries, keys, qpos, qpos_row, qpos_col, run_of, HAS_QPOS)
        at_prev, run_prev, _ = _load_at(i - 1, n, queries, keys, qpos, qpos_row, qpos_col, run_of, HAS_QPOS)
        at_next, run_next, _ = _load_at(i + 1, n, queries, keys, qpos, qpos_row, qpos_col, run_of, HAS_QPOS)
        in_range = in_range & tl.min((~live | inside).to(tl.int32), 0)
        other_doc = (i == 0) | (run != run_prev)
        new = live & (other_doc | (at != at_prev + 1))
        ends = live & ((i == n - 1) | (run_next != run) | (at_next != at + 1))
        segment = segments + tl.cumsum(new.to(tl.int32), 0) - 1
        tl.store(cu_q + segment, i, mask=new)
        starts_row = tl.maximum(tl.associative_scan(tl.where(new, i, -1), 0, _larger), open_segment)
        longest_q = tl.maximum(longest_q, tl.max(tl.where(live, i - starts_row + 1, 0), 0))
        open_segment = tl.max(starts_row, 0)
        doc_start = tl.load(cu_docs + run, mask=ends, other=0)
        if CAUSAL:
            reads = at + 1 - doc_start
        else:
            reads = tl.load(cu_docs + run + 1, mask=ends, other=0) - doc_start
        tl.store(cu_k + segment, doc_start, mask=ends)
        tl.store(used + segment, reads, mask=ends)
        first_of_doc = tl.maximum(tl.associative_scan(tl.where(new & other_doc, segment, -1), 0, _larger), group_first)
        round_ = segment - first_of_doc
        tl.store(row_round + i, round_, mask=live)
        tl.store(seg_round + segment, round_, mask=new)
        rounds = tl.maximum(rounds, tl.max(tl.where(live, round_ + 1, 0), 0))
        group_first = tl.max(first_of_doc, 0)
        ordered = ordered & tl.min((~live | (i == 0) | (run >= run_prev)).to(tl.int32), 0)
        segments += tl.sum(new.to(tl.int32), 0)
    for first in range(0, n + 1, BLOCK):
        s = first + tl.arange(0, BLOCK)
        spare = (s >= segments) & (s <= n)
        tl.store(cu_q + s, n, mask=spare)
        tl.store(cu_k + s, pack, mask=spare)
        tl.store(used + s, 0, mask=spare & (s < n))
        tl.store(seg_round + s, -1, mask=spare & (s < n))
    # keys: where each gathered row sits in the pack, and back
    permutation = zero + 1
    if HAS_KPOS:
        for first in range(0, pack, BLOCK):
            p = first + tl.arange(0, BLOCK)
            live = p < pack
            b, t = p // keys, p % keys
            k = tl.load(kpos + b * kpos_row + t * kpos_col, mask=live, other=0)
            permutation = permutation & tl.min((~live | ((k >= 0) & (k < keys))).to(tl.int32), 0)
            tl.store(key_rows + p, (tl.minimum(tl.maximum(k, 0), keys - 1) + b * keys).to(tl.int64), mask=live)
            tl.store(key_order + p, tl.full([BLOCK], -1, tl.int64), mask=live)
        tl.debug_barrier()
        for first in range(0, pack, BLOCK):
            p = first + tl.arange(0, BLOCK)
            live = p < pack
            row = tl.load(key_rows + p, mask=live, other=0)
            tl.store(key_order + row, p.to(tl.int64), mask=live)
        tl.debug_barrier()
        for first in range(0, pack, BLOCK):  # a slot no row landed in: two rows share one
            p = first + tl.arange(0, BLOCK)
            live = p < pack
            permutation = permutation & tl.min((~live | (tl.load(key_order + p, mask=live, other=0) >= 0)).to(tl.int32), 0)
    sure = monotone if CHECK else zero + 1
    tl.store(meta + 0, segments.to(tl.int64))
    tl.store(meta + 1, rounds.to(tl.int64))
    tl.store(meta + 2, longest_q.to(tl.int64))
    tl.store(meta + 3, longest_doc.to(tl.int64))
    tl.store(meta + 4, (sure & in_range & permutation & bounded).to(tl.int64))
    tl.store(meta + 5, ((1 - sure) | (1 - ordered)).to(tl.int64))
    tl.store(meta + 6, (zero + BOUNDS).to(tl.int64))


def document_shard_plan(rows: torch.Tensor, query_positions: torch.Tensor | None, key_positions: torch.Tensor | None,
                        check: bool, is_causal: bool, queries: int, bounds: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``rows`` ``[B, K]`` ids, ``query_positions`` ``[B, Q]`` (None: ``0..Q-1``),
    ``key_positions`` ``[B, K]`` (None: the keys in pack order), any strides: the plan
    (``document_attention._shard_plan``'s seven tensors) and ``meta`` ``[7]``, on ``rows``' device."""
    batch, keys = rows.shape
    pack, n = batch * keys, batch * queries
    new = rows.new_empty
    run_of, cu_docs = new(pack, dtype=torch.int32), new(pack + 1, dtype=torch.int32)
    cu_q, cu_k = new(n + 1, dtype=torch.int32), new(n + 1, dtype=torch.int32)
    used, seg_round, row_round = (new(n, dtype=torch.int32) for _ in range(3))
    key_order, key_rows = new(pack, dtype=torch.int64), new(pack, dtype=torch.int64)
    meta = new(7, dtype=torch.int64)
    qpos = rows if query_positions is None else query_positions
    kpos = rows if key_positions is None else key_positions
    _shard_plan_kernel[(1,)](rows, rows.stride(0), rows.stride(1), qpos, qpos.stride(0), qpos.stride(1),
                             kpos, kpos.stride(0), kpos.stride(1), run_of, cu_docs, cu_q, cu_k, used, seg_round,
                             row_round, key_order, key_rows, meta, keys, queries, pack, n,
                             CHECK=check, CAUSAL=is_causal, HAS_QPOS=query_positions is not None,
                             HAS_KPOS=key_positions is not None, BOUNDS=bounds, BLOCK=BLOCK)
    return [cu_q, cu_k, used, seg_round, row_round, key_order, key_rows], meta
