"""ruff over the repository, with the rules pyproject.toml selects (pyflakes, pycodestyle's errors), and
mypy over cp_inductor/, with pyproject.toml's [tool.mypy] (torch and the kernels' libraries read as Any)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", ROOT], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_finds_nothing():
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-2000:]
