"""The ``cp_inductor`` torch.compile backend: Inductor plus our passes.

Found by name through the ``torch_dynamo_backends`` entry point, so
``torch.compile(fn, backend="cp_inductor")`` needs no import. Accepts ``mode=`` and ``options=``
as Inductor does; options named ``cp_inductor.<switch>`` go to :mod:`cp_inductor.config`, the rest
to Inductor's config.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import torch
import torch._dynamo.config
import torch._dynamo.utils
import torch._functorch.config
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._inductor.compile_fx import compile_fx, compile_fx_inner

from . import config, report_cache
from .config_snapshot import ConfigSnapshot, snapshot
from .passes import engine
from .passes.hook_pass import CPGraphPass
from .lowerings import fa4_functions
from .batch_layout import group_of
from .passes.observe import timed
from .reporting import (Rejected, clear_report, mark, record, record_backward_route, record_rejected, record_varlen,
                        replay, since)

OPTION_PREFIX = "cp_inductor."

# A program that imported FlashAttention-4 before torch.compile looked this backend up gets its
# FA4 calls traced into the graph as our ops (lowerings/fa4_functions.py).
fa4_functions.register_if_imported()

TRACE_OVER_WARNINGS_ENV = "CP_INDUCTOR_TRACE_OVER_WARNINGS"


def trace_over_warnings() -> bool:
    """Let Dynamo trace over ``warnings.warn`` (the call is dropped from compiled code; eager
    code still warns), unless ``CP_INDUCTOR_TRACE_OVER_WARNINGS=0``. Returns whether it is on.

    Dynamo cannot trace ``warnings.warn`` and breaks the graph there. HF transformers builds its
    flex BlockMask through ``create_block_mask(..., _compile=True)``, which warns on every trace:
    the BlockMask gets graphs of its own every step, and its T x T mask stays alive though
    document_mask lowered the flex calls that read it (inside the step's graph it is dead code).
    Dynamo has no per-backend setting for this, so it is process-wide from the moment
    torch.compile looks this backend up. Where torch's compile-metrics logger cannot write the
    setting out (torch 2.11 writes every Dynamo setting as JSON, and a function is not JSON: an
    exception logged at every compile), the logger is handed the settings without this entry.
    """
    setting = os.environ.get(TRACE_OVER_WARNINGS_ENV, "").strip().lower()
    ignored = torch._dynamo.config.ignore_logging_functions
    if setting in ("0", "false", "off", "no"):
        return warnings.warn in ignored  # (the program's own setting stands)
    ignored.add(warnings.warn)
    if _settings_log_written():
        return True
    _log_settings_without_warn()
    if _settings_log_written() or setting in ("1", "true", "on", "yes"):
        return True
    ignored.discard(warnings.warn)  # the logger fails on something else too: leave torch's behaviour
    return False


def _settings_log_written() -> bool:
    log = getattr(torch._dynamo.utils, "_get_dynamo_config_for_logging", None)
    try:
        if log is not None:
            log()
    except TypeError:
        return False
    return True


def _log_settings_without_warn() -> None:
    """Wrap the compile-metrics logger's reader of Dynamo's settings (looked up by name at every
    compile) so that it reads them with ``warnings.warn`` left out of ``ignore_logging_functions``
    for the moment of the read; compiles single-threaded, so nothing traces meanwhile."""
    utils = torch._dynamo.utils
    original = utils._get_dynamo_config_for_logging
    if getattr(original, "leaves_out_warn", False):
        return

    def settings_without_warn():
        ignored = torch._dynamo.config.ignore_logging_functions
        if warnings.warn not in ignored:
            return original()
        ignored.discard(warnings.warn)
        try:
            return original()
        finally:
            ignored.add(warnings.warn)

    settings_without_warn.leaves_out_warn = True  # type: ignore[attr-defined]
    utils._get_dynamo_config_for_logging = settings_without_warn


trace_over_warnings()


def _split_options(options: dict | None) -> tuple[dict, dict]:
    ours, inductor = {}, {}
    known = config.get_config_copy()  # type: ignore[attr-defined]  # install_config_module adds it at import
    for key, value in (options or {}).items():
        if key.startswith(OPTION_PREFIX):
            name = key[len(OPTION_PREFIX):]
            if name not in known:
                raise RuntimeError(f"unknown cp_inductor option {key!r}; known: {sorted(known)}")
            if name == "context_parallel" and not isinstance(value, str):  # a mesh or group: its name
                value = "" if value is None or value is False else group_of(value).group_name
            ours[name] = value
        else:
            inductor[key] = value
    return ours, inductor


def _graph_kind(kwargs) -> str:
    if kwargs.get("is_backward"):
        return "backward"
    return "inference" if kwargs.get("is_inference") else "forward"


@dataclasses.dataclass
class _Journal:
    """One compile's report as it is recorded, for ``report_cache`` (its docstring)."""
    key: str
    start: tuple  # the report's mark when AOTAutograd started
    forward_ran: bool = False  # False after compile_fx: the cache served it
    caching: bool = False  # whether a later compile can be served (read under the compile's patches)

    def compiled(self, kind: str, where: tuple) -> None:
        if kind == "backward":  # lazily, at the first backward: its own entries
            if _caches_on():
                report_cache.store(self.key, "backward", since(where))
        else:
            self.forward_ran, self.caching = True, _caches_on()


def _caches_on() -> bool:
    from torch._functorch._aot_autograd.autograd_cache import should_use_local_autograd_cache

    return should_use_local_autograd_cache() and inductor_config.fx_graph_cache


def _inner_compile(gm: torch.fx.GraphModule, example_inputs, *, cfg: ConfigSnapshot, dynamo_sdpa: int = 0,
                   journal: _Journal | None = None, **kwargs):
    where = mark()
    rejected: list[Rejected] = []
    if cfg.detect and engine.canonicalize(gm.graph, cfg):
        gm.recompile()
    with timed("analyze", f"the {_graph_kind(kwargs)} graph") as outcome:
        rows = engine.analyze(gm.graph, _graph_kind(kwargs), rejected, cfg=cfg, canonical=True)
        outcome["did"] = f"{len(rows)} regions, {len(rejected)} other attention ops"
    if cfg.detect and dynamo_sdpa and not rows and not rejected and _graph_kind(kwargs) != "backward":
        # The program called SDPA, but no attention op reached this graph: the report says why.
        rejected.append(Rejected(_graph_kind(kwargs), "scaled_dot_product_attention", DECOMPOSED))
    for row in rows:
        record(row)
    for r in rejected:
        record_rejected(r)
    for route in engine.backward_routes(gm.graph, _graph_kind(kwargs), cfg):
        record_backward_route(route)
    try:
        with inductor_config.patch(engine.inductor_patch_keys()):  # the rewrites kept set theirs for this graph
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    finally:
        engine.take_analysis(gm.graph)  # left where no hook took it (a cache hit, no work for the hook)
    if journal is not None:
        journal.compiled(_graph_kind(kwargs), where)
    return compiled


DECOMPOSED = ("decomposed into matmul and softmax before our passes (SDPA's math backend was "
              "chosen for these inputs: no fused attention op to find a region around)")


def _sdpa_calls(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is F.scaled_dot_product_attention for n in gm.graph.nodes)


def graph_passes(cfg, inductor_patches: dict, hooks=engine.HOOKS) -> dict:
    """One CPGraphPass per hook key of ``hooks``, chaining whatever pass the user had set there
    (a key we leave alone keeps the user's pass as Inductor runs it)."""
    cfg = cfg if isinstance(cfg, ConfigSnapshot) else ConfigSnapshot(cfg)
    out = {}
    for hook in hooks:
        user = inductor_patches.get(hook, getattr(inductor_config, hook))
        out[hook] = CPGraphPass(hook, engine.run_hook, cfg, user_pass=user)
    return out


def cp_inductor_backend(gm: torch.fx.GraphModule, example_inputs, mode=None, options=None):
    ours, inductor_patches = _split_options(options)
    if mode is not None and mode != "default":
        inductor_patches = {**torch._inductor.list_mode_options(mode), **inductor_patches}
    cfg = snapshot(ours)  # what this compile's analysis, passes and cache key all read
    gm, example_inputs, supply = engine.run_input_passes(gm, example_inputs, cfg)
    hooks = engine.hooks_with_work(gm, example_inputs, cfg)
    inductor_patches.update(graph_passes(cfg, inductor_patches, hooks))
    with timed("dynamo_passes", "the Dynamo graph") as outcome:
        routes = engine.run_dynamo_passes(gm, cfg)
        outcome["did"] = f"{len(routes)} packed calls"
    for route in routes:
        record_varlen(route)
    inductor_patches.update(engine.cache_patches(gm, inductor_patches))
    # A warm AOTAutograd cache serves the compile without running our passes: the report of the
    # cold compile is stored beside it and replayed (report_cache.py).
    # (our options by the snapshot's digest: a mesh option's repr holds an address)
    inductor_options = {k: v for k, v in (options or {}).items() if not k.startswith(OPTION_PREFIX)}
    journal = _Journal(report_cache.key(gm, example_inputs, cfg, mode, inductor_options), mark())
    with torch._functorch.config.patch(engine.functorch_patches(hooks)):
        compiled = compile_fx(
            gm,
            example_inputs,
            inner_compile=functools.partial(_inner_compile, cfg=cfg, dynamo_sdpa=_sdpa_calls(gm), journal=journal),
            config_patches=inductor_patches,
        )
    if journal.forward_ran:
        if journal.caching:
            report_cache.store(journal.key, "forward", since(journal.start))
    else:
        stored = report_cache.load(journal.key)
        if stored is not None:
            replay(stored)
        else:
            record_rejected(Rejected("forward", "(cache)", NOT_STORED))
    return supply(compiled)


NOT_STORED = ("served from AOTAutograd's cache, with no report stored for it (a cache dir filled without "
              "cp_inductor_reports/): the rewrites it holds are not listed")


def reset() -> None:
    """Called by ``torch._dynamo.reset()`` for every backend it compiled with."""
    from torch._inductor.cudagraph_trees import reset_cudagraph_trees

    reset_cudagraph_trees()
    clear_report()


cp_inductor_backend.reset = reset  # type: ignore[attr-defined]  # the attribute torch._dynamo.reset() calls
