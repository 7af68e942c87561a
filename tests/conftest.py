import compileall
import inspect
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Byte code for our sources, written once per change: where the environment says not to write it
# (PYTHONDONTWRITEBYTECODE, as on CI's machines), every rank, example and fresh interpreter the
# suite starts would compile the package again (0.1-0.15 s each on 2 cores).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _folder in ("cp_inductor", "tests"):
    compileall.compile_dir(os.path.join(_ROOT, _folder), quiet=2)


@pytest.fixture(autouse=True)
def cold_fx_graph_cache(monkeypatch):
    """The passes must run: a warm FX-graph cache (a second run on one machine) would skip them,
    and the tests that count rewrites would see none. Off in this process (torch read the
    variable when it was imported, so it is patched) and in spawned workers (they read the
    variable); the warm-cache test turns the variable back on for its workers."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    with inductor_config.patch(fx_graph_cache=False):
        yield


# Our own bugs must fail the tests, not turn into "internal error" skip reasons (spawned workers
# inherit the variable; cp_inductor.config reads it at import).
os.environ["CP_INDUCTOR_STRICT"] = "1"

# Inductor's CPU kernels scalar: its vectorized C++ (the tiling analysis, then the compiler on
# at::vec templates) is a sixth of a gloo numerics test's time on 2 cores (decoder training at cp
# 2: 101 s -> 86 s), and no test here asks how fast CPU code runs; they check graphs and
# numbers. Spawned ranks inherit the variable; Inductor reads it at every kernel it picks an
# instruction set for. A machine's own setting stands. Tests marked ``vectorized_cpu`` get the
# machine's setting back: Inductor lowers flex attention on the CPU only with a vector ISA.
# pytest-xdist's workers inherit the environment of the process that imported this first, so the
# machine's setting is kept under a name of our own ("" where the machine sets none).
_MACHINE_CPU_CAPABILITY = os.environ.setdefault("CP_INDUCTOR_MACHINE_CPU_CAPABILITY",
                                                os.environ.get("ATEN_CPU_CAPABILITY", ""))
os.environ.setdefault("ATEN_CPU_CAPABILITY", "default")


@pytest.fixture(autouse=True)
def machine_cpu_capability_where_marked(request, monkeypatch):
    if request.node.get_closest_marker("vectorized_cpu"):
        if not _MACHINE_CPU_CAPABILITY:
            monkeypatch.delenv("ATEN_CPU_CAPABILITY")
        else:
            monkeypatch.setenv("ATEN_CPU_CAPABILITY", _MACHINE_CPU_CAPABILITY)
    yield


# The wide tier: the cp = 4 and 8 repeats of gloo numerics that also run at cp = 2 (the CPU CI
# runs the cp = 2 ones, the goldens at cp = 2, 4 and 8, recall at cp = 2 and 4).
# CP_INDUCTOR_TESTS=all runs them too (docs/testing.md).
def pytest_configure(config):
    config.addinivalue_line("markers", "wide: a cp = 4 or 8 repeat of a cp = 2 gloo numerics test (CP_INDUCTOR_TESTS=all)")
    config.addinivalue_line("markers", "vectorized_cpu: compiles flex attention with Inductor on the CPU (needs a vector ISA)")


# Tests that start processes (gloo ranks, torchrun, fresh interpreters) keep both of CI's cores
# busy; the others trace and lower in one process, a core idle. Under pytest-xdist (two workers:
# pyproject's addopts) the first kind runs in one group, on one worker, in order, while the
# other worker takes the one-process tests: two launches side by side would put four ranks on two
# cores (docs/measurements.md, stop 68: each heavy gloo test 2.5x as long).
_STARTS_PROCESSES = re.compile(r"\b(run_on_ranks|survey_side_by_side|subprocess|torchrun)\b")


def _starts_processes(item) -> bool:
    function = getattr(item, "function", None)
    try:
        return function is not None and bool(_STARTS_PROCESSES.search(inspect.getsource(function)))
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config, items):
    if os.environ.get("CP_INDUCTOR_TESTS") != "all":
        wide = [item for item in items if item.get_closest_marker("wide")]
        if wide:
            config.hook.pytest_deselected(items=wide)
            items[:] = [item for item in items if not item.get_closest_marker("wide")]
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.xdist_group("processes"))
