"""ruff over the repository, with the rules pyproject.toml selects (pyflakes, pycodestyle's errors)."""

import os
import subprocess
import sys


def test_ruff_finds_nothing():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", root], capture_output=True, text=True,
                          cwd=root, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
