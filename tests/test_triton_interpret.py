"""The package's Triton kernels on the CPU, under Triton's interpreter (a fresh interpreter
with ``TRITON_INTERPRET=1``: Triton reads it when it first builds a kernel)."""

import os
import subprocess
import sys

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
    print("document plans match")


def test_document_plan_kernel_matches_the_aten_plan():
    done = subprocess.run([sys.executable, "-c", "import test_triton_interpret as t; t.compare_document_plans()"],
                          cwd=os.path.dirname(__file__), env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "document plans match" in done.stdout, done.stderr[-3000:]
