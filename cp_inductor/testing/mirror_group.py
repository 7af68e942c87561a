"""A process group of one process that plays ``world_size`` ranks which all hold this rank's data.

PyTorch's fake group moves nothing (its collectives leave their outputs uninitialized), so one
rank's compute on it cannot be checked against anything. In a mirrored world every rank holds the
same tensors, so an all-to-all has one defined answer computable from this process alone:

    all_to_all_single: chunk r of the output = chunk ``rank`` of the input (rank r sent it)

That is a real CP world (one whose ranks happen to share their shards), so a Ulysses program's
eager run on it is the reference for its compiled run on it: one GPU checks one rank's numerics
with every shape, layout and rewrite of a real cp-rank run. Equal splits only. All-gathers and
reduce-scatters are not served: the functional collectives reach them through a per-device
backend, which a Python process group does not have.

    with mirrored_world(2):
        ...  # torch.distributed calls see world_size 2, rank 0
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

BACKEND = "cp_inductor_mirror"


def _done(result):
    fut = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class MirrorGroup(dist.ProcessGroup):
    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size)
        self._rank, self._world = rank, world_size

    @torch.no_grad()
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        for splits in (output_split_sizes, input_split_sizes):
            if splits and len(set(splits)) > 1:
                raise NotImplementedError("the mirrored group takes equal splits only")
        mine = input.chunk(self._world)[self._rank]
        for chunk in output.chunk(self._world):
            chunk.copy_(mine)
        return _done(output)

    def barrier(self, opts=None):
        return _done(None)

    def size(self):
        return self._world

    @property
    def group_name(self):
        return dist.distributed_c10d._world.pg_names[self]

    def getBackendName(self):
        return BACKEND


def _create(store, rank, world_size, timeout):
    return MirrorGroup(rank, world_size)


if BACKEND not in dist.Backend.backend_list:
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


@contextlib.contextmanager
def mirrored_world(world_size: int, rank: int = 0):
    """The default process group is a :class:`MirrorGroup` for the duration."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield dist.group.WORLD
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()
