"""The README's examples (``examples/*.py``) run as a user runs them: ``torchrun`` with 2 ranks
(gloo on CPU), each checking its output against single-device attention."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(example):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, as CI runs it
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(example)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for pattern in REPORTED[example.stem]:
        assert re.search(pattern, run.stdout, re.M), (pattern, run.stdout)


def test_the_readme_shows_the_examples_as_they_run():
    """Every README block that follows a link to an example is lines of that example (the code
    CI runs), so the README holds no snippet with undefined names."""
    readme = (EXAMPLES[0].parent.parent / "README.md").read_text()
    shown = re.findall(r"\[`examples/(\w+\.py)`\]\(examples/\w+\.py\)[^`]*?```python\n(.*?)```", readme, re.S)
    assert sorted(name for name, _ in shown) == sorted(e.name for e in EXAMPLES), shown
    for name, block in shown:
        source = (EXAMPLES[0].parent / name).read_text()
        for line in block.splitlines():
            code = line.split("  #")[0].rstrip()
            assert code in source, (name, line)
