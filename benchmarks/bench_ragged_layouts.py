"""Two choices of ``cudnn_ragged`` checked on one GPU: the ragged layout, and the heuristic's plan.

    python benchmarks/bench_ragged_layouts.py --json out.json

Per pack (Hq32, Hkv8 and 32, bf16, 8 random documents; T32K / T64K, D64 / D128 / D256, causal
and not), medians of CUDA-event times, ms:

- ``ragged``: ``cudnn_ragged``'s forward and backward, as the op runs them;
- ``padded``: the same attention on a zero-padded ``[count, bound]`` copy of the pack (cuDNN's
  dense descriptors with a padding mask and per-sequence lengths, no ragged offsets), and,
  apart, the copies that route would add (pad q, k, v and gather out; pad dO and gather dq,
  dk, dv);
- ``plans`` (Hkv8): every plan cuDNN's heuristics list for the ragged forward and backward
  graphs, each built and timed (plan 0 is the one ``cudnn_graph.finish`` takes).
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_thd import HQ, lengths_for
from common import device_ms, fill_free_memory, write_rows

from cp_inductor.testing import varlen_programs as vp

CASES = [(32768, 128, True), (32768, 128, False), (65536, 128, True), (65536, 128, False), (32768, 256, True),
         (32768, 256, False), (32768, 64, True)]
_Q, _K, _V, _O, _STATS, _DO, _DQ, _DK, _DV, _LEN_Q, _LEN_K = 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11


def padded_graph(h, dtype, count, bound, heads_q, heads_k, dim, scale, causal, backward):
    """cuDNN's dense SDPA (forward or backward) over ``[count, bound, H, D]`` buffers, the rows past
    each sequence's length masked."""
    import cudnn

    from cp_inductor.lowerings.cudnn_graph import io_type, new_graph

    io, f32, i32 = io_type(dtype), cudnn.data_type.FLOAT, cudnn.data_type.INT32
    g = new_graph(h, dtype)
    dims = lambda heads, d=dim: ([count, heads, bound, d], [bound * heads * d, d, heads * d, 1])  # noqa: E731
    tensor = lambda name, uid, heads: g.tensor(name=name, dim=dims(heads)[0], stride=dims(heads)[1], data_type=io, uid=uid)  # noqa: E731
    column = lambda name, uid: g.tensor(name=name, dim=[count, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32, uid=uid)  # noqa: E731
    q, k, v = tensor("q", _Q, heads_q), tensor("k", _K, heads_k), tensor("v", _V, heads_k)
    common = dict(attn_scale=scale, use_padding_mask=True, seq_len_q=column("len_q", _LEN_Q),
                  seq_len_kv=column("len_k", _LEN_K), diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
                  diagonal_band_right_bound=0 if causal else None)
    stats_dim, stats_stride = [count, heads_q, bound, 1], [heads_q * bound, bound, 1, 1]
    if not backward:
        o, stats = g.sdpa(name="padded", q=q, k=k, v=v, generate_stats=True, **common)
        o.set_uid(_O).set_output(True).set_dim(dims(heads_q)[0]).set_stride(dims(heads_q)[1]).set_data_type(io)
        stats.set_uid(_STATS).set_output(True).set_dim(stats_dim).set_stride(stats_stride).set_data_type(f32)
    else:
        stats = g.tensor(name="stats", dim=stats_dim, stride=stats_stride, data_type=f32, uid=_STATS)
        grads = g.sdpa_backward(name="padded_backward", q=q, k=k, v=v, o=tensor("o", _O, heads_q),
                                dO=tensor("do", _DO, heads_q), stats=stats, **common)
        for grad, uid, heads in zip(grads, (_DQ, _DK, _DV), (heads_q, heads_k, heads_k)):
            grad.set_uid(uid).set_output(True).set_dim(dims(heads)[0]).set_stride(dims(heads)[1]).set_data_type(io)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return g


def executed(g, h, tensors: dict, index: int | None = None):
    workspace_bytes = g.get_workspace_size() if index is None else g.get_workspace_size_plan_at_index(index)
    workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device="cuda")
    if index is None:
        return lambda: g.execute(tensors, workspace, handle=h)
    return lambda: g.execute_plan_at_index(tensors, workspace, index, handle=h)


def every_plan(g, h, tensors: dict, iters: int) -> list:
    rows = []
    for i in range(g.get_execution_plan_count()):
        try:
            g.build_plan_at_index(i)
            rows.append({"index": i, "name": g.get_plan_name_at_index(i), "ms": device_ms(executed(g, h, tensors, i), iters)})
        except Exception as e:  # noqa: BLE001 - a plan that does not build is listed with its reason
            rows.append({"index": i, "error": str(e)[:200]})
    return rows


def ragged_plans(q, k, v, out, lse, grad, cu, count, bound, scale, causal, iters) -> dict:
    """Every plan of the op's own forward and backward graphs for this pack, timed."""
    from cp_inductor.lowerings import cudnn_ragged
    from cp_inductor.lowerings.cudnn_graph import handle

    h = handle(0)
    # measure() cleared the caches first: these are the pack's own graphs
    (forward_plan,), (backward_plan,) = cudnn_ragged._forward_plans.values(), cudnn_ragged._backward_plans.values()
    heads_q = q.shape[1]
    strides = {"q": ("q", q.stride(0)), "k": ("k", k.stride(0)), "v": ("k", v.stride(0)), "o": ("q", out.stride(0)),
               "stats": ("q", heads_q)}
    forward_tensors = {_Q: q, _K: k, _V: v, _O: torch.empty_like(out), _STATS: torch.empty_like(lse),
                       **cudnn_ragged._metadata(cu, cu, strides)}
    padded = q.shape[2] >= cudnn_ragged.PADDED_STATS_FROM_HEAD_DIM
    strides.update({"do": ("q", grad.stride(0)), "dq": ("q", q.stride(0)), "dk": ("k", k.stride(0)), "dv": ("k", v.stride(0))})
    if padded:
        del strides["stats"]
    backward_tensors = {_Q: q, _K: k, _V: v, _O: out, _DO: grad,
                        _STATS: cudnn_ragged.padded_stats(lse, cu, count, bound) if padded else lse,
                        _DQ: torch.empty_like(q), _DK: torch.empty_like(k), _DV: torch.empty_like(v),
                        **cudnn_ragged._metadata(cu, cu, strides)}
    return {"forward": every_plan(forward_plan.graph, h, forward_tensors, iters),
            "backward": every_plan(backward_plan.graph, h, backward_tensors, iters)}


def measure(tokens, head_dim, causal, heads_kv, iters) -> dict:
    from cp_inductor.lowerings import cudnn_ragged
    from cp_inductor.lowerings.cudnn_graph import handle
    from cp_inductor.lowerings.varlen_attention import bucket

    lengths = lengths_for("random", tokens, seed=tokens + head_dim)
    q, k, v, cu, longest = vp.pack(lengths, HQ, heads_kv, head_dim, dtype=torch.bfloat16, device="cuda", seed=1)
    grad = torch.randn_like(q)
    count, bound, scale = len(lengths), bucket(longest, 64), head_dim ** -0.5
    cudnn_ragged._forward_plans.clear()
    cudnn_ragged._backward_plans.clear()

    def forward():
        return cudnn_ragged.forward(q, k, v, cu, cu, count, bound, bound, scale, causal, False)

    out, lse = forward()

    def backward():
        return cudnn_ragged.backward(grad, q, k, v, out, lse, cu, cu, count, bound, bound, tokens, tokens, scale, causal, False)

    row = {"tokens": tokens, "head_dim": head_dim, "causal": causal, "kv_heads": heads_kv, "docs": lengths,
           "bound": bound, "ragged_fwd_ms": device_ms(forward, iters), "ragged_bwd_ms": device_ms(backward, iters)}

    cu64 = cu.long()
    token = torch.arange(tokens, device="cuda")
    sequence = torch.searchsorted(cu64[1:], token, right=True)
    row_of = sequence * bound + (token - cu64[sequence])  # each token's row in the padded buffers
    lengths_t = (cu[1:] - cu[:-1]).to(torch.int32).view(-1, 1, 1, 1)

    def pad(x):
        padded = x.new_zeros(count * bound, *x.shape[1:])
        padded[row_of] = x
        return padded

    h = handle(0)
    qp, kp, vp_, dop = pad(q), pad(k), pad(v), pad(grad)
    op, dq, dk, dv = torch.empty_like(qp), torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp_)
    stats = torch.empty(count, HQ, bound, 1, device="cuda", dtype=torch.float32)
    lens = {_LEN_Q: lengths_t, _LEN_K: lengths_t}
    padded_forward = executed(padded_graph(h, q.dtype, count, bound, HQ, heads_kv, head_dim, scale, causal, False), h,
                              {_Q: qp, _K: kp, _V: vp_, _O: op, _STATS: stats, **lens})
    padded_forward()
    padded_backward = executed(padded_graph(h, q.dtype, count, bound, HQ, heads_kv, head_dim, scale, causal, True), h,
                               {_Q: qp, _K: kp, _V: vp_, _O: op, _STATS: stats, _DO: dop, _DQ: dq, _DK: dk, _DV: dv, **lens})
    row["padded_vs_ragged_out_max_abs"] = float((op[row_of].float() - out.float()).abs().max())
    row["padded_fwd_ms"] = device_ms(padded_forward, iters)
    row["padded_bwd_ms"] = device_ms(padded_backward, iters)
    row["padded_fwd_copies_ms"] = device_ms(lambda: (pad(q), pad(k), pad(v), op[row_of]), iters)
    row["padded_bwd_copies_ms"] = device_ms(lambda: (pad(grad), dq[row_of], dk[row_of], dv[row_of]), iters)
    row["ragged_ms"] = row["ragged_fwd_ms"] + row["ragged_bwd_ms"]
    row["padded_ms"] = sum(row[f"padded_{n}_ms"] for n in ("fwd", "bwd", "fwd_copies", "bwd_copies"))
    if heads_kv != HQ:
        row["plans"] = ragged_plans(q, k, v, out, lse, grad, cu, count, bound, scale, causal, iters)
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--kv-heads", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    print(f"filled {fill_free_memory(0.4):.0f} GiB with random values")
    print(f"{'T':>6} {'D':>4} {'mask':>6} {'Hkv':>3} | ragged fwd  bwd  | padded fwd  bwd  copies | ragged  padded | "
          "forward plans ms (0 = taken) | backward plans ms")
    rows = []
    for tokens, head_dim, causal in CASES:
        for heads_kv in a.kv_heads:
            row = measure(tokens, head_dim, causal, heads_kv, a.iters)
            rows.append(row)
            plans = row.get("plans", {})
            listed = [" ".join(f"{p['ms']:.2f}" if "ms" in p else "x" for p in plans.get(side, [])) for side in ("forward", "backward")]
            print(f"{tokens:>6} {head_dim:>4} {'causal' if causal else 'full':>6} {heads_kv:>3} | "
                  f"{row['ragged_fwd_ms']:7.2f} {row['ragged_bwd_ms']:6.2f} | {row['padded_fwd_ms']:7.2f} "
                  f"{row['padded_bwd_ms']:6.2f} {row['padded_fwd_copies_ms'] + row['padded_bwd_copies_ms']:6.2f} | "
                  f"{row['ragged_ms']:6.2f} {row['padded_ms']:7.2f} | {listed[0]} | {listed[1]}", flush=True)
            write_rows(a.json, a, rows)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
