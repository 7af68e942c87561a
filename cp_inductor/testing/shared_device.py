"""CP ranks as processes sharing one GPU: gloo joins them, CUDA collectives relay through the host.

One GPU cannot hold an NCCL world of two ranks (NCCL refuses two ranks on one device). Inside
:func:`collectives_through_host` the ``_c10d_functional`` collectives the passes emit (and
``broadcast_``, ``all_reduce_``, ``all_gather_into_tensor_out``) copy a CUDA input to the host,
run gloo's CPU kernel there (the one CPU CI exercises, whatever gloo's CUDA support covers in
the installed torch) and copy the answer back. Slow, but every
rank's attention, shard plans and compiled code run on the GPU as in a real CP world of that
size, so a training step's numerics on the GPU kernels can be checked against the single-device
model on one GPU::

    run_on_ranks(fn, 2, args)            # gloo ranks; in fn:
    with collectives_through_host():
        ...                              # compiled CP steps on torch.device("cuda")

Eager synchronous ``torch.distributed.all_reduce`` calls (the gradient sum, the loss) go
through the host too.
"""

from __future__ import annotations

import contextlib

import torch


def _functional(name: str):
    return getattr(torch.ops._c10d_functional, name).default


def _on_host(name: str, input: torch.Tensor, *args) -> torch.Tensor:
    """The collective's answer for a CUDA ``input``, computed by the host's (gloo) kernel."""
    return torch.ops._c10d_functional.wait_tensor(_functional(name)(input.cpu(), *args)).to(input.device)


def _out_of_place(name: str):
    def relay(input, *args):
        return _on_host(name, input, *args)

    return relay


def _in_place(name: str):
    def relay(input, *args):
        return input.copy_(_on_host(name, input, *args))

    return relay


def _all_gather_into_tensor_out(input, group_size, group_name, *, out):
    return out.copy_(_on_host("all_gather_into_tensor", input, group_size, group_name))


_RELAYS = {
    **{name: _out_of_place(name) for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                                               "all_to_all_single", "broadcast")},
    **{name + "_": _in_place(name) for name in ("all_reduce", "broadcast")},
    "all_gather_into_tensor_out": _all_gather_into_tensor_out,
}


def _eager_all_reduce(all_reduce):
    def relay(tensor, *args, **kwargs):
        if not tensor.is_cuda or kwargs.get("async_op", args[2] if len(args) > 2 else False):
            return all_reduce(tensor, *args, **kwargs)  # an async call keeps gloo's own kernel
        host = tensor.cpu()
        all_reduce(host, *args, **kwargs)
        tensor.copy_(host)
        return None

    return relay


@contextlib.contextmanager
def collectives_through_host():
    """The functional collectives' CUDA kernels, and eager synchronous all-reduces of CUDA
    tensors, replaced by host relays for the duration."""
    from unittest import mock

    import torch.distributed as dist

    from .mirror_group import collective_kernels

    with collective_kernels(_RELAYS, ("CUDA",)), mock.patch.object(dist, "all_reduce", _eager_all_reduce(dist.all_reduce)):
        yield
