"""The package's Triton kernels on the CPU, under Triton's interpreter (a fresh interpreter
with ``TRITON_INTERPRET=1``: Triton reads it when it first builds a kernel)."""

import os
import subprocess
import sys

import pytest
import torch

from cp_inductor.lowerings import document_attention


def _tables(g):
    """(ids, positions) as ``[B, T]`` tables: runs of random lengths, also falling ids (still
    contiguous), ids that recur (not contiguous), positions that fall; one-token rows."""
    for trial in range(24):
        batch, tokens = [(1, 50), (2, 37), (3, 64), (1, 1)][trial % 4]
        ids = torch.repeat_interleave(torch.arange(40), torch.randint(1, 9, (40,), generator=g))[:tokens]
        ids = ids.flip(0) if trial % 3 == 1 else ids % 3 if trial % 5 == 2 else ids
        positions = None if trial % 2 == 0 else torch.arange(tokens)[None].expand(batch, tokens)
        if positions is not None and trial % 7 == 3:
            positions = positions.flip(1)
        yield trial, ids[None].expand(batch, tokens), positions


def compare_document_plans():
    from cp_inductor.lowerings import document_plan_kernel as kernel

    kernel.BLOCK = 16  # several blocks: the carries between them
    outcomes = set()
    for trial, rows, positions in _tables(torch.Generator().manual_seed(0)):
        for check in (True, False):
            cu, meta = kernel.document_plan(rows, positions, check)
            starts, rank, want_cu, longest, contiguous = document_attention._runs(rows, check)
            rising = positions is None or bool(((positions[:, 1:] > positions[:, :-1]) | starts[:, 1:]).all())
            count, most, sure, unsure = meta.tolist()
            assert (count, most) == (int(rank[-1]) + 1, int(longest)), (trial, meta)
            assert torch.equal(cu, want_cu), (trial, cu, want_cu)
            if unsure:  # only checked ids that fall somewhere, with positions that rise: the sort decides
                assert check and rising and not sure and not bool((rows[:, 1:] >= rows[:, :-1]).all()), (trial, meta)
            else:
                assert sure == (rising and bool(contiguous)), (trial, meta)
            outcomes.add((sure, unsure))
    assert outcomes == {(1, 0), (0, 0), (0, 1)}  # contiguous, not, and for the sort to decide
    _compare_bounds(kernel)
    print("document plans match")


def _compare_bounds(kernel):
    """Tables of document starts (ends): the kernel finds them where the aten plan does, and
    not in tables that are something else (a window, bounds one off, ids)."""
    found = set()
    for trial in range(12):
        lengths = torch.randint(3, 9, (20,), generator=torch.Generator().manual_seed(trial))
        first = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)[None, :50].expand(2, 50)
        last = torch.repeat_interleave(torch.cumsum(lengths, 0) - 1, lengths)[None, :50].clamp(max=49).expand(2, 50)
        index = torch.arange(50)[None].expand(2, 50)
        for bounds, table in ((1, first), (2, last), (1, (index - 3).clamp(min=0)), (2, (last - 1).clamp(min=0)),
                              (1, torch.repeat_interleave(torch.arange(20), lengths)[None, :50].expand(2, 50))):
            for check in (True, False):
                _, meta = kernel.document_plan(table, None, check, bounds)
                starts = torch.ones_like(table, dtype=torch.bool)
                starts[:, 1:] = table[:, 1:] != table[:, :-1]
                want = bool(document_attention._runs(table, check)[4]) and bool(document_attention._bounds_hold(table, starts, bounds))
                assert bool(meta[2]) == want and not meta[3], (trial, bounds, table, meta)
                found.add(want)
    assert found == {True, False}


def test_document_plan_kernel_matches_the_aten_plan():
    done = subprocess.run([sys.executable, "-c", "import test_triton_interpret as t; t.compare_document_plans()"],
                          cwd=os.path.dirname(__file__), env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "document plans match" in done.stdout, done.stderr[-3000:]


def _shards(g):
    """(ids, query positions, key positions, what the kernel must do) for shards as torch's
    balancers cut them and odd ones: ``redo`` where it must hand the plan to the aten form."""
    keys = 96
    lengths = torch.randint(1, 30, (20,), generator=g)
    ids = torch.repeat_interleave(torch.arange(20), lengths)[:keys]
    ids = torch.cat([ids, ids.new_full((keys - ids.numel(),), 20)])[None]
    rank1 = torch.arange(keys // 2, keys)[None]
    head_tail = torch.cat([torch.arange(24, 48), torch.arange(48, 72)])[None]
    gathered = torch.cat([torch.arange(0, 24), torch.arange(72, 96), torch.arange(24, 72)])[None]
    blocks = torch.randperm(keys // 8, generator=g)[: keys // 16].sort().values
    ptrr = (blocks[:, None] * 8 + torch.arange(8)).reshape(1, -1)
    shuffled = (torch.randperm(keys // 8, generator=g)[: keys // 16, None] * 8 + torch.arange(8)).reshape(1, -1)
    two_rows = torch.cat([ids, torch.repeat_interleave(torch.arange(3), torch.tensor([10, 50, 36]))[None]])
    yield "one device", ids, None, None, False
    yield "the first half, at its own index", ids, None, torch.randperm(keys, generator=g)[None], False
    yield "no balancer, rank 1", ids, rank1, None, False
    yield "head-tail, keys gathered", ids, head_tail, gathered, False
    yield "blocks, keys permuted", ids, ptrr, torch.randperm(keys, generator=g)[None], False
    yield "per-row shards", two_rows, torch.cat([head_tail, ptrr]), None, False
    yield "per-row shards, per-row keys", two_rows, torch.cat([ptrr, head_tail]), torch.cat([gathered, gathered]), False
    yield "keys repeated (not a permutation)", ids, head_tail, torch.cat([gathered[:, :-1], gathered[:, :1]], 1), False
    yield "positions past the keys", ids, rank1 + 10, torch.cat([gathered[:, :-1], gathered[:, -1:] + 5], 1), False
    yield "ids not contiguous", ids % 3, rank1, None, "checked"
    yield "blocks out of order", ids, shuffled, None, True
    yield "ids that fall", ids.flip(1), head_tail, None, "checked"


def compare_shard_plans():
    from cp_inductor.lowerings import document_shard_plan_kernel as kernel

    kernel.BLOCK = 16  # several blocks: the carries between them
    seen = set()
    for name, ids, qpos, kpos, redo in _shards(torch.Generator().manual_seed(0)):
        batch, keys = ids.shape
        queries = qpos.shape[1] if qpos is not None else keys // 2 if name.startswith("the first half") else keys
        for check in (True, False):
            for causal in (True, False):
                got, meta = kernel.document_shard_plan(ids, qpos, kpos, check, causal, queries)
                want, want_meta = document_attention._shard_plan_aten(ids, qpos, kpos, check, causal, batch, queries, keys)
                must_redo = redo is True or (redo == "checked" and check)
                assert int(meta[5]) == must_redo and int(meta[6]) == 0, (name, check, causal, meta)
                seen.add((name, int(meta[4]), int(meta[5])))
                if must_redo:
                    continue
                assert meta.tolist() == want_meta.tolist(), (name, check, causal, meta, want_meta)
                for i, (a, b) in enumerate(zip(got[:5], want[:5])):
                    assert torch.equal(a, b), (name, check, causal, i, a, b)
                if kpos is not None:
                    assert torch.equal(got[6], want[6]), name
                    if int(meta[4]):
                        assert torch.equal(got[5], want[5]), name
    assert {packable for _, packable, redo in seen if not redo} == {0, 1}, seen
    _compare_shard_bounds(kernel)
    _redo_computes_the_answer()
    print("shard plans match")


def _compare_shard_bounds(kernel):
    """Tables of document starts (ends) as the shard plan's ids: packable where the aten plan says
    so, and the same plan."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 30, (20,), generator=g)
    ends_at = torch.cumsum(lengths, 0)
    starts = torch.repeat_interleave(ends_at - lengths, lengths)[None, :96]
    ends = torch.repeat_interleave(ends_at - 1, lengths)[None, :96].clamp(max=95)
    head_tail = torch.cat([torch.arange(24, 48), torch.arange(48, 72)])[None]
    gathered = torch.cat([torch.arange(0, 24), torch.arange(72, 96), torch.arange(24, 72)])[None]
    packable = set()
    for bounds, table in ((1, starts), (2, ends), (1, (starts - 1).clamp(min=0)), (2, ends + 1)):
        for qpos, kpos in ((None, None), (head_tail, gathered)):
            for check in (True, False):
                queries = 96 if qpos is None else qpos.shape[1]
                got, meta = kernel.document_shard_plan(table, qpos, kpos, check, True, queries, bounds)
                want, want_meta = document_attention._shard_plan_aten(table, qpos, kpos, check, True, 1, queries, 96, bounds)
                assert meta.tolist() == want_meta.tolist(), (bounds, check, meta, want_meta)
                assert all(map(torch.equal, got[:5], want[:5])), bounds
                packable.add(int(meta[4]))
    assert packable == {0, 1}


def _redo_computes_the_answer():
    """Where the kernel asks for a redo, the op computes from the aten plan: output and every
    gradient of the attention as dense attention under the same mask computes them."""
    from cp_inductor.lowerings import document_shard_plan_kernel as kernel
    from cp_inductor.lowerings.varlen_attention import reference_kernels

    for name, ids, qpos, kpos, redo in _shards(torch.Generator().manual_seed(0)):
        if redo is not True:
            continue
        g = torch.Generator().manual_seed(1)
        q = torch.randn(1, 4, qpos.shape[1], 8, dtype=torch.float64, generator=g).requires_grad_()
        k, v = (torch.randn(1, 2, ids.shape[1], 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(2))
        plan, meta = kernel.document_shard_plan(ids, qpos, kpos, False, True, qpos.shape[1])
        # the CPU's reference kernels add up dK/dV of one document's segments in one call, FA4 does
        # not: the rounds the op runs must be the aten plan's
        settled, numbers = document_attention._settled_shard_plan(plan, meta.clone(), ids, qpos, kpos, True, 1,
                                                                  qpos.shape[1], ids.shape[1])
        want, want_numbers = document_attention._shard_plan_aten(ids, qpos, kpos, True, True, 1, qpos.shape[1],
                                                                 ids.shape[1])
        assert not torch.equal(plan[3], want[3]), name  # the kernel's rounds would collide
        assert numbers.tolist() == want_numbers.tolist() and all(map(torch.equal, settled[:5], want[:5])), name
        with reference_kernels():
            out = torch.ops.cp_inductor.document_shard_attention(q, k, v, plan, meta, ids, qpos, kpos, 0.3, True)[0]
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        want = document_attention._shard_dense(q, k, v, ids, qpos, kpos, 0.3, True)
        for got_t, want_t in zip((out, *grads), (want, *torch.autograd.grad(want, (q, k, v), torch.ones_like(want)))):
            torch.testing.assert_close(got_t, want_t, atol=1e-6, rtol=1e-6)


def test_shard_plan_kernel_matches_the_aten_plan():
    done = subprocess.run([sys.executable, "-c", "import test_triton_interpret as t; t.compare_shard_plans()"],
                          cwd=os.path.dirname(__file__), env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "shard plans match" in done.stdout, done.stderr[-3000:]


def test_a_kernel_that_does_not_compile_leaves_the_aten_plan(monkeypatch):
    """A plan kernel that does not compile on this Triton: a warning once, then the aten form
    (the caller's), never a crash; the kernel is not tried again."""
    from triton.compiler.errors import CompilationError

    monkeypatch.setattr(document_attention, "_KERNELS_FAILED", set())
    tries = []

    def broken():
        tries.append(1)
        raise CompilationError("", None, "a construct this Triton lacks")

    with pytest.warns(UserWarning, match="document_shard_plan Triton kernel did not compile"):
        assert document_attention._try_kernel("document_shard_plan", broken) is None
    assert document_attention._try_kernel("document_shard_plan", broken) is None and tries == [1]
    assert document_attention._try_kernel("document_plan", lambda: "launched") == "launched"
