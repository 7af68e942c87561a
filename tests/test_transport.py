"""The copy-engine all-to-all ops (lowerings/ce_transport.py) where the transport cannot run:
on gloo they fall back to torch.distributed's all-to-all, bitwise equal, and say why."""

from cp_inductor.lowerings import ce_transport
from cp_inductor.testing.launch import run_on_ranks
from cp_inductor.testing.transport_checks import against_collective


def test_fallback_on_gloo_matches_all_to_all():
    for result in run_on_ranks(against_collective, 2, "cpu"):
        assert result["equal"] == [True, True, True]
        assert result["why_unavailable"] == "copy-engine transport needs CUDA tensors (got cpu)"


class _FakeArea:
    """Stands in for a symmetric-memory area: records its size, allocates nothing."""

    made = 0

    def __init__(self, group_name, capacity):
        _FakeArea.made += 1
        self.capacity = capacity


def test_pool_holds_as_many_areas_as_transfers_in_flight(monkeypatch):
    """The pool's choices, which every rank must make alike: a head_partition-like sequence
    (two incoming transfers in flight, then smaller returns as each is waited) allocates two
    areas once and reuses them; a larger transfer grows a free area instead of adding one."""
    monkeypatch.setattr(ce_transport, "_Area", _FakeArea)
    monkeypatch.setattr(ce_transport.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ce_transport.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(ce_transport.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ce_transport.torch.cuda, "set_device", lambda device: None)  # the helper thread's
    monkeypatch.setattr(ce_transport.dist, "barrier", lambda **kw: None)
    monkeypatch.setattr(ce_transport, "_group", lambda name: None)
    pool = ce_transport._Transport.__new__(ce_transport._Transport)
    pool.group_name, pool.areas, pool.in_flight = "g", [], {}

    def start(slot, nbytes):
        index = pool.take_area(nbytes)
        pool.in_flight[slot] = (None, None, index)
        return index

    chosen = []
    for _ in range(3):  # three steps
        chosen += [start(0, 300), start(1, 300)]  # q,k,v of both groups
        pool.in_flight.pop(0)
        chosen.append(start(2, 100))  # group 0's output, while group 1's input is in flight
        pool.in_flight.pop(1)
        chosen.append(start(3, 100))
        pool.in_flight.pop(2), pool.in_flight.pop(3)
    assert chosen == [0, 1, 0, 1] * 3 and _FakeArea.made == 2
    assert start(0, 1000) == 0 and [a.capacity for a in pool.areas] == [1000, 300] and _FakeArea.made == 3
