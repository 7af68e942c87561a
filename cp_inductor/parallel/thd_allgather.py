"""Packed sequences (THD) through K/V all-gather CP, Llama 3's recipe: any document lengths, no
padding of documents, work balanced over ranks.

    local, shard = shard_pack(tokens, lengths, rank, cp, balance="document")   # data loader, host
    out = thd_allgather_attention(q, k, v, shard, is_causal=True)              # [T_local, H, D]
    full = unshard_pack(out, shard)                                            # [T, H, D], every rank

A pack holds documents of ``lengths`` back to back (T tokens). ``shard_pack`` gives this rank its
tokens and a :class:`PackShard`: the pieces it holds, as cu_seqlens over its local tokens, and
for each piece where its document starts in the pack and how many of its keys it reads. Two
balances:

* ``"document"``: every document is cut into 2*cp contiguous pieces of near-equal length; rank r
  holds pieces r and 2cp-1-r (head-tail per document: a causal document's work splits evenly).
  The leftover tokens of documents not divisible by 2*cp go to pieces in turn over the whole
  pack, so even a pack of 1-token documents spreads over the ranks. Empty pieces are dropped.
* ``"pack"``: the pack is cut into 2*cp chunks of near-equal length (Llama 3 paper's head-tail);
  a rank's pieces are its chunks' intersections with the documents.

``thd_allgather_attention`` gathers K and V in ONE collective (stacked; ranks' shares padded to
the longest), puts them in pack order (one index_select), and runs each local piece against its
document's keys: the prefix up to the piece's last token (causal, bottom-right) or the whole
document. FA4 reads the gathered buffer in place (``seqused_k``; the default where it can run);
the portable path (``kernel="sdpa"``, any device) slices each piece's keys. The backward's dK/dV go
back through the reorder (a row gather, not a scatter into zeros) and the gather's backward, a
reduce-scatter.

The record is built on the host from the lengths (where a data loader has them) and lives on the
device; attention needs no host read of the lengths per call. ``capacity`` and ``max_docs``
make it static (every rank holds ``capacity`` rows, its tokens then padding; ``shard.valid``
says which): packs of new lengths reuse one compiled graph and one CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .allgather import _all_gather
from .sharding import gqa

BALANCES = ("document", "pack")


@dataclass(frozen=True)
class Piece:
    """A stretch of one document that one rank holds: pack positions [start, end)."""

    rank: int
    doc_start: int  # where its document starts in the pack
    doc_end: int
    start: int
    end: int


@dataclass
class Round:
    """Local pieces of which no two share a document: one varlen call's worth (the kernel then
    reads no key row twice, so its backward writes each row's dK/dV once). Its pieces are the
    local rows [row_start, row_end), in pack order."""

    row_start: int
    row_end: int
    cu_seqlens_q: torch.Tensor  # [P + 1] the pieces over the round's rows
    cu_seqlens_k: torch.Tensor  # [P + 1] cu_seqlens_k[i]: where piece i's document starts in the pack
    seqused_k_causal: torch.Tensor  # [P] keys piece i reads, causal: its document's prefix up to its end
    seqused_k_full: torch.Tensor  # [P] not causal: its whole document
    max_q: int  # the longest piece
    max_k: int  # the longest document

    def seqused_k(self, causal: bool) -> torch.Tensor:
        return self.seqused_k_causal if causal else self.seqused_k_full


@dataclass
class PackShard:
    """This rank's share of a pack (tensors on the pack's device, int32 as varlen kernels take).
    Its local tokens are its rounds' rows one after the other (round 0: each document's first
    local piece, round 1: the second, if any), each round's in pack order."""

    rank: int
    cp: int
    tokens: int  # T, the whole pack
    local_tokens: int  # this rank's T_local
    padded_tokens: int  # the longest T_local over ranks: what each rank sends in the gather
    rounds: tuple[Round, ...]
    local_index: torch.Tensor  # [T_local] int64: pack positions of the local tokens, in local order
    pack_index: torch.Tensor  # [T] int64: for each pack position, its row in the gathered [cp * T_pad] buffer
    gather_index: torch.Tensor  # [cp * T_pad] int64: for each gathered row, its pack position (-1: padding)
    pieces: tuple[Piece, ...]  # this rank's, in local order (host copy: the portable kernel and tests)
    # Static shards (``capacity``): per local row its round, -1 for the padding rows (None otherwise)
    row_round: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor:
        """[rows] bool: the local rows that hold tokens (the rest is a static shard's padding)."""
        rows = self.local_index.shape[0]
        if self.row_round is None:
            return torch.ones(rows, dtype=torch.bool, device=self.local_index.device)
        return self.row_round >= 0


def _document_pieces(lengths: list[int], cp: int) -> list[Piece]:
    n, pieces, turn = 2 * cp, [], 0
    start = 0
    for length in lengths:
        base, extra = divmod(length, n)
        sizes = [base] * n
        for j in range(extra):  # the leftover tokens go to pieces in turn over the pack
            sizes[(turn + j) % n] += 1
        turn = (turn + extra) % n
        at = start
        for i, size in enumerate(sizes):
            if size:
                pieces.append(Piece(min(i, n - 1 - i), start, start + length, at, at + size))
            at += size
        start += length
    return pieces


def _pack_pieces(lengths: list[int], cp: int) -> list[Piece]:
    n, total = 2 * cp, sum(lengths)
    bounds = [total * i // n for i in range(n + 1)]
    docs, start = [], 0
    for length in lengths:
        docs.append((start, start + length))
        start += length
    pieces = []
    for i in range(n):
        lo, hi = bounds[i], bounds[i + 1]
        for a, b in docs:
            if max(a, lo) < min(b, hi):
                pieces.append(Piece(min(i, n - 1 - i), a, b, max(a, lo), min(b, hi)))
    return pieces


def _lengths(lengths) -> list[int]:
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"document lengths must be >= 0, got {lengths}")
    return [n for n in lengths if n]


def plan_pack(lengths, cp: int, balance: str = "document") -> list[Piece]:
    """Every rank's pieces of the pack, rank-major, each rank's in the order its tokens are kept."""
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    pieces = (_document_pieces if balance == "document" else _pack_pieces)(_lengths(lengths), cp)
    merged: list[Piece] = []
    for p in sorted(pieces, key=lambda p: (p.rank, p.start)):  # a rank keeps its tokens in pack order
        last = merged[-1] if merged else None
        if last is not None and (last.rank, last.doc_start, last.end) == (p.rank, p.doc_start, p.start):
            merged[-1] = Piece(p.rank, p.doc_start, p.doc_end, last.start, p.end)  # one stretch, one call
        else:
            merged.append(p)
    return merged


def attention_work(pieces: list[Piece], cp: int, causal: bool = True) -> list[int]:
    """Query-key pairs each rank's attention computes (its FLOPs up to a constant)."""
    work = [0] * cp
    for p in pieces:
        if causal:  # a query at document position x reads x + 1 keys
            first, last = p.start - p.doc_start + 1, p.end - p.doc_start
            work[p.rank] += (first + last) * (last - first + 1) // 2
        else:
            work[p.rank] += (p.end - p.start) * (p.doc_end - p.doc_start)
    return work


def _in_rounds(pieces: list[Piece]) -> list[list[Piece]]:
    """One rank's pieces (pack order) dealt into rounds: a document's i-th piece to round i."""
    rounds: list[list[Piece]] = []
    seen: dict[int, int] = {}
    for p in pieces:
        i = seen.get(p.doc_start, 0)
        seen[p.doc_start] = i + 1
        if i == len(rounds):
            rounds.append([])
        rounds[i].append(p)
    return rounds


def _ints(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _round(pieces: list[Piece], row_start: int, total: int, device, capacity: int | None = None,
           max_docs: int | None = None) -> Round:
    """One call's worth of pieces, the local rows from ``row_start``. Static (``capacity``): the
    call takes ALL ``capacity`` local rows and ``max_docs`` sequences (the unused ones empty), so
    its shapes and bounds are the same for every pack: one compiled graph (and one CUDA graph)
    serves packs of any lengths."""
    sizes = [p.end - p.start for p in pieces]
    documents = [p.doc_end - p.doc_start for p in pieces]
    if capacity is None:  # the call takes the round's rows alone
        rows, offset, unused, max_q, max_k = (row_start, row_start + sum(sizes)), 0, 0, max(sizes), max(documents)
    else:
        assert max_docs is not None  # make_shard passes capacity and max_docs together
        if len(pieces) > max_docs:
            raise ValueError(f"a round holds {len(pieces)} documents, more than max_docs={max_docs}")
        rows, offset, unused, max_q, max_k = (0, capacity), row_start, max_docs - len(pieces), capacity, max(total, 1)
    cu_q = [offset + end for end in torch.tensor([0, *sizes], dtype=torch.int64).cumsum(0).tolist()]
    return Round(
        row_start=rows[0], row_end=rows[1],
        cu_seqlens_q=_ints(cu_q + [cu_q[-1]] * unused, device),
        cu_seqlens_k=_ints([p.doc_start for p in pieces] + [total] * (unused + 1), device),
        seqused_k_causal=_ints([p.end - p.doc_start for p in pieces] + [0] * unused, device),
        seqused_k_full=_ints(documents + [0] * unused, device),
        max_q=max_q, max_k=max_k,
    )


def make_shard(lengths, rank: int, cp: int, balance: str = "document", device=None, *,
               capacity: int | None = None, max_docs: int | None = None) -> PackShard:
    """The record of rank ``rank``'s share (see the module docstring). ``capacity`` and
    ``max_docs`` (together) make it static: every rank holds ``capacity`` rows (its tokens, then
    padding), each round is one call over all of them with ``max_docs`` sequences, so packs of
    new lengths but the same size reuse one compiled graph and its CUDA graph
    (``mode="reduce-overhead"``). Raises ValueError when the pack does not fit."""
    if (capacity is None) != (max_docs is None):
        raise ValueError("capacity and max_docs go together")
    every = plan_pack(lengths, cp, balance)
    total = sum(_lengths(lengths))
    by_rank = [_in_rounds([p for p in every if p.rank == r]) for r in range(cp)]
    counts = [sum(p.end - p.start for rnd in rounds for p in rnd) for rounds in by_rank]
    padded = max(counts) if capacity is None else capacity
    if max(counts) > padded:
        raise ValueError(f"a rank holds {max(counts)} tokens of this pack, more than capacity={capacity}")
    pack_index = torch.empty(total, dtype=torch.int64)
    for r, rank_rounds in enumerate(by_rank):  # rank r's local rows sit at r * T_pad in the gather
        row = r * padded
        for p in (p for rnd in rank_rounds for p in rnd):
            pack_index[p.start:p.end] = torch.arange(row, row + p.end - p.start)
            row += p.end - p.start
    gather_index = torch.full((cp * padded,), -1, dtype=torch.int64)
    gather_index[pack_index] = torch.arange(total)
    static = {} if capacity is None else {"capacity": capacity, "max_docs": max_docs}
    mine, rounds, row = [], [], 0
    for rnd in by_rank[rank] + ([[]] * (2 - len(by_rank[rank])) if static else []):  # static: always two calls
        rounds.append(_round(rnd, row, total, device, **static))
        row += sum(p.end - p.start for p in rnd)
        mine += rnd
    local = [torch.arange(p.start, p.end) for p in mine]
    row_round = None
    if capacity is not None:  # padding rows read pack position 0: any token will do, none is kept
        local.append(torch.zeros(capacity - counts[rank], dtype=torch.int64))
        row_round = torch.cat([torch.full((sum(p.end - p.start for p in rnd),), i, dtype=torch.int32)
                               for i, rnd in enumerate(by_rank[rank])]
                              + [torch.full((capacity - counts[rank],), -1, dtype=torch.int32)]).to(device)
    return PackShard(
        rank=rank, cp=cp, tokens=total, local_tokens=counts[rank], padded_tokens=padded, rounds=tuple(rounds),
        local_index=torch.cat(local).to(device) if local else torch.empty(0, dtype=torch.int64, device=device),
        pack_index=pack_index.to(device), gather_index=gather_index.to(device), pieces=tuple(mine),
        row_round=row_round,
    )


def shard_pack(tokens: torch.Tensor, lengths, rank: int, cp: int, balance: str = "document",
               dim: int = 0, **static) -> tuple[torch.Tensor, PackShard]:
    """This rank's tokens of a pack (``tokens`` indexed by pack position on ``dim``) and its
    record; ``static``: ``capacity`` and ``max_docs`` as ``make_shard`` takes them."""
    shard = make_shard(lengths, rank, cp, balance, device=tokens.device, **static)
    return tokens.index_select(dim, shard.local_index), shard


def _group(group):
    return group if group is not None else dist.group.WORLD


class _ToPackOrder(torch.autograd.Function):
    """The gathered rows in pack order. Its backward gathers the gradient back (a permutation, the
    padding rows zero) instead of index_select's index_add into a zero buffer: the dK/dV
    reaching the reduce-scatter are written once, by one kernel, no zero-filled accumulator."""

    @staticmethod
    def forward(ctx, gathered, pack_index, gather_index):
        ctx.save_for_backward(gather_index)
        return gathered.index_select(0, pack_index)

    @staticmethod
    def backward(ctx, grad):
        (gather_index,) = ctx.saved_tensors
        rows = grad.index_select(0, gather_index.clamp(min=0))
        keep = (gather_index >= 0).view(-1, *([1] * (grad.dim() - 1)))
        return torch.where(keep, rows, torch.zeros((), dtype=grad.dtype, device=grad.device)), None, None


def _gather_pack(x: torch.Tensor, shard: PackShard, group) -> torch.Tensor:
    """[T_local, ...] on every rank -> [T, ...] in pack order: one all-gather of the padded
    shares, one row gather (its backward: a row gather, then the gather's reduce-scatter)."""
    pad = shard.padded_tokens - x.shape[0]
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    return _ToPackOrder.apply(_all_gather(x, _group(group)), shard.pack_index, shard.gather_index)


def unshard_pack(x: torch.Tensor, shard: PackShard, group=None) -> torch.Tensor:
    """The inverse of ``shard_pack`` for outputs: every rank's ``[T_local, ...]`` as the whole
    pack ``[T, ...]`` in pack order (differentiable)."""
    return _gather_pack(x, shard, group)


def _pieces_sdpa(q, k, v, shard: PackShard, causal: bool, scale: float) -> torch.Tensor:
    """The portable kernel: each piece against its keys sliced out of the pack-ordered K/V."""
    outs, at = [], 0
    for p in shard.pieces:
        n = p.end - p.start
        keys = slice(p.doc_start, p.end if causal else p.doc_end)
        qs, ks, vs = (t.transpose(0, 1) for t in (q[at:at + n], k[keys], v[keys]))
        mask = None
        if causal:  # bottom-right: query x of the piece sees keys up to its own pack position
            n_k = ks.shape[1]
            mask = torch.ones(n, n_k, dtype=torch.bool, device=q.device).tril(n_k - n)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                   enable_gqa=gqa(ks.shape[0], qs.shape[0])).transpose(0, 1))
        at += n
    if at < q.shape[0]:  # a static shard's padding rows
        outs.append(q.new_zeros((q.shape[0] - at, q.shape[1], v.shape[2])))
    return torch.cat(outs) if outs else q.new_zeros(q.shape[:2] + v.shape[2:])


def _kernel(kernel: str, q: torch.Tensor, v: torch.Tensor) -> str:
    """``"auto"``: FA4 where it can run (CUDA, SM90+, half precision, its head dims: one call per
    round reading the gathered K/V in place), else the portable kernel."""
    if kernel not in ("auto", "fa4", "sdpa"):
        raise ValueError(f"kernel must be auto, fa4 or sdpa, got {kernel!r}")
    if kernel != "auto":
        return kernel
    from ..lowerings import fa4_attention

    return "sdpa" if fa4_attention.unavailable(q.device, q.dtype, q.shape[-1], v.shape[-1]) else "fa4"


def thd_allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shard: PackShard, *,
                            is_causal: bool = True, scale: float | None = None, group=None,
                            kernel: str = "auto", head_groups: int | None = None) -> torch.Tensor:
    """Attention of this rank's tokens ``q [T_local, Hq, D]`` over their documents, K and V
    (``[T_local, Hkv, D]``, this rank's) all-gathered in one collective. ``kernel``: ``"fa4"``
    (reads the gathered K/V in place: cu_seqlens_k at document starts, seqused_k), ``"sdpa"``
    (any device: each piece's keys sliced), ``"auto"`` (FA4 where it can run, see ``_kernel``).
    FA4 takes one call per round (at most two: a document's pieces on one rank are at most two
    stretches). ``head_groups=G``: G groups of heads one after the other, each with its own
    gather: the gathered K/V and the kernels' workspace (FA4's fp32 dK/dV accumulators span the
    gathered keys) of one group alive at a time, 1/G of the whole."""
    if head_groups not in (None, 1):
        hq, hkv = q.shape[1], k.shape[1]
        if hq % head_groups or hkv % head_groups:
            raise ValueError(f"head_groups={head_groups} must divide the query heads {hq} and the key/value heads {hkv}")
        step_q, step_kv = hq // head_groups, hkv // head_groups
        return torch.cat([
            thd_allgather_attention(q[:, i * step_q:(i + 1) * step_q], k[:, i * step_kv:(i + 1) * step_kv],
                                    v[:, i * step_kv:(i + 1) * step_kv], shard, is_causal=is_causal, scale=scale,
                                    group=group, kernel=kernel)
            for i in range(head_groups)], dim=1)
    kv = _gather_pack(torch.cat([k, v], dim=-1), shard, group)  # one collective for K and V
    k_pack, v_pack = kv.split([k.shape[-1], v.shape[-1]], dim=-1)
    return pack_attention(q, k_pack, v_pack, shard, is_causal=is_causal, scale=scale, kernel=kernel)


def pack_attention(q: torch.Tensor, k_pack: torch.Tensor, v_pack: torch.Tensor, shard: PackShard, *,
                   is_causal: bool = True, scale: float | None = None, kernel: str = "auto") -> torch.Tensor:
    """This rank's pieces ``q [T_local, Hq, D]`` against the whole pack's K/V in pack order
    (``[T, Hkv, D]``): the attention after the gather."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if _kernel(kernel, q, v_pack) == "fa4":
        from ..lowerings import fa4_attention  # noqa: F401 - registers the op

        outs = [torch.ops.cp_inductor.fa4_varlen_attention(
            q[r.row_start:r.row_end], k_pack, v_pack, r.cu_seqlens_q, r.cu_seqlens_k, r.seqused_k(is_causal),
            r.max_q, r.max_k, scale, is_causal)[0] for r in shard.rounds]
        if shard.row_round is not None:  # static: each call wrote its round's rows of all of them
            zero = torch.zeros((), dtype=q.dtype, device=q.device)
            return sum(torch.where((shard.row_round == i).view(-1, 1, 1), o, zero) for i, o in enumerate(outs))
        return torch.cat(outs) if outs else q.new_zeros(q.shape[:2] + v_pack.shape[2:])
    return _pieces_sdpa(q, k_pack, v_pack, shard, is_causal, scale)
