"""``cp_inductor::cudnn_attention_backward``: cuDNN's attention backward built with the cuDNN
frontend's graph API, under a plan cache of our own that keys on every operand's layout.

    dq, dk, dv = cudnn_attention_backward(dO, q, k, v, O, lse, scale, is_causal)

takes exactly what ``aten._scaled_dot_product_cudnn_attention_backward`` takes from aten's cuDNN
forward (O and its log-sum-exp, no dropout, no bias) and returns the same gradients, laid out
like q, k and v.

Why it exists: aten's cuDNN backward (torch 2.11 through 2.13) caches the cuDNN graph it builds
under a key of q, k and v's sizes and strides only, but bakes dO's strides into that graph. In
one process, a second backward with the same q, k, v and a dO laid out otherwise reuses the
first plan and silently reads dO with the wrong strides (``tests/test_gpu_one.py`` reproduces
it in eager). torch 2.14's aten carries the O, dO and log-sum-exp layouts in the key. The cuDNN
frontend (``pip install "cp_inductor[cudnn]"``, package ``nvidia-cudnn-frontend``) builds the
same cuDNN node; our cache keys on every stride and lives apart from aten's, so a call through it
can neither be hit by nor leave behind a wrong plan for eager or default-Inductor code in the
same process. dO keeps the layout the program made (no copy into O's layout), and the graph is
driven directly rather than through the frontend's ``torch.ops.cudnn.sdpa_bwd``, whose two
layers of op dispatch and per-call layout checks cost about 0.08 ms of host time per call.

Compiled code calls the CUDA kernel by name (``extern_kernels.cp_inductor_cudnn_attention_backward``,
see :func:`_install_direct_call`), skipping the dispatcher's trip back into Python.

The frontend is imported on first use; without it :func:`unavailable` says why and callers keep
aten's op. The graph is built on the first call, every buffer comes from torch's caching
allocator, and it runs on torch's current stream without syncing.
"""

from __future__ import annotations

import functools

import torch

from .cudnn_graph import Plan, descriptor_ready, finish, io_type, new_graph
from .cudnn_graph import handle as _handle

aten = torch.ops.aten

# First torch release whose aten cuDNN backward keys its plan cache on O's, dO's and the
# log-sum-exp's layouts (read from the release binaries; 2.11.0, 2.12.x and 2.13.0 lack it).
ATEN_KEY_COMPLETE_FROM = (2, 14)
DTYPES = (torch.float16, torch.bfloat16)


def aten_cache_key_complete() -> bool:
    return torch.torch_version.TorchVersion(torch.__version__) >= ATEN_KEY_COMPLETE_FROM


@functools.cache
def unavailable() -> str | None:
    """Why the cuDNN frontend's backward cannot run in this process, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import cudnn
    except Exception as e:  # noqa: BLE001 - any import failure means: keep aten's op
        return f"nvidia-cudnn-frontend is not importable ({type(e).__name__}: {e}); pip install 'cp_inductor[cudnn]'"
    if not (hasattr(cudnn, "pygraph") and hasattr(cudnn, "diagonal_alignment")):
        return "this nvidia-cudnn-frontend's graph API has no diagonal alignment (1.32 or newer has it)"
    return None


@functools.cache
def frontend_fingerprint() -> str:
    """What :func:`unavailable` depends on, read without importing the frontend: the caches'
    keys ask on every compile, before a restarted job's cache hit, and the frontend's import
    (it loads cuDNN's libraries) is a restart's cost that default Inductor does not pay. The
    same version gives the same answer from :func:`unavailable`."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("cudnn")
    if spec is None:
        return "no cuDNN frontend"
    try:
        return f"nvidia-cudnn-frontend {importlib.metadata.version('nvidia-cudnn-frontend')}"
    except importlib.metadata.PackageNotFoundError:  # installed another way: where it lives
        return f"cudnn at {spec.origin}"


# One cuDNN graph per (dtype, scale, causal, determinism, every operand's shape and strides),
# built on first use.
_plans: dict[tuple, Plan] = {}
_UID = {"q": 1, "k": 2, "v": 3, "o": 4, "do": 5, "stats": 6, "dq": 7, "dk": 8, "dv": 9}
_ORDER = tuple(_UID.values())


def _build(handle, tensors: dict, scale: float, is_causal: bool, deterministic: bool) -> Plan:
    """The frontend's graph for one signature: dO keeps its own strides (cuDNN reads any dense
    layout), the gradients take the strides of the buffers they will be written to."""
    import cudnn

    io = io_type(tensors["q"].dtype)
    graph = new_graph(handle, tensors["q"].dtype)

    def describe(name, dtype=io):
        t = tensors[name]
        return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=dtype, uid=_UID[name])

    grads = graph.sdpa_backward(
        name="attention_backward", q=describe("q"), k=describe("k"), v=describe("v"), o=describe("o"),
        dO=describe("do"), stats=describe("stats", cudnn.data_type.FLOAT), attn_scale=scale,
        diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
        diagonal_band_right_bound=0 if is_causal else None, use_deterministic_algorithm=deterministic)
    for grad, name in zip(grads, ("dq", "dk", "dv")):
        t = tensors[name]
        grad.set_uid(_UID[name]).set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride())).set_data_type(io)
    return finish(graph, handle, _ORDER)


def _copied_ready(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    if descriptor_ready(t.stride(), t.data_ptr()):
        return t
    if like is not None:  # dO: into O's layout, which is descriptor-ready by now
        return torch.empty_like(like).copy_(t)
    return t.contiguous() if t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def _frontend_backward(grad_out, query, key, value, out, logsumexp, scale, is_causal):
    # Per call this is host work on the critical path of small steps, so it asks each tensor
    # for its strides once: they are both the plan key and the readiness check.
    operands = (query, key, value, out, grad_out)
    strides = tuple(t.stride() for t in operands)
    if not (all(descriptor_ready(s, t.data_ptr()) for s, t in zip(strides, operands)) and logsumexp.is_contiguous()):
        q, k, v, o = (_copied_ready(t) for t in (query, key, value, out))
        return _frontend_backward(_copied_ready(grad_out, like=o), q, k, v, o, logsumexp.contiguous(), scale, is_causal)
    # laid out as the fake promises Inductor: empty_like of the inputs
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    device = query.get_device()
    signature = (query.dtype, device, scale, is_causal, torch.are_deterministic_algorithms_enabled(),
                 query.shape, key.shape, value.shape, strides, dq.stride(), dk.stride(), dv.stride())
    handle = _handle(device)
    plan = _plans.get(signature)
    # [B, H, S, 1] with canonical strides: cuDNN wants the size-1 dim's stride to be 1 too
    stats = logsumexp.view(-1).view(*query.shape[:3], 1) if plan is None or plan.raw_execute is None else logsumexp
    if plan is None:
        tensors = {"q": query, "k": key, "v": value, "o": out, "do": grad_out, "stats": stats,
                   "dq": dq, "dk": dk, "dv": dv}
        plan = _plans[signature] = _build(handle, tensors, scale, is_causal, torch.are_deterministic_algorithms_enabled())
    plan.run((query, key, value, out, grad_out, stats, dq, dk, dv), query.device, handle)
    return dq, dk, dv


# Defined with torch.library's low-level API rather than ``custom_op``: the latter's per-call
# Python checks (aliasing, autograd wrapping) cost about 0.03 ms of host time per call here.
_lib = torch.library.Library("cp_inductor", "FRAGMENT")
_lib.define(
    "cudnn_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, "
    "Tensor logsumexp, float scale, bool is_causal) -> (Tensor, Tensor, Tensor)"
)


@torch.library.register_fake("cp_inductor::cudnn_attention_backward", lib=_lib)
def _(grad_out, query, key, value, out, logsumexp, scale, is_causal):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _cuda_kernel(grad_out, query, key, value, out, logsumexp, scale, is_causal):
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"cp_inductor::cudnn_attention_backward: {reason}")
    return _frontend_backward(grad_out, query, key, value, out, logsumexp, scale, is_causal)


_lib.impl("cudnn_attention_backward", _cuda_kernel, "CUDA")

# What Inductor's generated code calls for the op on CUDA: the kernel itself, from the namespace
# the generated wrapper imports, rather than ``torch.ops.cp_inductor.cudnn_attention_backward``,
# whose trip through the dispatcher and back into Python costs several microseconds per call.
DIRECT_CALL_NAME = "cp_inductor_cudnn_attention_backward"


def _install_direct_call() -> str | None:
    """Wrap Inductor's fallback lowering of the op so that CUDA calls name the kernel directly.
    Returns why not, or None. The layout constraint is the one Inductor gives any custom op."""
    try:
        from torch._inductor import ir, lowering
        from torch._inductor.select_algorithm import extern_kernels
        from torch._inductor.virtualized import V
        from torch._library.utils import get_layout_constraint_tag
    except ImportError as e:
        return f"this Inductor lacks a piece the direct call needs ({e})"
    op = torch.ops.cp_inductor.cudnn_attention_backward.default
    if op not in lowering.lowerings:
        constraint = getattr(lowering, "tag_to_layout_constraint", None)
        if constraint is None:
            return "this Inductor has no tag_to_layout_constraint"
        lowering.make_fallback(op, layout_constraint=constraint(get_layout_constraint_tag(op, with_default=True)))
    fallback = lowering.lowerings[op]
    setattr(extern_kernels, DIRECT_CALL_NAME, _cuda_kernel)

    def lower(*args, **kwargs):
        outputs = fallback(*args, **kwargs)
        kernel = _fallback_kernel_of(outputs, ir)
        if (kernel is not None and kernel.op_overload is op and _direct_call_applies(kernel.get_device())
                and not V.graph.cpp_wrapper and not getattr(V.graph, "fx_wrapper", False)):
            kernel.python_kernel_name = f"extern_kernels.{DIRECT_CALL_NAME}"
        return outputs

    lowering.lowerings[op] = lower
    return None


def _direct_call_applies(device: torch.device) -> bool:
    return device.type == "cuda"  # the kernel named directly is the CUDA one


def _fallback_kernel_of(outputs, ir):
    # TensorBox -> StorageBox -> MultiOutput, whose input is the FallbackKernel
    node = outputs[0] if isinstance(outputs, (list, tuple)) and outputs else None
    while node is not None and not isinstance(node, ir.MultiOutput):
        node = getattr(node, "data", None)
    kernel = node.inputs[0] if node is not None and node.inputs else None
    return kernel if isinstance(kernel, ir.FallbackKernel) else None


direct_call_unavailable = _install_direct_call()


def default_scale(query) -> float:
    return query.shape[-1] ** -0.5


def runs_eagerly_on_frontend(query: torch.Tensor) -> bool:
    """Whether an eager cuDNN backward of ``query``'s kind goes through this op: aten's cache key
    is incomplete in this torch, the frontend runs, the switch is on, the dtype is one it takes."""
    from .. import config

    return (
        config.cudnn_frontend_backward and not aten_cache_key_complete() and query.dim() == 4
        and query.dtype in DTYPES and query.is_cuda and unavailable() is None
    )
