"""Packed-sequence (THD) programs written the ways real projects write them, and CPU kernels for
torch's varlen attention ops (CUDA-only in torch) so CPU tests can run them eagerly."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from cp_inductor.lowerings.varlen_attention import reference, reference_backward


def _window(window_size, is_causal=False):
    return bool(is_causal) or list(window_size or [-1, -1]) == [-1, 0]


@functools.cache
def register_cpu_kernels() -> bool:
    """CPU kernels for ``torch_attn::_varlen_attn`` and its backward (the per-sequence reference),
    whatever the op's schema in this torch. False where this torch has no varlen_attn."""
    try:
        import torch.nn.attention.varlen  # noqa: F401 - defines the ops
    except ImportError:
        return False
    if not hasattr(torch.ops.torch_attn, "_varlen_attn"):
        return False

    def forward(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs):
        bound = _bind(torch.ops.torch_attn._varlen_attn.default, (query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *args), kwargs)
        scale = bound.get("scale") or query.shape[-1] ** -0.5
        causal = _window(bound.get("window_size"), bound.get("is_causal", False))
        out, lse = reference(query, key, value, cu_seq_q, cu_seq_k if cu_seq_k is not None else cu_seq_q, scale, causal)
        return out, lse.transpose(0, 1).contiguous(), torch.zeros(2, dtype=torch.uint64)

    def backward(grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, *args, **kwargs):
        bound = _bind(torch.ops.torch_attn._varlen_attn_backward.default,
                      (grad_out, query, key, value, out, lse, cu_seq_q, cu_seq_k, max_q, max_k, *args), kwargs)
        scale = bound.get("scale") or query.shape[-1] ** -0.5
        causal = _window(bound.get("window_size"), bound.get("is_causal", False))
        return reference_backward(grad_out, query, key, value, cu_seq_q, cu_seq_k, scale, causal)

    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", forward)
    torch.library.register_kernel("torch_attn::_varlen_attn_backward", "cpu", backward)
    return True


def _bind(op, args, kwargs) -> dict:
    names = [a.name for a in op._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def pack(lengths, heads_q, heads_kv, head_dim, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v of one packed row of documents with the given lengths, and cu_seqlens (int32)."""
    g = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads_q, head_dim, generator=g, device=device, dtype=dtype)
    k, v = (torch.randn(total, heads_kv, head_dim, generator=g, device=device, dtype=dtype) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu, max(lengths)


def torchtitan_style(q, k, v, cu, max_len, causal=True, **options):
    """torchtitan's VarlenAttention: varlen_attn on the pack, K/V heads repeated for GQA
    (``options``: what it adds on some machines, ``num_splits=1`` before Hopper)."""
    from torch.nn.attention.varlen import varlen_attn

    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    window = (-1, 0) if causal else (-1, -1)
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=window, **options)


def positions_style(q, k, v, positions, causal=True):
    """Hugging Face's packed batches (``DataCollatorWithFlattening``): no cu_seqlens, position ids
    that restart at 0 with each document. The boundaries are where they restart (``nonzero``: a
    data-dependent document count) and the longest document is read back with ``.item()`` (a
    graph break, or an unbacked int under ``capture_scalar_outputs``)."""
    starts = torch.nonzero(positions == 0).flatten()
    cu = torch.cat([starts, starts.new_tensor([positions.numel()])]).to(torch.int32)
    return torchtitan_style(q, k, v, cu, int(cu.diff().max().item()), causal)


def positions_of(lengths, device="cpu"):
    return torch.cat([torch.arange(n, device=device) for n in lengths])


def sequence_reference(q, k, v, cu, causal):
    """Per-sequence SDPA in fp64: the single-device reference."""
    bounds = cu.tolist()
    outs = []
    for a, b in zip(bounds, bounds[1:]):
        o = F.scaled_dot_product_attention(*(t[a:b].double().transpose(0, 1) for t in (q, k, v)),
                                           is_causal=causal, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


FLASH_ATTN_FORWARD = (
    "_flash_attn_varlen_forward(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, float softmax_scale, bool causal, "
    "SymInt window_size_left=-1, SymInt window_size_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
    "bool return_softmax=False, Tensor? block_table=None, Tensor? leftpad_k=None, Tensor? seqused_k=None, "
    "bool zero_tensors=False) -> (Tensor, Tensor, Tensor, Tensor)")
FLASH_ATTN_BACKWARD = (
    "_flash_attn_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, "
    "Tensor(a!)? dq, Tensor(b!)? dk, Tensor(c!)? dv, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k, float dropout_p, float softmax_scale, bool causal, SymInt window_size_left, "
    "SymInt window_size_right, float softcap, Tensor? alibi_slopes, bool deterministic, Tensor? rng_state=None, "
    "bool zero_tensors=False) -> Tensor")


_flash_attn_made: dict = {}


def flash_attn_like(namespace: str = "flash_attn"):
    """flash-attn's varlen attention as CI can have it (no flash-attn there): its two custom ops
    under flash-attn's schemas in ``namespace`` (``flash_attn`` in the 2.7/2.8 wheels,
    ``flashattn`` later), and ``flash_attn_varlen_func`` around them in an autograd.Function
    shaped as flash-attn's own (head_dim padded to a multiple of 8, the backward op writing dq,
    dk and dv in place). The kernels: the per-sequence reference on CPU, aten's flash-2 on CUDA.
    None where flash-attn itself defines the ops. Call it before compiling: it registers ops."""
    if namespace in _flash_attn_made:
        return _flash_attn_made[namespace]
    if hasattr(getattr(torch.ops, namespace), "_flash_attn_varlen_forward"):
        return None
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define(FLASH_ATTN_FORWARD)
    lib.define(FLASH_ATTN_BACKWARD)

    def forward_cpu(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, *args):
        out, lse = reference(q, k, v, cu_q, cu_k, scale, causal)
        return out, lse.transpose(0, 1).contiguous(), q.new_empty(0), torch.zeros(2, dtype=torch.int64)

    def backward_cpu(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, *args, **kwargs):
        for into, grad in zip((dq, dk, dv), reference_backward(dout, q, k, v, cu_q, cu_k, scale, causal)):
            into.copy_(grad)
        return lse.new_empty(lse.shape)

    def forward_cuda(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, *args):
        out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal,
                                                                       False, scale=scale)
        return out, lse, q.new_empty(0), rng

    def backward_cuda(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, *args, **kwargs):
        rng = kwargs.get("rng_state", args[5] if len(args) > 5 else None)
        grads = torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p,
                                                         causal, rng, rng.new_empty(0), scale=scale)
        for into, grad in zip((dq, dk, dv), grads):
            into.copy_(grad)
        return lse.new_empty(lse.shape)

    def forward_fake(q, k, v, cu_q, cu_k, *args):
        return (torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32), q.new_empty(0),
                q.new_empty(2, dtype=torch.int64))

    for name, cpu, cuda in (("_flash_attn_varlen_forward", forward_cpu, forward_cuda),
                            ("_flash_attn_varlen_backward", backward_cpu, backward_cuda)):
        lib.impl(name, cpu, "CPU")
        lib.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"{namespace}::_flash_attn_varlen_forward", forward_fake, lib=lib)
    torch.library.register_fake(f"{namespace}::_flash_attn_varlen_backward",
                                lambda dout, q, k, v, out, lse, *args, **kwargs: lse.new_empty(lse.shape), lib=lib)
    ops = getattr(torch.ops, namespace)

    class FlashAttnVarlenFunc(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window_size, softcap):
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            head_dim = q.shape[-1]
            if head_dim % 8:
                q, k, v = (F.pad(t, [0, 8 - head_dim % 8]) for t in (q, k, v))
            out_padded, lse, _, rng = ops._flash_attn_varlen_forward(
                q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal=causal, window_size_left=window_size[0],
                window_size_right=window_size[1], softcap=softcap)
            ctx.save_for_backward(q, k, v, out_padded, lse, cu_q, cu_k, rng)
            ctx.args = (max_q, max_k, dropout_p, scale, causal, *window_size, softcap)
            return out_padded[..., :head_dim]

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse, cu_q, cu_k, rng = ctx.saved_tensors
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
            ops._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, *ctx.args, None, False,
                                            rng_state=rng)
            head_dim = dout.shape[-1]
            return dq[..., :head_dim], dk[..., :head_dim], dv[..., :head_dim], *([None] * 9)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
        return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                         softmax_scale, causal, window_size, softcap)

    class FlashAttnVarlenQKVPackedFunc(torch.autograd.Function):
        """flash-attn's packed form: q, k, v as views of one [T, 3, H, D] input, one gradient for it."""

        @staticmethod
        def forward(ctx, qkv, cu, max_len, dropout_p, scale, causal):
            scale = qkv.shape[-1] ** -0.5 if scale is None else scale
            q, k, v = qkv[:, 0].detach(), qkv[:, 1].detach(), qkv[:, 2].detach()
            out, lse, _, rng = ops._flash_attn_varlen_forward(q, k, v, cu, cu, max_len, max_len, dropout_p, scale,
                                                              causal=causal)
            ctx.save_for_backward(q, k, v, out, lse, cu, rng)
            ctx.args = (max_len, max_len, dropout_p, scale, causal, -1, -1, 0.0)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse, cu, rng = ctx.saved_tensors
            dqkv = torch.empty(q.shape[:-2] + (3, *q.shape[-2:]), dtype=q.dtype, device=q.device)
            ops._flash_attn_varlen_backward(dout, q, k, v, out, lse, dqkv[:, 0], dqkv[:, 1], dqkv[:, 2], cu, cu, *ctx.args,
                                            None, False, rng_state=rng)
            return dqkv, None, None, None, None, None

    class FlashAttnVarlenKVPackedFunc(torch.autograd.Function):
        """flash-attn's K/V-packed form: k, v as views of one [T, 2, H_kv, D] input."""

        @staticmethod
        def forward(ctx, q, kv, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal):
            scale = q.shape[-1] ** -0.5 if scale is None else scale
            k, v = kv[:, 0].detach(), kv[:, 1].detach()
            out, lse, _, rng = ops._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale,
                                                              causal=causal)
            ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng)
            ctx.args = (max_q, max_k, dropout_p, scale, causal, -1, -1, 0.0)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse, cu_q, cu_k, rng = ctx.saved_tensors
            dq = torch.empty_like(q)
            dkv = torch.empty(k.shape[:-2] + (2, *k.shape[-2:]), dtype=k.dtype, device=k.device)
            ops._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dkv[:, 0], dkv[:, 1], cu_q, cu_k, *ctx.args,
                                            None, False, rng_state=rng)
            return dq, dkv, None, None, None, None, None, None, None

    def qkvpacked(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False):
        return FlashAttnVarlenQKVPackedFunc.apply(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal)

    def kvpacked(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                 causal=False):
        return FlashAttnVarlenKVPackedFunc.apply(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                                 softmax_scale, causal)

    # Deliberate function attributes (flash_attn_style reaches the packed forms through the function):
    flash_attn_varlen_func.lib = lib  # type: ignore[attr-defined]  # the registrations live as long as the function
    flash_attn_varlen_func.qkvpacked = qkvpacked  # type: ignore[attr-defined]
    flash_attn_varlen_func.kvpacked = kvpacked  # type: ignore[attr-defined]
    _flash_attn_made[namespace] = flash_attn_varlen_func
    return flash_attn_varlen_func


def flash_attn_style(q, k, v, cu, max_len, causal=True, namespace="flash_attn"):
    """A program calling flash-attn's ``flash_attn_varlen_func`` on the pack, GQA as is. ``cu``
    goes in as a copy for the keys: torch 2.13's Dynamo breaks the graph where one tensor fills
    two inputs of an autograd.Function (torch 2.11's does not). ``flash_attn_like(namespace)``
    must have run before compiling."""
    return _flash_attn_made[namespace](q, k, v, cu, cu.clone(), max_len, max_len, causal=causal)


def flash_attn_packed_style(q, k, v, cu, max_len, causal=True, namespace="flash_attn"):
    """A program calling flash-attn's packed forms on the pack, as projects whose projection
    writes q, k, v into one tensor do: ``flash_attn_varlen_qkvpacked_func`` on [T, 3, H, D] when
    the heads agree, ``flash_attn_varlen_kvpacked_func`` on q and [T, 2, H_kv, D] (GQA)
    otherwise. ``flash_attn_like(namespace)`` must have run before compiling."""
    made = _flash_attn_made[namespace]
    if q.shape[1] == k.shape[1]:
        return made.qkvpacked(torch.stack([q, k, v], dim=1), cu, max_len, causal=causal)
    return made.kvpacked(q, torch.stack([k, v], dim=1), cu, cu.clone(), max_len, max_len, causal=causal)


def ulysses_thd(q, k, v, cu, max_len, causal=True, group=None, attention="varlen_attn"):
    """DeepSpeed ALST's Ulysses over a pack: this rank holds T/cp tokens with every head; one
    all-to-all per tensor gives it every token of its H/cp heads, varlen attention runs over the
    whole pack with the global cu_seqlens, and the output goes back the same way. GQA: K/V heads
    repeated after the all-to-all, as torchtitan feeds varlen_attn; ``attention="flash_attn"``:
    flash-attn's ``flash_attn_varlen_func`` (as ALST calls it), GQA as is."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.nn.attention.varlen import varlen_attn

    group = group if group is not None else dist.group.WORLD
    cp = dist.get_world_size(group)

    def gather_tokens(x):  # [T/cp, H, D] -> [T, H/cp, D]: tokens in rank order
        t, h, d = x.shape
        send = x.reshape(t, cp, h // cp, d).transpose(0, 1).contiguous()  # [destination, T/cp, H/cp, D]
        return funcol.all_to_all_single(send, None, None, group).reshape(cp * t, h // cp, d)

    def scatter_tokens(x):  # [T, H/cp, D] -> [T/cp, H, D]
        t, h, d = x.shape
        got = funcol.all_to_all_single(x.reshape(cp, t // cp, h, d).contiguous(), None, None, group)
        return got.permute(1, 0, 2, 3).reshape(t // cp, cp * h, d)  # [T/cp, (source rank, H/cp), D]

    window = (-1, 0) if causal else (-1, -1)
    q, k, v = gather_tokens(q), gather_tokens(k), gather_tokens(v)
    if attention == "flash_attn":
        return scatter_tokens(flash_attn_style(q, k, v, cu, max_len, causal))
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return scatter_tokens(varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=window))


def check_ulysses_thd(rank, cp, lengths, heads_q, heads_kv, causal, on_reference_op, device="cpu",
                      dtype=torch.float32, more_lengths=(), mode=None, attention="varlen_attn"):
    """One rank: ``ulysses_thd`` compiled with cp_inductor (and run eagerly) against per-sequence
    fp64 SDPA on the whole pack, for the output and every gradient of this rank's tokens.
    ``on_reference_op`` (CPU): varlen attention lowered to cp_inductor's op, its CPU reference
    standing in for cuDNN, else torch's varlen op on the tests' CPU kernels. ``more_lengths``:
    further packs of the same token count, new lengths each step, through the same compiled
    program. ``attention``: as ``ulysses_thd``'s. Returns per pack (errors, eager's errors), then
    the regions and varlen lines."""
    import contextlib

    import cp_inductor
    from cp_inductor.lowerings.varlen_attention import reference_kernels

    register_cpu_kernels()
    if attention == "flash_attn":
        flash_attn_like()  # its ops, registered before compiling
    if device == "cuda":
        torch.cuda.set_device(rank)
    torch._dynamo.reset()
    cp_inductor.clear_report()
    compiled = None
    results = []
    for step, pack_lengths in enumerate([lengths, *more_lengths]):
        q, k, v, cu, max_len = pack(pack_lengths, heads_q, heads_kv, 16 if device == "cpu" else 128, seed=step + len(lengths))
        tokens = q.shape[0] // cp
        mine = slice(rank * tokens, (rank + 1) * tokens)
        grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(step + 1))
        full = [t.double().requires_grad_() for t in (q, k, v)]
        want = sequence_reference(*full, cu, causal)
        want = (want, *torch.autograd.grad(want, full, grad.double()))
        cu_dev, bound = cu.to(device), sum(lengths)  # one bound for every pack: no recompile for it

        def program(a, b, c, cu):
            return ulysses_thd(a, b, c, cu, bound, causal, attention=attention)

        if compiled is None:
            # small packs on purpose: the cost model would keep them on flash-2 on GPUs (under
            # CUDA graphs the call stays flash-2 anyway; torch.compile takes a mode or options)
            options = None if mode else {"cp_inductor.varlen_cudnn_min_size": 0}
            compiled = torch.compile(program, backend="cp_inductor", fullgraph=True, mode=mode, options=options)

        def run(fn):
            local = [t[mine].to(device, dtype).requires_grad_() for t in (q, k, v)]
            out = fn(*local, cu_dev)
            got = (out, *torch.autograd.grad(out, local, grad[mine].to(device, dtype)))
            return {name: float((a.detach().double().cpu() - b[mine].detach()).norm() / b[mine].detach().norm())
                    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}

        with reference_kernels() if on_reference_op else contextlib.nullcontext():
            results.append((run(compiled), run(program) if device == "cuda" else None))
    report = cp_inductor.report()
    regions = sorted((r.graph_kind, r.layout, tuple(r.applied)) for r in report.regions)  # per compiled graph
    torch._dynamo.reset()
    return results, regions, [r.line() for r in report.varlen]


def chunk_plan(lengths, rank: int, cp: int, causal: bool = True) -> list[dict]:
    """What a Llama 3-style data loader computes on the host for ``allgather_thd``: the pack cut
    into 2*cp equal chunks, rank r holding chunks r and 2cp-1-r; per local chunk, its queries'
    documents (cu_seqlens over the chunk) and the stretch of the pack its keys come from (the first
    piece's document start to the chunk's end, causal, or to the last piece's document end), with
    cu_seqlens over that stretch. ``sum(lengths)`` must divide by 2*cp."""
    total, n = sum(lengths), 2 * cp
    assert total % n == 0, "the hand-written form pads the pack to a multiple of 2*cp"
    size = total // n
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    docs = list(zip(starts, starts[1:]))
    plan = []
    for c in (rank, n - 1 - rank):
        lo, hi = c * size, (c + 1) * size
        pieces = [(a, b) for a, b in docs if max(a, lo) < min(b, hi)]
        key_lo = pieces[0][0]
        key_ends = [min(b, hi) if causal else b for _, b in pieces]
        cu_q = [0, *[min(b, hi) - lo for _, b in pieces]]
        cu_k = [0, *[e - key_lo for e in key_ends]]
        plan.append({
            "key_lo": key_lo, "key_hi": key_ends[-1],
            "cu_q": torch.tensor(cu_q, dtype=torch.int32), "cu_k": torch.tensor(cu_k, dtype=torch.int32),
            "max_q": max(b - a for a, b in zip(cu_q, cu_q[1:])), "max_k": max(b - a for a, b in zip(cu_k, cu_k[1:])),
        })
    return plan


def allgather_thd(q, k, v, plan, causal=True, group=None, gather="funcol_dim0", keys="slice",
                  attention="varlen_attn"):
    """K/V all-gather CP over a pack as Llama 3-style code writes it by hand: this rank holds
    chunks r and 2cp-1-r of the pack (``[2 * C, H, D]``); K and V all-gathered, put back in pack
    order (first halves in rank order, then the second halves reversed), and one varlen_attn per
    local chunk over its keys' stretch of the pack (a slice: cu_seq_k != cu_seq_q, bottom-right
    causal), K/V heads repeated for GQA as torchtitan feeds varlen_attn. ``gather``: as
    ``allgather_programs.gather_seq``'s (functional with autograd, in place into a tensor or a
    list inside an autograd.Function). ``keys``: each chunk's K/V as a slice (a view) or by
    ``index_select`` (a copy); ``attention``: torch's varlen_attn, flash-attn's
    ``flash_attn_varlen_func`` (GQA as is; ``flash_attn_like()`` must have run) or aten's flash
    forward called on the chunk ("aten_flash", CUDA only in eager)."""
    import torch.distributed as dist
    from allgather_programs import gather_seq
    from torch.nn.attention.varlen import varlen_attn

    group = group if group is not None else dist.group.WORLD
    cp = dist.get_world_size(group)
    chunk = q.shape[0] // 2

    def to_pack_order(x):
        g = gather_seq(x, 0, gather)
        g = g.view(cp, 2, chunk, *x.shape[1:])
        return torch.cat([g[:, 0].reshape(-1, *x.shape[1:]), g[:, 1].flip(0).reshape(-1, *x.shape[1:])])

    k_pack, v_pack = to_pack_order(k), to_pack_order(v)
    groups = q.shape[1] // k.shape[1]
    window = (-1, 0) if causal else (-1, -1)
    outs = []
    for i, p in enumerate(plan):
        if keys == "slice":
            kc, vc = (t[p["key_lo"]:p["key_hi"]] for t in (k_pack, v_pack))
        else:
            rows = torch.arange(p["key_lo"], p["key_hi"], device=q.device)
            kc, vc = (t.index_select(0, rows) for t in (k_pack, v_pack))
        cu_q, cu_k = p["cu_q"].to(q.device), p["cu_k"].to(q.device)
        qc = q[i * chunk:(i + 1) * chunk]
        if attention == "flash_attn":
            outs.append(_flash_attn_made["flash_attn"](qc, kc, vc, cu_q, cu_k, p["max_q"], p["max_k"], causal=causal))
            continue
        if attention == "aten_flash":  # nested-jagged SDPA's route, GQA as is
            outs.append(torch.ops.aten._flash_attention_forward(qc, kc, vc, cu_q, cu_k, p["max_q"], p["max_k"], 0.0,
                                                                causal, False)[0])
            continue
        if groups > 1:
            kc, vc = (t.repeat_interleave(groups, dim=1) for t in (kc, vc))
        outs.append(varlen_attn(qc, kc, vc, cu_q, cu_k, p["max_q"], p["max_k"], window_size=window))
    return torch.cat(outs)
