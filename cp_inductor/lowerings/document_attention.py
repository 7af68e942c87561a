"""Attention over packed documents given as a table of document ids: what a document mask
(``passes/dynamo/document_mask.py``) becomes.

    cu_seqlens, meta = document_plan(doc_ids, positions, check, B, T)
    out, lse = document_attention(q, k, v, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider)

``doc_ids`` is ``[B, T]`` (or ``[T]``): token ``t`` of row ``b`` belongs to document
``doc_ids[b, t]``; a document is a run of equal ids within a row, so the attention computed is
``same_doc(q, kv) [& kv <= q]`` exactly when every id occurs in one run per row (documents are
contiguous). ``q`` is ``[B, H_q, T, D]``, ``k`` and ``v`` ``[B, H_kv, T, D]`` as SDPA takes them
(``H_q % H_kv == 0``: GQA as is), ``out`` ``[B, H_q, T, D]`` over a ``[B, T, H_q, D]`` buffer.

The plan finds the runs on device (``cu_seqlens``: the run starts in a ``B*T + 1`` buffer
padded with ``B*T``; one Triton launch on the GPU, ``document_plan_kernel.py``) and brings its
numbers to the host once per graph, not per layer: the document count, the longest document, and
whether the ids are contiguous (checked on device when ``check``: ids that never fall within a
row are; otherwise runs per row against distinct ids per row, by a sort; skipped where the graph
proves it; with ``positions``, also that they rise within each document, where the mask is causal
over positions rather than tokens). The attention then runs the packed kernel ``provider`` names (``"fa4"``: FA4
varlen, ``"cudnn"``: cuDNN's ragged SDPA) over ``cu_seqlens[:count + 1]``, the ``[B*T, H, D]``
views of q, k, v (no copy where they are ``[B, T, H, D]`` underneath, as HF's are). Where the ids
turn out not to be contiguous, or a CUDA graph is being captured (the host cannot read the count
then), both ops compute the masked attention densely instead: slower, never a different answer.
``lse`` is ``[H_q, B*T]`` fp32 (zeros on the dense path, whose backward recomputes).

With ``capacity=N`` (``config.document_mask_capacity``) nothing goes to the host: the plan asserts
on device that the pack holds at most ``N`` documents in contiguous runs (a device error
otherwise, never a different answer) and the attention runs FA4 over ``cu_seqlens[:N + 1]``, the
trailing documents empty, forward and backward: a step CUDA graphs can capture.

Reading the numbers must not stall the GPU: a host read waits for everything queued before it,
and the GPU then idles while the host prepares FA4's launch (measured on an H200: 1.3-2.2 ms a
step, ``docs/passes/document_mask.md``). So only the first plan of a shape reads them at once;
later plans copy them to pinned memory without waiting (``_Guess``), and the first FA4 forward
that takes them launches at a capacity of documents learned from earlier calls
(``cu_seqlens[:capacity + 1]``: trailing documents empty; ``max_seqlen`` the row length: FA4
sizes its varlen grid from the tokens and the documents), then waits for the copy, the kernel
already queued, and keeps its result only where the numbers prove it exact (contiguous, at most
``capacity`` documents); otherwise it computes again from them: a wasted kernel, never a
different answer. Later layers and the backward read the numbers, by then on the host. (Code
that reads a plan's ``meta`` itself calls ``_settle(meta)`` first.)

``document_shard_plan`` / ``document_shard_attention`` (below): a shard of the queries over every
key, at positions a CP BlockMask computes (torch's flex CP).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable

import torch

from . import fa4_attention, varlen_attention  # noqa: F401 - define the packed ops we call

PROVIDERS = ("fa4", "cudnn")

_lib = torch.library.Library("cp_inductor", "FRAGMENT")
_lib.define("document_plan(Tensor doc_ids, Tensor? positions, bool check, SymInt rows, SymInt tokens, "
            "int capacity=0, int bounds=0, bool stepping=False) -> (Tensor, Tensor)")
_lib.define(
    "document_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, Tensor meta, Tensor doc_ids, "
    "Tensor? positions, float scale, bool is_causal, str provider, int window_left=-1, int capacity=0, int bounds=0) "
    "-> (Tensor, Tensor)"
)
_lib.define(
    "document_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor cu_seqlens, Tensor meta, Tensor doc_ids, Tensor? positions, float scale, bool is_causal, str provider, "
    "int window_left=-1, int capacity=0, int bounds=0) -> (Tensor, Tensor, Tensor)"
)

_COUNT, _LONGEST, _CONTIGUOUS, _UNSURE = range(4)  # meta; unsure: ids checked that fall (the sort decides)
# What ``doc_ids`` holds (``bounds``): document ids, or each token's document's first token (a
# mask ``kv <= q & doc_ids[q] <= kv``), or its last (``kv <= q & q <= doc_ids[kv]``). A table
# of bounds is a table of ids where each token's value is its run's first (last) index: the plan
# checks that, and the dense path computes the mask as the bounds write it.
BOUNDS = {"": 0, "start": 1, "end": 2}


def _rows(table: torch.Tensor, rows: int, tokens: int) -> torch.Tensor:
    """A table of ids or positions as ``[rows, tokens]``: the program reads ``table[b, t]`` (or
    ``table[t]``: one row for all) for ``t < tokens``."""
    table = table.reshape(1, -1) if table.dim() == 1 else table
    return table[:, :tokens].expand(rows, tokens)


@torch.library.register_fake("cp_inductor::document_plan", lib=_lib)
def _(doc_ids, positions, check, rows, tokens, capacity=0, bounds=0, stepping=False):
    meta_device = doc_ids.device if capacity else "cpu"  # a capacity: nothing for the host to read
    return doc_ids.new_empty(rows * tokens + 1, dtype=torch.int32), torch.empty(4, dtype=torch.int64, device=meta_device)


def _runs(rows: torch.Tensor, check: bool):
    """The documents of ``rows`` ``[B, T]`` as runs of equal ids, on device: where each token's
    run starts (``[B, T]`` bool), each token's run (flat), ``cu_seqlens`` (``B*T + 1``: run
    starts, padded with ``B*T``), the longest run, and whether each id occurs in one run per row
    (checked when ``check``)."""
    tokens = rows.numel()
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    rank = torch.cumsum(starts.reshape(-1), 0) - 1
    cu_seqlens = _first_rows(starts.reshape(-1), rank, tokens)
    longest = (cu_seqlens[1:] - cu_seqlens[:-1]).max()
    contiguous = _one_run_per_id(rows, starts) if check else torch.ones((), dtype=torch.bool, device=rows.device)
    return starts, rank, cu_seqlens, longest, contiguous


def _one_run_per_id(rows: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Whether every id of each row of ``rows`` occurs in one run: runs per row against distinct
    ids per row (a sort), on device."""
    if starts is None:
        starts = torch.ones_like(rows, dtype=torch.bool)
        starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    ordered = rows.sort(dim=1).values
    distinct = (ordered[:, 1:] != ordered[:, :-1]).sum(1) + 1
    return (starts.sum(1) == distinct).all()


def _first_rows(starts: torch.Tensor, rank: torch.Tensor, size: int) -> torch.Tensor:
    """``[size + 1]`` int32: the row where each run starts (``rank``: each row's run), padded
    with ``size``: no host sync (a scatter of the run starts to their rank)."""
    slot = torch.where(starts, rank, size + 1)  # run starts to their rank, the rest to a spare slot
    buffer = torch.full((size + 2,), size, dtype=torch.int32, device=starts.device)
    buffer.scatter_(0, slot, torch.arange(size, dtype=torch.int32, device=starts.device))
    return buffer[: size + 1]


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@torch.library.impl("cp_inductor::document_plan", "CompositeExplicitAutograd", lib=_lib)
def _plan(doc_ids, positions, check, batch, length, capacity=0, bounds=0, stepping=False):
    rows = _rows(doc_ids, batch, length)
    table = None if positions is None else _rows(positions, batch, length)
    def launch():
        from .document_plan_kernel import document_plan as plan_kernel

        return plan_kernel(rows, table, check, bounds)

    # (the kernel checks positions that rise; ``stepping``, a window over them, is the aten form's)
    launched = _try_kernel("document_plan", launch) if rows.is_cuda and not stepping else None
    if launched is not None:  # one launch (document_plan_kernel.py says why)
        cu_seqlens, meta = launched
    else:
        starts, rank, cu_seqlens, longest, contiguous = _runs(rows, check)
        if table is not None:  # causal over positions is causal over tokens where they rise within each document
            # (a window over them is one over tokens where they step by one)
            step = (table[:, 1:] == table[:, :-1] + 1) if stepping else (table[:, 1:] > table[:, :-1])
            contiguous = contiguous & (step | starts[:, 1:]).all()
        if bounds:
            contiguous = contiguous & _bounds_hold(rows, starts, bounds)
        meta = torch.stack([rank[-1] + 1, longest.to(rank.dtype), contiguous.to(rank.dtype), torch.zeros_like(rank[-1])])
    if capacity:
        return cu_seqlens, _within_capacity(meta, rows, check, capacity)
    if _capturing(rows):
        return cu_seqlens, torch.zeros(4, dtype=torch.int64)  # not contiguous as far as we know: dense path
    return cu_seqlens, _to_host(meta, _documents_key(rows.device, rows.numel()), _learn_documents)


def _bounds_hold(rows: torch.Tensor, starts: torch.Tensor, bounds: int) -> torch.Tensor:
    """Whether each run of ``rows`` holds its first index (``bounds`` 1) or its last (2)."""
    index = torch.arange(rows.shape[1], device=rows.device)
    if bounds == BOUNDS["start"]:
        return torch.where(starts, rows == index, True).all()
    ends = torch.ones_like(starts)
    ends[:, :-1] = starts[:, 1:]
    return torch.where(ends, rows == index, True).all()


_KERNELS_FAILED: set[str] = set()


def _try_kernel(name: str, launch: Callable):
    """``launch()``: a plan's Triton kernel, or None where it does not compile on this machine's
    Triton (a version it was not written for): the aten form runs then, after one warning, never
    a crash."""
    if name in _KERNELS_FAILED:
        return None
    from triton.compiler.errors import CompilationError

    try:
        return launch()
    except CompilationError as error:
        _KERNELS_FAILED.add(name)
        warnings.warn(f"cp_inductor: the {name} Triton kernel did not compile here, its aten form runs instead "
                      f"({str(error).strip()[:200]})", stacklevel=2)
        return None


def _within_capacity(meta: torch.Tensor, rows: torch.Tensor, check: bool, capacity: int) -> torch.Tensor:
    """``meta`` on device, asserted there to describe contiguous documents, at most ``capacity``
    of them: the attention then runs over ``capacity`` documents without reading a number on the
    host (CUDA-graph safe; ``config.document_mask_capacity``). A pack past it is a device error,
    never a different answer."""
    contiguous = meta[_CONTIGUOUS] != 0
    if check and rows.is_cuda:  # ids that fall somewhere (the kernel's "unsure"): the sort decides, on device
        contiguous = contiguous | ((meta[_UNSURE] != 0) & _one_run_per_id(rows))
    torch._assert_async(contiguous & (meta[_COUNT] <= capacity),
                        "document_mask_capacity: this pack has more documents than the capacity, or documents "
                        "the packed kernels cannot compute (ids not in contiguous runs, positions not rising in them)")
    return meta


def _resolve(meta, doc_ids, batch: int, tokens: int) -> None:
    """Decide contiguity with the sort where the plan's kernel could not (checked ids that fall
    somewhere; its positions rise): rare, and a host read of its own."""
    if int(meta[_UNSURE]):
        meta[_CONTIGUOUS] = int(_runs(_rows(doc_ids, batch, tokens), True)[4])
        meta[_UNSURE] = 0


def _documents_key(device, tokens: int) -> tuple:
    return ("documents", str(device), tokens)


# --- the plan's numbers on the host without a stall (the module docstring says why) -------------

_LEARNED: dict[tuple, tuple] = {}  # a plan's key -> what a speculative launch covers (None: don't)


@dataclasses.dataclass
class _Guess:
    """A plan whose numbers are on their way to the host, and what to launch meanwhile."""
    key: tuple
    covers: tuple | None  # (documents,) or (segments, rounds); None: read the numbers first
    learn: Callable  # (key, meta, covers) -> covers, after the numbers are read
    copied: torch.cuda.Event | None  # None on the CPU, where they are there already

    def wait(self, meta: torch.Tensor) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        _LEARNED[self.key] = self.learn(self.key, meta, _LEARNED.get(self.key))


_GUESSES: dict[int, _Guess] = {}  # by the host meta's address; taken by the first op that reads it


def _room(count: int, before: int, most: int) -> int:
    """Room for a quarter more than ``count``, in powers of two (a launch covers empty documents
    at about one idle tile per head each), at least what was there, never more than ``most``."""
    room = 16
    while room < count + count // 4:
        room *= 2
    return min(max(room, before), most)


def _to_host(meta: torch.Tensor, key: tuple, learn) -> torch.Tensor:
    """``meta`` on the host: read at once for a key's first plan, else copied without waiting (a
    ``_Guess`` the first reader settles)."""
    from .. import config

    if key not in _LEARNED or not config.document_mask_speculate:
        host = meta.cpu()
        _LEARNED[key] = learn(key, host, None)
        return host
    copied = None
    if meta.is_cuda:
        host = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True)
        host.copy_(meta, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    else:
        host = meta
    if len(_GUESSES) > 64:  # plans whose attention never ran (an exception in between): forget them
        _GUESSES.clear()
    _GUESSES[host.data_ptr()] = _Guess(key, _LEARNED[key], learn, copied)
    return host


def _capture_underway() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _guess(meta: torch.Tensor, key: tuple) -> tuple | None:
    """What to launch before ``meta`` is read, if anything (never under CUDA-graph capture, whose
    plan is read as dense and copied nothing: an entry at its address would be another's)."""
    guess = _GUESSES.get(meta.data_ptr())
    if guess is None or guess.key != key or _capture_underway():
        return None
    return guess.covers


def _settle(meta: torch.Tensor) -> None:
    """Make ``meta`` readable."""
    guess = _GUESSES.pop(meta.data_ptr(), None)
    if guess is not None and not _capture_underway():
        guess.wait(meta)


def _learn_documents(key: tuple, meta: torch.Tensor, covers: tuple | None) -> tuple | None:
    """Documents to cover (at most the tokens, ``key[-1]``); none after ids that were not
    contiguous (the next launch would likely be wasted)."""
    if not _packed(meta):
        return None
    return (_room(int(meta[_COUNT]), covers[0] if covers else 0, key[-1]),)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [B*T, H, D] (a view where t is [B, T, H, D] underneath)."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] over a [B, T, H, D] buffer: the layout the fake kernels promise."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _unflat(t: torch.Tensor, batch: int) -> torch.Tensor:
    """[B*T, H, D] -> [B, H, T, D] over a [B, T, H, D] buffer, the layout the fakes promise (a copy
    only where a kernel returned another layout: compiled code checks the strides)."""
    return t.reshape(batch, -1, t.shape[1], t.shape[2]).contiguous().transpose(1, 2)


def _packed(meta: torch.Tensor) -> bool:
    return bool(meta[_CONTIGUOUS])


def _dense_mask(doc_ids, positions, q, is_causal, window_left=-1, bounds=0):
    rows = _rows(doc_ids, q.shape[0], q.shape[2])
    index = torch.arange(rows.shape[1], device=rows.device)
    if bounds:  # the mask as the program wrote it (causal, the table a bound)
        mask = index[None, :] <= index[:, None]
        if bounds == BOUNDS["start"]:
            return mask & (index[None, None, None, :] >= rows[:, None, :, None])
        return mask & (index[None, None, :, None] <= rows[:, None, None, :])
    mask = rows[:, None, :, None] == rows[:, None, None, :]
    if is_causal and positions is not None:
        p = _rows(positions, q.shape[0], q.shape[2])
        mask = mask & (p[:, None, None, :] <= p[:, None, :, None])
    elif is_causal:
        mask = mask & (index[None, :] <= index[:, None])
    if window_left >= 0 and positions is not None:  # the window as the program reads it: over the positions
        p = _rows(positions, q.shape[0], q.shape[2])
        mask = mask & (p[:, None, None, :] >= p[:, None, :, None] - window_left)
    elif window_left >= 0:
        mask = mask & (index[None, :] >= index[:, None] - window_left)
    return mask


def _dense(q, k, v, doc_ids, positions, scale, is_causal, window_left=-1, bounds=0):
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    mask = _dense_mask(doc_ids, positions, q, is_causal, window_left, bounds)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _lengths(cu_seqlens, meta):
    count = int(meta[_COUNT])
    return cu_seqlens[: count + 1], int(meta[_LONGEST])


@torch.library.register_fake("cp_inductor::document_attention", lib=_lib)
def _(q, k, v, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider, window_left=-1, capacity=0, bounds=0):
    batch, heads, tokens = q.shape[0], q.shape[1], q.shape[2]
    out = q.new_empty((batch, tokens, heads, v.shape[3])).transpose(1, 2)
    return out, q.new_empty((heads, batch * tokens), dtype=torch.float32)


def _fa4_packed(q, k, v, cu, longest, scale, is_causal, window_left):
    out, lse = torch.ops.cp_inductor.fa4_varlen_attention(_flat(q), _flat(k), _flat(v), cu, cu, None, longest, longest,
                                                          scale, is_causal, window_left)
    return _unflat(out, q.shape[0]), lse


@torch.library.impl("cp_inductor::document_attention", "CompositeExplicitAutograd", lib=_lib)
def _forward(q, k, v, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider, window_left=-1, capacity=0,
             bounds=0):
    batch, heads, tokens = q.shape[0], q.shape[1], q.shape[2]
    if capacity:  # the plan asserted on device that the documents fit (trailing ones empty)
        return _fa4_packed(q, k, v, cu_seqlens[: capacity + 1], tokens, scale, is_causal, window_left)
    covers = _guess(meta, _documents_key(q.device, batch * tokens))
    if covers is not None and provider == "fa4":  # launch first, read the numbers after
        speculative = _fa4_packed(q, k, v, cu_seqlens[: covers[0] + 1], tokens, scale, is_causal, window_left)
        _settle(meta)
        if _packed(meta) and int(meta[_COUNT]) <= covers[0]:
            return speculative
    _settle(meta)
    _resolve(meta, doc_ids, batch, tokens)
    if not _packed(meta):
        out = _bshd(_dense(q, k, v, doc_ids, positions, scale, is_causal, window_left, bounds))
        return out, q.new_zeros((heads, batch * tokens), dtype=torch.float32)
    cu, longest = _lengths(cu_seqlens, meta)
    if provider == "fa4":
        return _fa4_packed(q, k, v, cu, longest, scale, is_causal, window_left)
    else:
        qt, kt, vt = _flat(q), _flat(k), _flat(v)
        assert window_left < 0, "cuDNN's ragged SDPA is not given a window (document_mask offers FA4 only)"
        out, lse = torch.ops.cp_inductor.varlen_attention(qt, kt, vt, cu, cu, longest, longest, scale, is_causal)
        # cuDNN's lse is [tokens, heads]; the op promises a dense [heads, tokens] (compiled code
        # checks the strides of what a custom op returns)
        return _unflat(out, batch), lse.t().contiguous()


@torch.library.register_fake("cp_inductor::document_attention_backward", lib=_lib)
def _(grad_out, q, k, v, out, lse, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider, window_left=-1,
      capacity=0, bounds=0):
    return tuple(t.new_empty((t.shape[0], t.shape[2], t.shape[1], t.shape[3])).transpose(1, 2) for t in (q, k, v))


@torch.library.impl("cp_inductor::document_attention_backward", "CompositeExplicitAutograd", lib=_lib)
def _backward(grad_out, q, k, v, out, lse, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider,
              window_left=-1, capacity=0, bounds=0):
    batch = q.shape[0]
    if capacity:
        cu, longest = cu_seqlens[: capacity + 1], q.shape[2]
    else:
        _settle(meta)
        _resolve(meta, doc_ids, batch, q.shape[2])
        cu, longest = _lengths(cu_seqlens, meta) if _packed(meta) else (None, 0)
    if cu is None:
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            dense = _dense(*inputs, doc_ids, positions, scale, is_causal, window_left, bounds)
            grads = torch.autograd.grad(dense, inputs, grad_out)
        return tuple(_bshd(g) for g in grads)
    qt, kt, vt, ot, dot = (_flat(t) for t in (q, k, v, out, grad_out))
    if provider == "fa4":
        grads = torch.ops.cp_inductor.fa4_varlen_attention_backward(
            dot, None, qt, kt, vt, ot, lse, cu, cu, None, longest, longest, scale, is_causal, window_left)
    else:
        assert window_left < 0, "cuDNN's ragged SDPA is not given a window (document_mask offers FA4 only)"
        grads = torch.ops.cp_inductor.varlen_attention_backward(
            dot, qt, kt, vt, ot, lse.t().contiguous(), cu, cu, longest, longest, scale, is_causal)
    return tuple(_unflat(g, batch) for g in grads)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, meta, doc_ids, positions, scale, is_causal, provider, *window = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens, meta, doc_ids, positions)
    ctx.args = (scale, is_causal, provider, *window)
    ctx.count = len(inputs)


def _autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens, meta, doc_ids, positions = ctx.saved_tensors
    dq, dk, dv = torch.ops.cp_inductor.document_attention_backward(
        grad_out, q, k, v, out, lse, cu_seqlens, meta, doc_ids, positions, *ctx.args)
    return (dq, dk, dv) + (None,) * (ctx.count - 3)


torch.library.register_autograd("cp_inductor::document_attention", _autograd_backward, setup_context=_setup, lib=_lib)


# --- a shard of the queries over every key: torch's flex CP (K/V all-gathered) ------------------
#
#     plan, meta = document_shard_plan(doc_ids, query_positions, key_positions, check, is_causal, B, Tq, Tkv)
#     out, lse = document_shard_attention(q, k, v, *plan, meta, doc_ids, query_positions, key_positions, scale, is_causal,
#                                         window_left)
#
# ``q`` is ``[B, H_q, T_q, D]``: this rank's queries, query ``i`` of row ``b`` at pack position
# ``query_positions[b, i]``; ``k``, ``v`` are ``[B, H_kv, T_kv, D]``, every key of the pack, key
# ``j`` at ``key_positions[b, j]`` (None: the index itself; both tables ``[B or 1, n]``). The
# attention computed is ``same_doc(P(q), P(kv)) [& P(kv) <= P(q)] [& P(kv) >= P(q) - window_left]``
# over ``doc_ids[b, position]``.
# The plan cuts the local queries into segments (consecutive pack positions of one document:
# head-tail and PTRR shards are a few runs of them), each read against its document's keys (the
# prefix up to its last query when causal: bottom-right) in the pack-ordered K/V, in place
# (``cu_seqlens_k`` at the document's start, ``seqused_k`` the keys it reads). Segments of one
# document read the same keys: they go to different calls (rounds: the i-th segment of each
# document in round i), so that no call's backward writes a key row's dK/dV twice; in a round's
# call the other rounds' segments read no key and their rows are taken from their own call.
# ``meta`` (host): segments, rounds, longest segment, longest document, packable; not packable
# (ids not contiguous, key positions not a permutation of the keys, query positions out of range,
# a CUDA graph being captured): the masked attention computed densely, as the document ops do.

_lib.define(
    "document_shard_plan(Tensor doc_ids, Tensor? query_positions, Tensor? key_positions, bool check, bool is_causal, "
    "SymInt rows, SymInt queries, SymInt keys, int bounds=0) -> (Tensor[], Tensor)"
)
_lib.define(
    "document_shard_attention(Tensor q, Tensor k, Tensor v, Tensor[] plan, Tensor meta, Tensor doc_ids, "
    "Tensor? query_positions, Tensor? key_positions, float scale, bool is_causal, *, int window_left=-1) -> (Tensor, Tensor)"
)
_lib.define(
    "document_shard_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    "Tensor[] plan, Tensor meta, Tensor doc_ids, Tensor? query_positions, Tensor? key_positions, float scale, "
    "bool is_causal, int window_left=-1) -> (Tensor, Tensor, Tensor)"
)

# redo: the kernel's plan needs the aten one; bounds: what the ids are (BOUNDS; the attention's
# dense path reads it here, an argument would not survive its autograd's tensor-list checks)
_SEGMENTS, _ROUNDS, _LONGEST_Q, _LONGEST_K, _PACKABLE, _REDO, _BOUND = range(7)
_SHARD_META = 7


def _positions(table, rows: int, n: int, device) -> torch.Tensor:
    """``[rows, n]`` int64 positions (the index itself where there is no table)."""
    if table is None:
        return torch.arange(n, device=device).expand(rows, n)
    return _rows(table, rows, n).long()


def _shard_plan_shapes(doc_ids, rows, queries, keys):
    q, k = rows * queries, rows * keys
    new = doc_ids.new_empty
    return [new(q + 1, dtype=torch.int32), new(q + 1, dtype=torch.int32), new(q, dtype=torch.int32),
            new(q, dtype=torch.int32), new(q, dtype=torch.int32), new(k, dtype=torch.int64), new(k, dtype=torch.int64)]


@torch.library.register_fake("cp_inductor::document_shard_plan", lib=_lib)
def _(doc_ids, query_positions, key_positions, check, is_causal, rows, queries, keys, bounds=0):
    return _shard_plan_shapes(doc_ids, rows, queries, keys), torch.empty(_SHARD_META, dtype=torch.int64, device="cpu")


@torch.library.impl("cp_inductor::document_shard_plan", "CompositeExplicitAutograd", lib=_lib)
def _shard_plan(doc_ids, query_positions, key_positions, check, is_causal, batch, queries, keys, bounds=0):
    ids = _rows(doc_ids, batch, keys)
    qpos = None if query_positions is None else _rows(query_positions, batch, queries)
    kpos = None if key_positions is None else _rows(key_positions, batch, keys)
    def launch():
        from .document_shard_plan_kernel import document_shard_plan as plan_kernel

        return plan_kernel(ids, qpos, kpos, check, is_causal, queries, bounds)

    launched = _try_kernel("document_shard_plan", launch) if ids.is_cuda else None
    if launched is not None:  # one launch (document_shard_plan_kernel.py says why)
        plan, meta = launched
    else:
        plan, meta = _shard_plan_aten(ids, query_positions, key_positions, check, is_causal, batch, queries, keys, bounds)
    if _capturing(ids):  # the dense path, over the bounds where the ids are bounds
        return plan, torch.tensor([0] * _BOUND + [bounds], dtype=torch.int64)
    return plan, _to_host(meta, _shard_key(ids.device, batch, queries, keys), _learn_shard)


def _shard_plan_aten(ids, query_positions, key_positions, check, is_causal, batch, queries, keys, bounds=0):
    """The plan in aten ops (the CPU's, and the GPU's where its kernel asks for a redo)."""
    device, pack = ids.device, batch * keys
    starts, run_of, cu_docs, longest_doc, packable = _runs(ids, check)
    if bounds:
        packable = packable & _bounds_hold(ids, starts, bounds)
    qpos = _positions(query_positions, batch, queries, device)
    packable = packable & ((qpos >= 0) & (qpos < keys)).all()
    at = (qpos.clamp(0, keys - 1) + torch.arange(batch, device=device)[:, None] * keys).reshape(-1)  # pack positions
    n = at.numel()
    run = run_of[at]
    new = torch.ones(n, dtype=torch.bool, device=device)
    new[1:] = (run[1:] != run[:-1]) | (at[1:] != at[:-1] + 1)
    segment = torch.cumsum(new, 0) - 1
    cu_q = _first_rows(new, segment, n)
    count = segment[-1] + 1
    real = torch.arange(n, device=device) < count
    seg_run = torch.zeros(n + 2, dtype=run.dtype, device=device).scatter_(0, torch.where(new, segment, n + 1), run)[:n]
    doc_start = cu_docs[seg_run].long()
    last = at[(cu_q[1:].long() - 1).clamp(min=0)]
    used = (last + 1 - doc_start) if is_causal else (cu_docs[seg_run + 1].long() - doc_start)
    used = torch.where(real, used, 0).to(torch.int32)
    cu_k = torch.where(real, doc_start, pack).to(torch.int32)
    cu_k = torch.cat([cu_k, cu_k.new_full((1,), pack)])
    # A segment's round: how many segments of its document come before it (a stable sort by
    # document, each one's rank in its group), so that rounds are as few as a rank's most
    # segments of one document.
    index = torch.arange(n, device=device)
    by_doc = torch.where(real, seg_run.long(), pack)
    order = torch.sort(by_doc, stable=True).indices
    grouped = by_doc[order]
    group_start = torch.ones(n, dtype=torch.bool, device=device)
    group_start[1:] = grouped[1:] != grouped[:-1]
    rank_in_group = index - torch.cummax(torch.where(group_start, index, 0), 0).values
    seg_round = torch.empty(n, dtype=torch.int64, device=device).scatter_(0, order, rank_in_group)
    seg_round = torch.where(real, seg_round, -1).to(torch.int32)
    row_round = seg_round[segment]
    if key_positions is not None:  # gathered row j holds pack position key_rows[j]; key_order inverts it
        kpos = _positions(key_positions, batch, keys, device)
        packable = packable & ((kpos >= 0) & (kpos < keys)).all()
        key_rows = (kpos.clamp(0, keys - 1) + torch.arange(batch, device=device)[:, None] * keys).reshape(-1)
        hits = torch.zeros(pack, dtype=torch.int64, device=device).scatter_add_(0, key_rows, torch.ones_like(key_rows))
        packable = packable & (hits == 1).all()
        key_order = torch.empty(pack, dtype=torch.int64, device=device).scatter_(0, key_rows, torch.arange(pack, device=device))
    else:
        key_rows, key_order = (torch.empty(pack, dtype=torch.int64, device=device) for _ in range(2))
    plan = [cu_q, cu_k, used, seg_round, row_round, key_order, key_rows]
    longest_q = (cu_q[1:] - cu_q[:-1]).max().long()
    meta = torch.stack([count, seg_round.max().long() + 1, longest_q, longest_doc.long(), packable.long(),
                        torch.zeros_like(count), torch.full_like(count, bounds)])
    return plan, meta




def _shard_key(device, rows: int, queries: int, keys: int) -> tuple:
    return ("shard", str(device), rows, queries, keys, rows * queries)


def _learn_shard(key: tuple, meta: torch.Tensor, covers: tuple | None) -> tuple | None:
    """Segments (at most the queries, ``key[-1]``) and rounds to cover."""
    if int(meta[_REDO]) or not bool(meta[_PACKABLE]):
        return None
    before = covers or (0, 0)
    return _room(int(meta[_SEGMENTS]), before[0], key[-1]), max(int(meta[_ROUNDS]), before[1])


def _settled_shard_plan(plan, meta, doc_ids, query_positions, key_positions, is_causal, batch, queries, keys):
    """The plan and its numbers on the host, the aten plan's where the kernel asked for a redo
    (document_shard_plan_kernel.py: rounds it cannot number without a sort; checked ids that
    fall), made once per plan: the layers and the backward reading one plan's ``meta`` share it.
    (The op is not told whether the ids are proven: the redo checks them, which is exact.)"""
    _settle(meta)
    if not int(meta[_REDO]):
        return plan, meta
    done = _REDONE.get(id(meta))
    if done is None or done[0]() is not meta:
        if len(_REDONE) > 64:  # plans no op reads any more
            _REDONE.clear()
        redone, redone_meta = _shard_plan_aten(_rows(doc_ids, batch, keys), query_positions, key_positions, True,
                                               is_causal, batch, queries, keys, int(meta[_BOUND]))
        done = _REDONE[id(meta)] = (weakref.ref(meta), redone, redone_meta.cpu())
    return done[1], done[2]


_REDONE: dict[int, tuple] = {}  # id of a plan's host meta -> (a reference to it, the aten plan, its meta)


def _shard_numbers(meta) -> tuple[int, int, int, int]:
    """Segments, rounds, longest segment, longest document."""
    return int(meta[_SEGMENTS]), int(meta[_ROUNDS]), int(meta[_LONGEST_Q]), int(meta[_LONGEST_K])


def _shard_mask(doc_ids, query_positions, key_positions, q, k, is_causal, bounds=0, window_left=-1):
    """The mask as the program reads it: the whole table at the positions (no clamp: a position
    past the table fails here as in the program); a window over the places in the row."""
    batch, keys = q.shape[0], k.shape[2]
    table = doc_ids.reshape(1, -1) if doc_ids.dim() == 1 else doc_ids
    ids = table.expand(batch, table.shape[1])
    qpos = _positions(query_positions, batch, q.shape[2], q.device)
    kpos = _positions(key_positions, batch, keys, q.device)
    if bounds == BOUNDS["start"]:  # keys from the table's value at the query's place (causal)
        mask = kpos[:, None, None, :] >= ids.gather(1, qpos)[:, None, :, None]
    elif bounds == BOUNDS["end"]:  # queries up to the table's value at the key's place
        mask = qpos[:, None, :, None] <= ids.gather(1, kpos)[:, None, None, :]
    else:
        mask = ids.gather(1, qpos)[:, None, :, None] == ids.gather(1, kpos)[:, None, None, :]
    if is_causal:
        mask = mask & (kpos[:, None, None, :] <= qpos[:, None, :, None])
    if window_left >= 0:
        mask = mask & (kpos[:, None, None, :] >= qpos[:, None, :, None] - window_left)
    return mask


def _shard_dense(q, k, v, doc_ids, query_positions, key_positions, scale, is_causal, bounds=0, window_left=-1):
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    mask = _shard_mask(doc_ids, query_positions, key_positions, q, k, is_causal, bounds, window_left)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _pack_keys(t: torch.Tensor, key_order: torch.Tensor, mapped: bool) -> torch.Tensor:
    flat = _flat(t)
    return flat.index_select(0, key_order) if mapped else flat


def _rounds(plan, numbers):
    """Per round: (its segments' seqused_k, its rows) over the segments in use (segments past
    the real ones read no key; a round past the real ones has no rows)."""
    used, seg_round, row_round = plan[2:5]
    count, rounds = numbers[:2]
    for r in range(rounds):
        yield torch.where(seg_round[:count] == r, used[:count], 0), row_round == r


def _segments(plan, numbers):
    count, _, longest_q, longest_k = numbers
    return plan[0][: count + 1], plan[1][: count + 1], longest_q, longest_k


def _shard_packed(q, k, v, plan, numbers, key_positions, scale, is_causal, window_left=-1):
    """Each segment of queries over its document's keys up to its last query (FA4's causal
    alignment puts that query on that key, so a window counts back from each query's place)."""
    cu_q, cu_k, longest_q, longest_k = _segments(plan, numbers)
    mapped = key_positions is not None
    qt, kt, vt = _flat(q), _pack_keys(k, plan[5], mapped), _pack_keys(v, plan[5], mapped)
    out = lse = None
    for used, mine in _rounds(plan, numbers):
        o, l = torch.ops.cp_inductor.fa4_varlen_attention(qt, kt, vt, cu_q, cu_k, used, longest_q, longest_k, scale, is_causal,
                                                          window_left)
        out = o if out is None else torch.where(mine[:, None, None], o, out)
        lse = l if lse is None else torch.where(mine[None, :], l, lse)
    return _unflat(out, q.shape[0]), lse


@torch.library.register_fake("cp_inductor::document_shard_attention", lib=_lib)
def _(q, k, v, plan, meta, doc_ids, query_positions, key_positions, scale, is_causal, window_left=-1):
    batch, heads, tokens = q.shape[0], q.shape[1], q.shape[2]
    out = q.new_empty((batch, tokens, heads, v.shape[3])).transpose(1, 2)
    return out, q.new_empty((heads, batch * tokens), dtype=torch.float32)


@torch.library.impl("cp_inductor::document_shard_attention", "CompositeExplicitAutograd", lib=_lib)
def _shard_forward(q, k, v, plan, meta, doc_ids, query_positions, key_positions, scale, is_causal, window_left=-1):
    batch, heads, tokens = q.shape[0], q.shape[1], q.shape[2]
    covers = _guess(meta, _shard_key(q.device, batch, tokens, k.shape[2]))
    if covers is not None:  # launch first, read the numbers after (module docstring)
        segments, rounds = covers
        speculative = _shard_packed(q, k, v, plan, (segments, rounds, tokens, k.shape[2]), key_positions, scale, is_causal,
                                    window_left)
        _settle(meta)
        if (not int(meta[_REDO]) and bool(meta[_PACKABLE]) and int(meta[_SEGMENTS]) <= segments
                and int(meta[_ROUNDS]) <= rounds):
            return speculative
    plan, meta = _settled_shard_plan(plan, meta, doc_ids, query_positions, key_positions, is_causal, batch, tokens,
                                     k.shape[2])
    if not bool(meta[_PACKABLE]):
        bounds = int(meta[_BOUND])
        out = _bshd(_shard_dense(q, k, v, doc_ids, query_positions, key_positions, scale, is_causal, bounds, window_left))
        return out, q.new_zeros((heads, batch * tokens), dtype=torch.float32)
    return _shard_packed(q, k, v, plan, _shard_numbers(meta), key_positions, scale, is_causal, window_left)


@torch.library.register_fake("cp_inductor::document_shard_attention_backward", lib=_lib)
def _(grad_out, q, k, v, out, lse, plan, meta, doc_ids, query_positions, key_positions, scale, is_causal, window_left=-1):
    return tuple(t.new_empty((t.shape[0], t.shape[2], t.shape[1], t.shape[3])).transpose(1, 2) for t in (q, k, v))


@torch.library.impl("cp_inductor::document_shard_attention_backward", "CompositeExplicitAutograd", lib=_lib)
def _shard_backward(grad_out, q, k, v, out, lse, plan, meta, doc_ids, query_positions, key_positions, scale, is_causal,
                    window_left=-1):
    batch = q.shape[0]
    plan, meta = _settled_shard_plan(plan, meta, doc_ids, query_positions, key_positions, is_causal, batch, q.shape[2],
                                     k.shape[2])
    bounds = int(meta[_BOUND])
    if not bool(meta[_PACKABLE]):
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            dense = _shard_dense(*inputs, doc_ids, query_positions, key_positions, scale, is_causal, bounds, window_left)
            grads = torch.autograd.grad(dense, inputs, grad_out)
        return tuple(_bshd(g) for g in grads)
    numbers = _shard_numbers(meta)
    cu_q, cu_k, longest_q, longest_k = _segments(plan, numbers)
    mapped = key_positions is not None
    qt, ot, dot = _flat(q), _flat(out), _flat(grad_out)
    kt, vt = _pack_keys(k, plan[5], mapped), _pack_keys(v, plan[5], mapped)
    dq = dk = dv = None
    for used, mine in _rounds(plan, numbers):
        gq, gk, gv = torch.ops.cp_inductor.fa4_varlen_attention_backward(
            dot, None, qt, kt, vt, ot, lse, cu_q, cu_k, used, longest_q, longest_k, scale, is_causal, window_left)
        dq = gq if dq is None else torch.where(mine[:, None, None], gq, dq)
        dk, dv = (gk, gv) if dk is None else (dk + gk, dv + gv)
    if mapped:  # back from pack order to the gathered rows
        dk, dv = dk.index_select(0, plan[6]), dv.index_select(0, plan[6])
    return _unflat(dq, batch), _unflat(dk, batch), _unflat(dv, batch)


def _shard_setup(ctx, inputs, keyword_only_inputs, output):
    q, k, v, plan, meta, doc_ids, query_positions, key_positions, scale, is_causal = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], meta, doc_ids, query_positions, key_positions, *plan)
    ctx.args = (scale, is_causal, keyword_only_inputs.get("window_left", -1))


def _shard_autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, meta, doc_ids, query_positions, key_positions, *plan = ctx.saved_tensors
    dq, dk, dv = torch.ops.cp_inductor.document_shard_attention_backward(
        grad_out, q, k, v, out, lse, plan, meta, doc_ids, query_positions, key_positions, *ctx.args)
    return dq, dk, dv, [None] * len(plan), None, None, None, None, None, None  # the window is keyword-only: no gradient


torch.library.register_autograd("cp_inductor::document_shard_attention", _shard_autograd_backward,
                                setup_context=_shard_setup, lib=_lib)
