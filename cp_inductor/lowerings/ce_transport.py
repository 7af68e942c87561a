"""``cp_inductor::ce_all_to_all_start`` / ``ce_all_to_all_wait``: an equal-split all-to-all whose
data crosses NVLink by the copy engines, synchronized by stream memory operations, so that
crossing needs no SM and travels while attention holds every SM (NCCL's kernels cannot: they
starve until attention ends).

    token = ce_all_to_all_start(x, slot, group)     # returns at once; the pulls are queued
    ...                                             # attention of another head group
    y = ce_all_to_all_wait(token, x, slot, group)   # y[i] = rank i's x[this rank]

the same contract as ``all_to_all_single`` with equal splits on dim 0 (+ ``wait_tensor``), as a
start/wait pair Inductor schedules like its collectives (``x`` is also an argument of the wait,
as Inductor's own collectives keep their input alive until the wait).

``ce_rotate_start(x, dst, src, slot, group)`` is a ring rotation on the same machinery (all of x
staged once for ``dst``, ``src``'s pulled; ``ce_all_to_all_wait`` returns it).

``slot`` names a transfer while it is in flight (the wait finds it by it): transfers in flight
together need different slots. How one transfer moves: it takes a send area in symmetric memory
(``[world, bytes]``: block p is what peer p pulls; areas are pooled, see ``_Transport``), which
has two flag words per peer on every rank; per process group one side stream::

    main stream:  per peer p: wait consumed[p] == 1, set it 0   # p pulled our previous transfer
                              copy x[p] -> area[p]                (local copy, HBM speed)
                              write 1 into p's ready[this rank]   (stream write; it fences)
                  copy x[this rank] -> y[this rank]
    side stream:  (after the main stream's work so far: y's memory is free)
                  per peer p: wait ready[p] == 1, set it 0      # p's block is staged
                              copy p's area[this rank] -> y[p]    (copy engine, over NVLink)
                              write 1 into p's consumed[this rank]
    the wait:     the main stream waits for the side stream

Only the NVLink crossing runs on the side stream: a same-device copy is an SM kernel inside
the driver, which would starve behind attention like NCCL does (measured, README), so the two
local copies run on the main stream at the start, at HBM speed.

Flags go 0 -> 1 -> 0 (ready) and 1 -> 0 -> 1 (consumed) within one transfer, so every transfer
leaves them as it found them: back-to-back steps and CUDA-graph replays (the stream memory
operations are captured as graph nodes, with their constant values) need no epochs. Nothing is
read before its writer has written (ready), nothing is overwritten before its reader has read
(consumed).

Send areas are allocated (a collective rendezvous) when more transfers are in flight than
areas exist, or grown when a larger one comes; that has to happen before CUDA-graph capture
(cudagraph trees run the graph eagerly first, which does it). Where the transport cannot run (:func:`why_unavailable`:
not CUDA, not NCCL, no symmetric memory, no ``cuda-bindings``, ranks without peer access) the
ops do the same all-to-all through ``torch.distributed`` at the start, so graphs that use them
still run, and the rewrite that emits them reports the reason instead.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .outside_graph_pool import outside_graph_pool

_FLAG_BYTES = 4
_READY, _CONSUMED = 0, 1


def _driver():
    from cuda.bindings import driver

    return driver


def _group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


@functools.lru_cache(maxsize=None)
def why_unavailable(group_name: str, device_type: str) -> str | None:
    """Why the copy-engine transport cannot run on this group and device, or None."""
    if device_type != "cuda":
        return f"copy-engine transport needs CUDA tensors (got {device_type})"
    group = _group(group_name)
    backend = dist.get_backend(group)
    if backend != "nccl":
        return f"copy-engine transport needs an NCCL process group (got {backend})"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as error:
        return f"symmetric memory unavailable ({error})"
    try:
        _driver()
    except ImportError:
        return "cuda-bindings is not installed (pip install 'cp_inductor[transport]')"
    world = group.size()
    local = torch.cuda.device_count()
    ranks = dist.get_process_group_ranks(group)
    if dist.get_world_size() > local or max(ranks) >= local:
        return "copy-engine transport needs every rank of the group on one host"
    me = torch.cuda.current_device()
    for peer in range(world):
        device = ranks[peer] % local
        if device != me and not torch.cuda.can_device_access_peer(me, device):
            return f"GPU {me} has no peer access to GPU {device}"
    return None


class _Area:
    """One send area on every rank of a group: ``[world, capacity]`` bytes, then the
    flags ``[2, world]`` int32 (ready[src], consumed[dst]); and the handles to reach the peers'."""

    def __init__(self, group_name: str, capacity: int):
        from torch.distributed import _symmetric_memory as symm

        capacity = -(-capacity // 256) * 256  # every block 256-byte aligned
        group = _group(group_name)
        self.rank, self.world, self.capacity = group.rank(), group.size(), capacity
        self.flags_offset = self.world * capacity
        nbytes = self.flags_offset + 2 * self.world * _FLAG_BYTES
        self.buffer = symm.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        flags = self.buffer[self.flags_offset:].view(torch.int32).view(2, self.world)
        flags[_READY].zero_()
        flags[_CONSUMED].fill_(1)
        self.handle = symm.rendezvous(self.buffer, group_name)
        self.ptrs = list(self.handle.buffer_ptrs)
        local = torch.cuda.device_count()
        self.devices = [r % local for r in dist.get_process_group_ranks(group)]
        self.blocks: dict[tuple, torch.Tensor] = {}
        torch.cuda.synchronize()
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])

    def device(self, rank: int) -> int:
        """The local CUDA device index that holds ``rank``'s memory."""
        return self.devices[rank]

    def flag(self, owner: int, kind: int, peer: int) -> int:
        """Address of ``owner``'s flag ``kind`` about ``peer``."""
        return self.ptrs[owner] + self.flags_offset + (kind * self.world + peer) * _FLAG_BYTES

    def span(self, owner: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[0, nbytes)`` of ``owner``'s whole area (a rotation stages one tensor there)."""
        key = (owner, None)
        if key not in self.blocks:
            self.blocks[key] = self.handle.get_buffer(owner, (self.world * self.capacity,), torch.uint8, 0)
        return self.blocks[key][:nbytes]

    def block(self, owner: int, dst: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[0, nbytes)`` of ``owner``'s area staged for ``dst``."""
        key = (owner, dst)
        if key not in self.blocks:
            self.blocks[key] = self.handle.get_buffer(owner, (self.capacity,), torch.uint8, dst * self.capacity)
        return self.blocks[key][:nbytes]


class _Transport:
    """Per process group: the side stream, a pool of send areas, and what each transfer in
    flight (by its ``slot``) will return.

    A transfer takes the first area not in flight that is large enough (else grows a free one
    or adds one): the pool holds as many areas as transfers are ever in flight together, each
    as large as the largest it carried. Every rank runs the same starts and waits in the same
    order (one program), so every rank makes the same choices and the k-th transfer through an
    area on one rank meets the k-th on the others; the flags order any two transfers through one
    area, also across CUDA-graph replays and eager calls in between."""

    def __init__(self, group_name: str):
        self.group_name = group_name
        self.stream = torch.cuda.Stream(priority=-1)
        self.areas: list[_Area] = []
        # slot -> (result, event the side stream records when done, index of the area it uses)
        self.in_flight: dict[int, tuple[torch.Tensor, torch.cuda.Event, int]] = {}

    def take_area(self, nbytes: int) -> int:
        busy = {index for _, _, index in self.in_flight.values()}
        free = [i for i in range(len(self.areas)) if i not in busy]
        fitting = [i for i in free if self.areas[i].capacity >= nbytes]
        if fitting:
            return fitting[0]
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"ce_all_to_all needs a {nbytes}-byte send area that is not allocated yet: "
                "run the step once before CUDA-graph capture"
            )
        if free:
            # Grow a free area; peers may still pull from it: let every rank finish first.
            index = free[0]
            torch.cuda.synchronize()
            outside_graph_pool(dist.barrier, group=_group(self.group_name), device_ids=[torch.cuda.current_device()])
            self.areas[index] = outside_graph_pool(_Area, self.group_name, nbytes)
            return index
        self.areas.append(outside_graph_pool(_Area, self.group_name, nbytes))
        return len(self.areas) - 1

    def start(self, x: torch.Tensor, slot: int) -> None:
        if slot in self.in_flight:
            raise RuntimeError(f"ce_all_to_all slot {slot} started twice without a wait")
        world = _group(self.group_name).size()
        flat = x.contiguous().view(-1).view(torch.uint8).view(world, -1)
        nbytes = flat.shape[1]
        index = self.take_area(nbytes)
        area = self.areas[index]
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        out_blocks = out.view(-1).view(torch.uint8).view(world, -1)
        me, driver = area.rank, _driver()
        peers = [(me + i) % world for i in range(1, world)]
        on_main = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        for p in peers:
            _wait_value(driver, on_main, area.flag(me, _CONSUMED, p), 1)
            _write_value(driver, on_main, area.flag(me, _CONSUMED, p), 0)
            area.block(me, p, nbytes).copy_(flat[p])
            _write_value(driver, on_main, area.flag(p, _READY, me), 1)
        out_blocks[me].copy_(flat[me])
        self._pull(slot, out, index, [(p, out_blocks[p], area.block(p, me, nbytes)) for p in peers])

    def start_rotation(self, x: torch.Tensor, dst: int, src: int, slot: int) -> None:
        """Send all of ``x`` to rank ``dst`` and receive ``src``'s into a tensor like it: one
        staged copy in the whole area, one pull, the same flags as the all-to-all."""
        if slot in self.in_flight:
            raise RuntimeError(f"ce transfer slot {slot} started twice without a wait")
        flat = x.contiguous().view(-1).view(torch.uint8)
        nbytes = flat.numel()
        world = _group(self.group_name).size()
        index = self.take_area(-(-nbytes // world))
        area = self.areas[index]
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        me, driver = area.rank, _driver()
        on_main = driver.CUstream(torch.cuda.current_stream().cuda_stream)
        # The area's previous transfer may have gone to other peers (a pooled area, rotations
        # in the other direction): every reader must be done before it is overwritten.
        for p in range(world):
            if p != me:
                _wait_value(driver, on_main, area.flag(me, _CONSUMED, p), 1)
        _write_value(driver, on_main, area.flag(me, _CONSUMED, dst), 0)
        area.span(me, nbytes).copy_(flat)
        _write_value(driver, on_main, area.flag(dst, _READY, me), 1)
        self._pull(slot, out, index, [(src, out.view(-1).view(torch.uint8), area.span(src, nbytes))])

    def _pull(self, slot: int, out: torch.Tensor, index: int, pulls: list) -> None:
        """On the side stream, after the main stream's work so far (``out``'s memory is free):
        per (peer, destination bytes, peer's staged bytes), wait until the peer has staged its
        block, pull it by a copy engine, tell the peer it was read. ``slot`` holds the transfer
        until its wait."""
        area, driver, side = self.areas[index], _driver(), self.stream
        side.wait_stream(torch.cuda.current_stream())
        on_side = driver.CUstream(side.cuda_stream)
        with torch.cuda.stream(side):
            for peer, dst, src in pulls:
                _wait_value(driver, on_side, area.flag(area.rank, _READY, peer), 1)
                _write_value(driver, on_side, area.flag(area.rank, _READY, peer), 0)
                _engine_copy(driver, on_side, dst, src, area.device(peer))
                _write_value(driver, on_side, area.flag(peer, _CONSUMED, area.rank), 1)
            done = torch.cuda.Event()
            done.record(side)
        self.in_flight[slot] = (out, done, index)

    def wait(self, slot: int) -> torch.Tensor:
        out, done, _ = self.in_flight.pop(slot)
        torch.cuda.current_stream().wait_event(done)
        return out


def _check(result) -> None:
    error = result[0] if isinstance(result, tuple) else result
    if int(error) != 0:
        raise RuntimeError(f"CUDA driver error {error}")


def _wait_value(driver, stream, address: int, value: int) -> None:
    _check(driver.cuStreamWaitValue32(
        stream, driver.CUdeviceptr(address), driver.cuuint32_t(value),
        driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ,
    ))


def _engine_copy(driver, stream, dst: torch.Tensor, src: torch.Tensor, src_device: int) -> None:
    """``dst.copy_(src)`` (contiguous bytes, src on a peer GPU) by a copy engine: a plain
    ``cudaMemcpyAsync`` may run as a driver kernel, which would starve behind attention.
    Under CUDA-graph capture (where the batch copy is not captured) a plain copy."""
    if torch.cuda.is_current_stream_capturing():
        dst.copy_(src)
        return
    _check(driver.cuMemcpyBatchAsync(
        [driver.CUdeviceptr(dst.data_ptr())], [driver.CUdeviceptr(src.data_ptr())], [dst.numel() * dst.element_size()],
        1, [_copy_attributes(driver, src_device, dst.device.index)], [0], 1, stream,
    ))


@functools.lru_cache(maxsize=None)
def _copy_attributes(driver, src_device: int, dst_device: int):
    attrs = driver.CUmemcpyAttributes()
    attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attrs.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
    attrs.srcLocHint.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    attrs.srcLocHint.id = src_device
    attrs.dstLocHint.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    attrs.dstLocHint.id = dst_device
    return attrs


def _write_value(driver, stream, address: int, value: int) -> None:
    _check(driver.cuStreamWriteValue32(
        stream, driver.CUdeviceptr(address), driver.cuuint32_t(value),
        driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
    ))


_TRANSPORTS: dict[tuple[str, int], _Transport] = {}
_FALLBACK_RESULTS: dict[tuple[str, int], torch.Tensor] = {}


def _transport(group_name: str) -> _Transport:
    key = (group_name, torch.cuda.current_device())
    if key not in _TRANSPORTS:
        _TRANSPORTS[key] = _Transport(group_name)
    return _TRANSPORTS[key]


def release() -> None:
    """Drop every send area (before destroying the process groups)."""
    if _TRANSPORTS:
        torch.cuda.synchronize()
    _TRANSPORTS.clear()
    _FALLBACK_RESULTS.clear()


def _fallback_start(x: torch.Tensor, slot: int, group_name: str, out_splits=None, in_splits=None) -> None:
    """Where the copy engines cannot run: the same exchange through torch.distributed, now;
    the wait hands it out."""
    key = (group_name, slot)
    if key in _FALLBACK_RESULTS:
        raise RuntimeError(f"ce transfer slot {slot} started twice without a wait")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=_group(group_name))
    _FALLBACK_RESULTS[key] = out


@torch.library.custom_op("cp_inductor::ce_all_to_all_start", mutates_args=())
def ce_all_to_all_start(x: torch.Tensor, slot: int, group_name: str) -> torch.Tensor:
    """Queue the all-to-all of ``x`` (equal split on dim 0) on ``slot``; returns a token."""
    if why_unavailable(group_name, x.device.type) is None:
        _transport(group_name).start(x, slot)
    else:
        _fallback_start(x, slot, group_name)
    return x.new_empty(0)


@ce_all_to_all_start.register_fake
def _(x, slot, group_name):
    return x.new_empty(0)


@torch.library.custom_op("cp_inductor::ce_rotate_start", mutates_args=())
def ce_rotate_start(x: torch.Tensor, dst: int, src: int, slot: int, group_name: str) -> torch.Tensor:
    """Queue sending all of ``x`` to group rank ``dst`` and receiving ``src``'s (a ring
    rotation) on ``slot``; returns a token. ``ce_all_to_all_wait`` returns the result."""
    if why_unavailable(group_name, x.device.type) is None:
        _transport(group_name).start_rotation(x, dst, src, slot)
    else:
        one_hot = lambda rank: [x.shape[0] if r == rank else 0 for r in range(_group(group_name).size())]  # noqa: E731
        _fallback_start(x, slot, group_name, one_hot(src), one_hot(dst))
    return x.new_empty(0)


@ce_rotate_start.register_fake
def _(x, dst, src, slot, group_name):
    return x.new_empty(0)


@torch.library.custom_op("cp_inductor::ce_all_to_all_wait", mutates_args=())
def ce_all_to_all_wait(token: torch.Tensor, x: torch.Tensor, slot: int, group_name: str) -> torch.Tensor:
    """The result of ``slot``'s transfer (all-to-all or rotation), once it has arrived (the main
    stream waits for it)."""
    if why_unavailable(group_name, x.device.type) is None:
        return _transport(group_name).wait(slot)
    return _FALLBACK_RESULTS.pop((group_name, slot))


@ce_all_to_all_wait.register_fake
def _(token, x, slot, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# A transfer is a collective: every rank takes part whether or not its own result is read (a rank
# may receive data it does not use, native CP causal without load balance), so neither FX's nor
# Inductor's dead-code elimination may drop it (they keep ops registered here).
for _op in (ce_all_to_all_start, ce_rotate_start, ce_all_to_all_wait):
    torch.fx.node.has_side_effect(_op._opoverload)
