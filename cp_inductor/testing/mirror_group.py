"""One process playing ``world_size`` ranks that all hold this rank's data.

PyTorch's fake group moves nothing (its collectives leave their outputs uninitialized), so one
rank's compute on it cannot be checked against anything. In a mirrored world every rank holds the
same tensors, so each collective has one defined answer computable from this process alone:

    all_to_all_single:       chunk r of the output = chunk ``rank`` of the input (rank r sent it)
    all_gather_into_tensor:  every chunk of the output = the input
    reduce_scatter_tensor:   chunk ``rank`` of the input, times world_size for a sum

That is a real CP world (one whose ranks happen to share their shards), so a program's eager run
on it is the reference for its compiled run on it: one GPU checks one rank's numerics with every
shape, layout and rewrite of a real cp-rank run.

The world is PyTorch's fake group with the functional collectives' CPU and CUDA kernels replaced
for the duration (eager calls and Inductor's generated code both reach them): equal splits only,
sums and averages only.

    with mirrored_world(2):
        ...  # torch.distributed calls see world_size 2, rank 0
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def _group(group_name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group_name)
    return pg.rank(), pg.size()


def _all_to_all_single(input, output_split_sizes, input_split_sizes, group_name):
    for splits in (output_split_sizes, input_split_sizes):
        if splits and len(set(splits)) > 1:
            raise NotImplementedError("the mirrored world takes equal splits only")
    rank, size = _group(group_name)
    return torch.cat([input.chunk(size)[rank]] * size)


def _all_gather_into_tensor(input, group_size, group_name):
    return torch.cat([input] * group_size)


def _reduce_scatter_tensor(input, reduce_op, group_size, group_name):
    rank, _ = _group(group_name)
    mine = input.chunk(group_size)[rank].clone()
    if reduce_op.lower() == "sum":
        return mine * group_size
    if reduce_op.lower() == "avg":
        return mine
    raise NotImplementedError(f"the mirrored world reduces by sum or avg, not {reduce_op}")


_KERNELS = {
    "all_to_all_single": _all_to_all_single,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
}


@contextlib.contextmanager
def collective_kernels(kernels: dict, keys: tuple[str, ...]):
    """The ``_c10d_functional`` ops named in ``kernels`` run those kernels for the dispatch
    ``keys`` for the duration (eager calls and Inductor's generated code both reach them)."""
    import warnings

    lib = torch.library.Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": meant
        for name, kernel in kernels.items():
            for key in keys:
                lib.impl(name, kernel, key)
    try:
        yield
    finally:
        torch._dynamo.reset()  # compiled code holding the replaced kernels goes with them
        lib._destroy()


@contextlib.contextmanager
def mirrored_world(world_size: int, rank: int = 0):
    """The default process group plays rank ``rank`` of ``world_size`` mirrored ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with collective_kernels(_KERNELS, ("CPU", "CUDA")):
            yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
