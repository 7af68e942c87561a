"""What every op built on the cuDNN frontend's graph API shares: one handle per device bound to
torch's current stream, and a built graph's executor called with raw device pointers.

The ops (``cudnn_backward``: dense attention backward; ``cudnn_ragged``: packed-sequence
attention) build their graphs on first use, allocate every buffer from torch's caching
allocator and run on torch's current stream without syncing, so compiled code and CUDA-graph
captures see them as any other kernel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

_handles: dict[int, object] = {}
# the stream each handle was last bound to: re-binding is skipped while it stays the same
_bound_streams: dict[int, int] = {}


def handle(device_index: int):
    """This device's cuDNN handle, bound to torch's current stream."""
    import cudnn

    h = _handles.get(device_index)
    if h is None:
        with torch.cuda.device(device_index):
            h = _handles[device_index] = cudnn.create_handle()
    # the raw-stream query Inductor's generated code uses: a C call, no Stream object
    stream = torch._C._cuda_getCurrentRawStream(device_index)
    if _bound_streams.get(device_index) != stream:
        cudnn.set_stream(handle=h, stream=stream)
        _bound_streams[device_index] = stream
    return h


@dataclasses.dataclass(frozen=True)
class Plan:
    graph: Any  # the frontend's built pygraph
    workspace_bytes: int
    uids: tuple  # the order ``run`` takes its buffers in
    # The built graph's C++ executor, called with raw device pointers: it skips the frontend's
    # per-call buffer inspection (about 5 us), safe because the plan key fixes every shape and
    # stride. None where this frontend release lacks it: the public ``execute`` then runs.
    raw_execute: Callable | None
    backend_handle: object | None

    def run(self, buffers, device: torch.device, h) -> None:
        workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=device)
        if self.raw_execute is not None:
            pack = {uid: t.data_ptr() for uid, t in zip(self.uids, buffers)}
            self.raw_execute(pack, workspace.data_ptr(), self.backend_handle, None, None, None)
        else:
            self.graph.execute(list(buffers), workspace, handle=h, tensor_uids=self.uids)


def finish(graph, h, uids: tuple) -> Plan:
    """Plan the graph (cuDNN's heuristics' first choice that builds) and wrap it."""
    import cudnn

    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    raw_execute, backend_handle = raw_executor(graph, h)
    return Plan(graph, max(graph.get_workspace_size(), 1), tuple(uids), raw_execute, backend_handle)


def raw_executor(graph, h):
    # Private to the frontend (1.32): taken only when every piece is where 1.32 has it.
    try:
        from cudnn._handle import to_backend_handle

        lowered = graph._lowered_graph
        return lowered._execute, to_backend_handle(h)
    except (ImportError, AttributeError, TypeError):
        return None, None


def io_type(dtype: torch.dtype):
    import cudnn

    return {torch.float16: cudnn.data_type.HALF, torch.bfloat16: cudnn.data_type.BFLOAT16}[dtype]


def new_graph(h, dtype: torch.dtype):
    import cudnn

    return cudnn.pygraph(handle=h, io_data_type=io_type(dtype), intermediate_data_type=cudnn.data_type.FLOAT,
                         compute_data_type=cudnn.data_type.FLOAT)


def descriptor_ready(stride: tuple, ptr: int) -> bool:
    """cuDNN's attention descriptors want a unit innermost stride, no broadcast dims and
    16-byte-aligned bases; anything else is copied first."""
    return stride[-1] == 1 and 0 not in stride and ptr % 16 == 0
