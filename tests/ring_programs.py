"""Ring programs for the tests: the hand-written ring (``ring_by_hand``: the package's
``cp_inductor.parallel.ring_attention`` with the CPU kernel, one autograd.Function written the
way CP projects write it for torch.compile) and PyTorch native CP's own ring code around the CPU
kernel (``native_ring``)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from cp_inductor.parallel import ring_attention

aten = torch.ops.aten


def ring_by_hand(q, k, v, *, causal: bool = False, group=None):
    """q, k, v ``[B, S/cp, H, D]`` shards (causal: load-balanced); CPU kernel."""
    return ring_attention(q, k, v, group=group, is_causal=causal, kernel="cpu")


def _native_attention_module():
    """PyTorch native CP's ring module (its place moved between releases)."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:  # older layout
        from torch.distributed.tensor.experimental import _attention
    return _attention


@contextlib.contextmanager
def native_options(rotate: str = "alltoall", load_balance: bool = True):
    """Native CP's global options (``set_rotate_method``, load balance) for a trace and its runs:
    set outside compiled code, as native CP's users do."""
    opts = _native_attention_module()._cp_options
    before = opts.rotate_method, opts.enable_load_balance
    opts.rotate_method = {"alltoall": type(before[0]).ALL_TO_ALL, "allgather": type(before[0]).ALL_GATHER}[rotate]
    opts.enable_load_balance = load_balance
    try:
        yield
    finally:
        opts.rotate_method, opts.enable_load_balance = before


def _cpu_backward(grad_out, query, key, value, out, logsumexp, is_causal, dropout_p=0.0):
    # Native CP passes ``out=`` by keyword, which Dynamo would take for an out-variant call.
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal
    )


class NativeRing(torch.autograd.Function):
    """PyTorch native context_parallel's own ring code (``_templated_ring_attention`` and its
    backward, what its SDPA handlers run per rank) around the CPU kernel, which native CP does not
    dispatch: the graph native CP traces to, on gloo. Rotation and load balance: native CP's
    options (:func:`native_options`)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool):
        native = _native_attention_module()
        out, lse = native._templated_ring_attention(
            dist.group.WORLD, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v, is_causal=causal
        )[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        native = _native_attention_module()
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = native._templated_ring_attention_backward(
            dist.group.WORLD, 2, _cpu_backward, dout, "grad_out",
            q, k, v, out, lse, ctx.causal, dropout_p=0.0,
        )[:3]
        return dq, dk, dv, None


def native_ring(q, k, v, *, causal: bool = False):
    """BSHD shards in and out, as :func:`ring_by_hand`; native CP's load balance must match the
    sharding (on: zigzag, for causal attention only)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return NativeRing.apply(q, k, v, causal).transpose(1, 2)


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Ulysses: ``[B, S/n, H, D]`` -> ``[B, S, H/n, D]`` over ``group`` (its n ranks' sequence)."""
    import torch.distributed._functional_collectives as funcol

    n = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Inverse of :func:`_heads_to_sequence`."""
    import torch.distributed._functional_collectives as funcol

    n = dist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, n, s // n, h, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = funcol.all_to_all_single_autograd(send, None, None, group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def usp_by_hand(q, k, v, *, ulysses_group, ring_group):
    """Unified sequence parallelism (yunchang's USP) by hand, not causal: Ulysses all-to-all over
    ``ulysses_group`` (heads for sequence), ring attention over ``ring_group`` on what arrives,
    Ulysses back. Contiguous shards, rank = ring rank * Ulysses size + Ulysses rank."""
    q, k, v = (_heads_to_sequence(t, ulysses_group) for t in (q, k, v))
    out = ring_by_hand(q, k, v, causal=False, group=ring_group)
    return _sequence_to_heads(out, ulysses_group)


def causal_native_ring(q, k, v):
    return native_ring(q, k, v, causal=True)


def same_bits_on_and_off(rank: int, cp: int, program: str, rewrite: str, heads_kv: int) -> dict:
    """On a gloo rank: a causal load-balanced bf16 ring (``program`` "hand": ``ring_by_hand``,
    else native CP's all-to-all rotation) compiled with ``rewrite`` off and on (copy-engine
    rotations off): how often the passes applied it in each compile, and per output / gradient
    whether the two compiles agree bit for bit."""
    from torch._dynamo.utils import counters

    from cp_inductor.testing.checks import AttentionCase, full_inputs, run_cp

    case = AttentionCase(batch=1, seq=32, heads_q=4, heads_kv=heads_kv, head_dim=8, causal=True,
                         load_balanced=True, dtype=torch.bfloat16)
    fn = (lambda q, k, v: ring_by_hand(q, k, v, causal=True)) if program == "hand" else causal_native_ring
    full = full_inputs(case)
    out, applied = {}, {}
    for on in (False, True):
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, backend="cp_inductor", fullgraph=True,
                                 options={f"cp_inductor.{rewrite}": on, "cp_inductor.ce_rotation": False})
        with native_options("alltoall", load_balance=True) if program != "hand" else contextlib.nullcontext():
            out[on] = run_cp(compiled, case, full, rank, cp)
        applied[on] = counters["cp_inductor"][rewrite]
    return {"applied": applied, "same": {name: torch.equal(out[False][name], out[True][name]) for name in out[False]}}
