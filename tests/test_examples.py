"""The examples (``examples/*.py``, walked through in docs/examples.md) run as a user runs them,
2 ranks (gloo on CPU), each checking its output against single-device attention: one under
``torchrun`` itself, the others
as torchrun runs a script (its rank variables set, the file run as ``__main__``) in ranks forked
from the test launcher's server, which has torch imported already (a torchrun of its own costs
each example three fresh interpreters)."""

import contextlib
import io
import os
import pathlib
import re
import runpy
import subprocess
import sys

import pytest

from cp_inductor.testing.launch import run_on_ranks

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parent.parent / "examples").glob("*.py"))
# What each example's report must show on the CPU: its region, forward and backward; the packed
# example's pieces run on SDPA's math path there, which the report says (the README too).
REPORTED = {
    "allgather": [r"^forward\s+allgather\s+2\s", r"^backward\s+allgather\s+2\s"],
    "ring": [r"^forward\s+ring\s+2\s", r"^backward\s+ring\s+2\s"],
    "ulysses": [r"^forward\s+a2a\s+2\s", r"^backward\s+a2a\s+2\s"],
    "packed_allgather": [r"decomposed into matmul and softmax before our passes"],
    "auto_cp": [r"context-parallel attention \w+: allgather, cp=2, documents, causal, K/V all-gathered"],
}


UNDER_TORCHRUN = "ulysses"


def _as_torchrun_runs_it(rank: int, world: int, path: str) -> str:
    """What torchrun does for a rank of ``path`` on the CPU (MASTER_ADDR and MASTER_PORT set by the
    launcher): the rank variables, then the file as ``__main__``; its standard output."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      CUDA_VISIBLE_DEVICES="")
    sys.argv = [path]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        runpy.run_path(path, run_name="__main__")
    return out.getvalue()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(example):
    if example.stem == UNDER_TORCHRUN:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, as CI runs it
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example)],
            env=env, capture_output=True, text=True, timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        stdout = run.stdout
    else:  # a failing example raises in its rank: run_on_ranks re-raises with the traceback
        stdout = "".join(run_on_ranks(_as_torchrun_runs_it, 2, str(example), pg_backend=None))
    for pattern in REPORTED[example.stem]:
        assert re.search(pattern, stdout, re.M), (pattern, stdout)


def test_the_readme_shows_the_examples_as_they_run():
    """Every block of the README and of docs/examples.md that follows a link to an example is
    lines of that example (the code CI runs), so neither holds a snippet with undefined names;
    docs/examples.md shows every example."""
    root = EXAMPLES[0].parent.parent
    link = r"\[`examples/(\w+\.py)`\]\((?:\.\./)?examples/\w+\.py\)[^`]*?```python\n(.*?)```"
    walkthrough = re.findall(link, (root / "docs" / "examples.md").read_text(), re.S)
    shown = walkthrough + re.findall(link, (root / "README.md").read_text(), re.S)
    assert sorted(name for name, _ in walkthrough) == sorted(e.name for e in EXAMPLES), walkthrough
    for name, block in shown:
        source = (EXAMPLES[0].parent / name).read_text()
        for line in block.splitlines():
            code = line.split("  #")[0].rstrip()
            assert code in source, (name, line)
