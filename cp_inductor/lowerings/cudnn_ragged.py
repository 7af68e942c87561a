"""cuDNN's ragged (THD) attention, forward and backward, built with the cuDNN frontend's graph API.

    out, lse = forward(q, k, v, cu_q, cu_k, count, bound_q, bound_k, scale, is_causal, bottom_right)
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, cu_q, cu_k, count, bound_q, bound_k, ...)

q, out: ``[T_q, H_q, D]``; k, v: ``[T_k, H_k, D]``; lse: ``[T_q, H_q]`` fp32; ``cu_*``:
``count + 1`` prefix sums (sequence i is rows ``cu[i]:cu[i + 1]``); ``bound_*`` at least the
longest sequence. Each tensor is described to cuDNN as ``[count, H, bound, D]`` whose batch
bases come from per-sequence offsets (``set_ragged_offset``) and whose rows past a sequence's
length are masked (a padding mask with per-sequence lengths).

Why our own graphs rather than the frontend's ``torch.ops.cudnn.sdpa_fwd`` / ``sdpa_bwd``
(which build the same cuDNN nodes): the offsets and lengths are computed here with plain torch
ops, so the whole call is capturable in a CUDA graph (cudagraph trees included), and the
forward skips the op's per-call work. The backward reads the log-sum-exp through ragged offsets
(no re-padding) below ``PADDED_STATS_FROM_HEAD_DIM``; from there cuDNN's backward measured
faster reading it padded per sequence, so it is re-padded on device first. Measured on H200
(Hq32 Hkv8, bf16, causal, ms; ``python benchmarks/bench_ragged_op.py``, JSON
run log ``h200_ragged_op_2026-12-01.json`` (git history)):

    T, D, lengths         forward: ours / frontend op   backward: ragged / padded / frontend op
    32K 128 random               2.91 / 3.02                     8.45 / 8.65 / 8.71
    32K 128 one long + 64        4.22 / 4.42                    12.15 / 14.42 / 14.16
    64K 128 random              15.94 / 15.96                   45.57 / 44.47 / 44.46
    32K 256 random               9.70 / 9.84                    46.01 / 41.83 / 41.80
    32K 256 8 x 4K               3.54 / 4.24                    19.15 / 17.21 / 17.33

Graphs are built on a helper thread (``outside_graph_pool``): built inside cudagraph trees'
warm-up run, the forward's log-sum-exp was then missing from the graphs' pool at the
backward's check ("storage data ptrs are not allocated in pool"); built before, or on another
thread, every replay is right (``tests/test_gpu_one.py``).

A graph is built per signature (dtypes, heads, head dims, strides, scale, mask) and per
(count, bounds) - and, in the backward, the bucketed token total, which sizes cuDNN's dq
accumulator: the caller buckets those (``varlen_attention._bucketed``).
"""

from __future__ import annotations

import torch

from .cudnn_graph import Plan, descriptor_ready, finish, handle, io_type, new_graph
from .outside_graph_pool import outside_graph_pool

# below this head_dim the backward reads the forward's log-sum-exp as it is (ragged)
PADDED_STATS_FROM_HEAD_DIM = 256

_forward_plans: dict[tuple, Plan] = {}
_backward_plans: dict[tuple, Plan] = {}
builds = {"forward": 0, "backward": 0}  # graphs built so far (the benchmarks count them)

_Q, _K, _V, _O, _STATS, _DO, _DQ, _DK, _DV = 1, 2, 3, 4, 5, 6, 7, 8, 9
_LEN_Q, _LEN_K = 10, 11
# ragged offsets (int64 element offsets of each sequence's first token), one per tensor
_OFF = {name: 20 + i for i, name in enumerate(("q", "k", "v", "o", "stats", "do", "dq", "dk", "dv"))}


def _ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` as dense ``[T, H, D]`` rows. cuDNN's ragged backward hit an illegal instruction on
    H200 (cuDNN 9.19) when q was a view of a ``[T, 3, H, D]`` tensor (flash-attn's qkv-packed
    form: token stride 3 H D), so any operand whose tokens are not packed rows is copied first;
    the copy (q at T32K Hq32 D128: 0.5 GB moved, about 0.15 ms by bandwidth) is small next to
    the attention it feeds (11 ms fwd+bwd)."""
    if t.is_contiguous() and descriptor_ready(t.stride(), t.data_ptr()):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _describe(graph, name, uid, t_shape_stride, count, bound, dtype):
    """A packed ``[T, H, D]`` tensor (token stride, head stride) as cuDNN's ``[count, H, bound, D]``;
    the batch stride is a placeholder, the ragged offsets give each sequence's base."""
    (heads, dim), (token_stride, head_stride) = t_shape_stride
    return graph.tensor(name=name, dim=[count, heads, bound, dim], stride=[bound * token_stride, head_stride, token_stride, 1],
                        data_type=dtype, uid=uid)


def _column(graph, name, uid, n, dtype):
    return graph.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dtype, uid=uid)


def _geometry(t: torch.Tensor) -> tuple:
    return (tuple(t.shape[1:]), tuple(t.stride()[:2]))


def _mask(is_causal: bool, bottom_right: bool) -> dict:
    import cudnn

    alignment = cudnn.diagonal_alignment.BOTTOM_RIGHT if bottom_right else cudnn.diagonal_alignment.TOP_LEFT
    return {"diagonal_alignment": alignment, "diagonal_band_right_bound": 0 if is_causal else None}


def _metadata(cu_q, cu_k, strides: dict) -> dict:
    """Per-sequence lengths (int32) and each tensor's ragged offsets (int64 elements), on device.
    ``strides``: tensor name -> (cu to use, token stride); equal products are computed once."""
    cu = {"q": cu_q.to(torch.int64), "k": cu_k.to(torch.int64)}
    out = {_LEN_Q: (cu["q"][1:] - cu["q"][:-1]).to(torch.int32).view(-1, 1, 1, 1)}
    out[_LEN_K] = out[_LEN_Q] if cu_k is cu_q else (cu["k"][1:] - cu["k"][:-1]).to(torch.int32).view(-1, 1, 1, 1)
    made: dict[tuple, torch.Tensor] = {}
    for name, (side, stride) in strides.items():
        key = (side if cu_k is not cu_q else "q", stride)
        if key not in made:
            made[key] = (cu[side] * stride).view(-1, 1, 1, 1)
        out[_OFF[name]] = made[key]
    return out


def forward(q, k, v, cu_q, cu_k, count, bound_q, bound_k, scale, is_causal, bottom_right):
    q, k, v = _ready(q), _ready(k), _ready(v)
    t_q, h_q = q.shape[:2]
    d_v = v.shape[2]
    out = q.new_empty(t_q, h_q, d_v)
    stats = q.new_empty(t_q, h_q, dtype=torch.float32)
    signature = (q.dtype, q.device, _geometry(q), _geometry(k), _geometry(v), scale, is_causal, bottom_right,
                 count, bound_q, bound_k)
    h = handle(q.get_device())
    plan = _forward_plans.get(signature)
    if plan is None:
        plan = _forward_plans[signature] = outside_graph_pool(
            _build_forward, h, q, k, v, count, bound_q, bound_k, scale, is_causal, bottom_right)
        builds["forward"] += 1
    meta = _metadata(cu_q, cu_k, {"q": ("q", q.stride(0)), "k": ("k", k.stride(0)), "v": ("k", v.stride(0)),
                                  "o": ("q", h_q * d_v), "stats": ("q", h_q)})
    tensors = {_Q: q, _K: k, _V: v, _O: out, _STATS: stats, **meta}
    plan.run([tensors[uid] for uid in plan.uids], q.device, h)
    return out, stats


def _build_forward(h, q, k, v, count, bound_q, bound_k, scale, is_causal, bottom_right) -> Plan:
    import cudnn

    io = io_type(q.dtype)
    g = new_graph(h, q.dtype)
    q_t = _describe(g, "q", _Q, _geometry(q), count, bound_q, io)
    k_t = _describe(g, "k", _K, _geometry(k), count, bound_k, io)
    v_t = _describe(g, "v", _V, _geometry(v), count, bound_k, io)
    for t, name in ((q_t, "q"), (k_t, "k"), (v_t, "v")):
        t.set_ragged_offset(_column(g, f"offset_{name}", _OFF[name], count + 1, cudnn.data_type.INT64))
    o_t, stats_t = g.sdpa(
        name="ragged_attention", q=q_t, k=k_t, v=v_t, generate_stats=True, attn_scale=scale, use_padding_mask=True,
        seq_len_q=_column(g, "len_q", _LEN_Q, count, cudnn.data_type.INT32),
        seq_len_kv=_column(g, "len_k", _LEN_K, count, cudnn.data_type.INT32), **_mask(is_causal, bottom_right))
    h_q, d_v = q.shape[1], v.shape[2]
    o_t.set_uid(_O).set_output(True).set_dim([count, h_q, bound_q, d_v]).set_data_type(io)
    o_t.set_stride([bound_q * h_q * d_v, d_v, h_q * d_v, 1])
    o_t.set_ragged_offset(_column(g, "offset_o", _OFF["o"], count + 1, cudnn.data_type.INT64))
    stats_t.set_uid(_STATS).set_output(True).set_dim([count, h_q, bound_q, 1]).set_data_type(cudnn.data_type.FLOAT)
    stats_t.set_stride([bound_q * h_q, 1, h_q, 1])
    stats_t.set_ragged_offset(_column(g, "offset_stats", _OFF["stats"], count + 1, cudnn.data_type.INT64))
    return finish(g, h, (_Q, _K, _V, _O, _STATS, _LEN_Q, _LEN_K, *(_OFF[n] for n in ("q", "k", "v", "o", "stats"))))


def padded_stats(lse: torch.Tensor, cu_q: torch.Tensor, count: int, bound: int) -> torch.Tensor:
    """``[T, H]`` per token -> ``[count, H, bound, 1]`` per sequence position, on device (no sync;
    rows past a sequence's length stay zero, and cuDNN's padding mask never reads them)."""
    tokens, heads = lse.shape
    cu = cu_q.to(torch.int64)
    token = torch.arange(tokens, device=lse.device)
    sequence = torch.searchsorted(cu[1:], token, right=True)
    padded = lse.new_zeros(count, heads, bound, 1)
    padded[sequence, :, token - cu[sequence], 0] = lse
    return padded


def backward(grad_out, q, k, v, out, lse, cu_q, cu_k, count, bound_q, bound_k, total_q, total_k, scale, is_causal,
             bottom_right):
    q, k, v, out, grad_out = (_ready(t) for t in (q, k, v, out, grad_out))
    padded = q.shape[2] >= PADDED_STATS_FROM_HEAD_DIM
    stats = padded_stats(lse, cu_q, count, bound_q) if padded else lse.contiguous()
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    deterministic = torch.are_deterministic_algorithms_enabled()
    signature = (q.dtype, q.device, _geometry(q), _geometry(k), _geometry(v), _geometry(out), _geometry(grad_out),
                 scale, is_causal, bottom_right, deterministic, padded, count, bound_q, bound_k, total_q, total_k)
    h = handle(q.get_device())
    plan = _backward_plans.get(signature)
    if plan is None:
        plan = _backward_plans[signature] = outside_graph_pool(
            _build_backward, h, (q, k, v, out, grad_out), count, bound_q, bound_k, total_q, total_k, scale, is_causal, bottom_right,
            deterministic, padded)
        builds["backward"] += 1
    h_q, h_k, d = q.shape[1], k.shape[1], q.shape[2]
    strides = {"q": ("q", q.stride(0)), "k": ("k", k.stride(0)), "v": ("k", v.stride(0)), "o": ("q", out.stride(0)),
               "do": ("q", grad_out.stride(0)), "dq": ("q", h_q * d), "dk": ("k", h_k * d), "dv": ("k", dv.stride(0))}
    if not padded:
        strides["stats"] = ("q", h_q)
    tensors = {_Q: q, _K: k, _V: v, _O: out, _DO: grad_out, _STATS: stats, _DQ: dq, _DK: dk, _DV: dv,
               **_metadata(cu_q, cu_k, strides)}
    plan.run([tensors[uid] for uid in plan.uids], q.device, h)
    return dq, dk, dv


def _build_backward(h, operands, count, bound_q, bound_k, total_q, total_k, scale, is_causal, bottom_right,
                    deterministic, padded) -> Plan:
    import cudnn

    q, k, v, out, grad_out = operands
    io = io_type(q.dtype)
    g = new_graph(h, q.dtype)
    int64 = cudnn.data_type.INT64
    described = {}
    for name, uid, t, bound in (("q", _Q, q, bound_q), ("k", _K, k, bound_k), ("v", _V, v, bound_k),
                                ("o", _O, out, bound_q), ("do", _DO, grad_out, bound_q)):
        described[name] = _describe(g, name, uid, _geometry(t), count, bound, io)
        described[name].set_ragged_offset(_column(g, f"offset_{name}", _OFF[name], count + 1, int64))
    h_q = q.shape[1]
    if padded:
        stats = g.tensor(name="stats", dim=[count, h_q, bound_q, 1], stride=[h_q * bound_q, bound_q, 1, 1],
                         data_type=cudnn.data_type.FLOAT, uid=_STATS)
    else:
        stats = g.tensor(name="stats", dim=[count, h_q, bound_q, 1], stride=[bound_q * h_q, 1, h_q, 1],
                         data_type=cudnn.data_type.FLOAT, uid=_STATS)
        stats.set_ragged_offset(_column(g, "offset_stats", _OFF["stats"], count + 1, int64))
    grads = g.sdpa_backward(
        name="ragged_attention_backward", q=described["q"], k=described["k"], v=described["v"], o=described["o"],
        dO=described["do"], stats=stats, attn_scale=scale, use_padding_mask=True,
        seq_len_q=_column(g, "len_q", _LEN_Q, count, cudnn.data_type.INT32),
        seq_len_kv=_column(g, "len_k", _LEN_K, count, cudnn.data_type.INT32),
        max_total_seq_len_q=total_q, max_total_seq_len_kv=total_k, use_deterministic_algorithm=deterministic,
        **_mask(is_causal, bottom_right))
    for grad, name, uid, like, bound in zip(grads, ("dq", "dk", "dv"), (_DQ, _DK, _DV), (q, k, v), (bound_q, bound_k, bound_k)):
        heads, dim = like.shape[1:]
        grad.set_uid(uid).set_output(True).set_dim([count, heads, bound, dim]).set_data_type(io)
        grad.set_stride([bound * heads * dim, dim, heads * dim, 1])
        grad.set_ragged_offset(_column(g, f"offset_{name}", _OFF[name], count + 1, int64))
    offsets = ("q", "k", "v", "o", "do", "dq", "dk", "dv") + (() if padded else ("stats",))
    return finish(g, h, (_Q, _K, _V, _O, _DO, _STATS, _DQ, _DK, _DV, _LEN_Q, _LEN_K, *(_OFF[n] for n in offsets)))
