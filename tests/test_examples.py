"""The README's examples (``examples/*.py``) run as a user runs them: ``torchrun`` with 2 ranks
(gloo on CPU), each checking its output against single-device attention."""

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_runs(example):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, as CI runs it
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(example)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "graph     style" in run.stdout or "cp_inductor: no CP attention regions found" in run.stdout, run.stdout


def test_the_readme_shows_each_example_as_it_is():
    readme = (EXAMPLES[0].parent.parent / "README.md").read_text()
    for example in EXAMPLES:
        assert f"examples/{example.name}" in readme, example.name
