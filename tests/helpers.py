"""What the tests share: fake process groups, AOT graphs without Inductor codegen, stable text
forms of what detection found and what the passes did (for golden tests), and the one assertion
every numerics test makes on ``cp_inductor.testing.checks.check_cp_attention``."""

from __future__ import annotations

import collections
import contextlib
import functools
import re

import torch
import torch.distributed as dist
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.decomposition import select_decomp_table
from torch.testing._internal.distributed.fake_pg import FakeStore

from cp_inductor.config_snapshot import snapshot
from cp_inductor.passes import engine
from cp_inductor.passes.pipeline import PASSES
from cp_inductor.passes.record import JOINT, POST_GRAD, REGION
from cp_inductor.passes.detect.a2a import find
from cp_inductor.testing.launch import run_on_ranks


def assert_within_low_precision(loss, grads: dict, fp32: tuple, own: tuple, note=None) -> None:
    """A low-precision step's loss and gradients against the fp32 step's ``(loss, grads)``: each
    within twice the error of the model's own low-precision step (``own``), or 1%."""
    (want_loss, want), (own_loss, own_grads) = fp32, own
    loss_err, own_err = (abs(float(x) - float(want_loss)) / abs(float(want_loss)) for x in (loss, own_loss))
    assert loss_err < max(2 * own_err, 1e-2), (loss_err, own_err, note)
    for name, grad in want.items():
        err, own_err = (float((x.float().cpu() - grad.float().cpu()).norm() / grad.float().norm()) for x in (grads[name], own_grads[name]))
        assert err < max(2 * own_err, 1e-2), (name, err, own_err, note)


def allgather_qkv():
    """Small BSHD q, k, v (16 local tokens, 4 query heads, 2 K/V heads) for all-gather graphs."""
    mk = lambda h: torch.randn(1, 16, h, 8, requires_grad=True)  # noqa: E731
    return mk(4), mk(2), mk(2)


def causal_allgather(q, k, v, head_groups=None):
    """The all-gather helper, causal and load-balanced (its default)."""
    from cp_inductor.parallel import allgather_attention

    return allgather_attention(q, k, v, is_causal=True, head_groups=head_groups)


@contextlib.contextmanager
def fake_pg(cp: int, rank: int = 0):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    try:
        yield dist.group.WORLD
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def aot_graphs(fn, *inputs, joint_pass=None) -> dict:
    """The graphs Inductor would receive for ``fn`` (forward/backward or inference), by kind;
    ``joint_pass(graph)`` runs on the joint graph before the partitioner, as Inductor's
    ``joint_custom_pre_pass`` does."""
    graphs = {}

    def partition(gm, joint_inputs, **kwargs):
        if joint_pass is not None:
            joint_pass(gm.graph)
            gm.recompile()
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def backend(gm, example_inputs):
        def compiler(kind):
            def compile_one(g, _):
                graphs[kind] = g
                return g.forward

            return compile_one

        needs_grad = torch.is_grad_enabled() and any(
            isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
        )
        return aot_module_simplified(
            gm, example_inputs,
            fw_compiler=compiler("forward" if needs_grad else "inference"),
            bw_compiler=compiler("backward"),
            decompositions=select_decomp_table(),
            partition_fn=partition,
        )

    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.sum().backward()
    return graphs


def ring_graphs(cp: int, fn, inputs, rank: int = 0, post_grad: bool = True, **cfg) -> tuple[list, dict]:
    """(report rows, graphs) of ``fn(*inputs)`` on rank ``rank`` of a fake ``cp``-rank group, as
    the backend compiles a ring program: AOTAutograd's CSE off, the pipeline's joint-graph passes
    before the partitioner, then (``post_grad``) the report and the post-grad rewrites. ``cfg``:
    cp_inductor config for the compile."""
    import cp_inductor

    with fake_pg(cp, rank), cp_inductor.config.patch(**cfg), torch._functorch.config.patch(cse=False):
        compile_cfg = snapshot()
        graphs = aot_graphs(fn, *inputs, joint_pass=functools.partial(engine.run_hook, JOINT, cfg=compile_cfg))
        if not post_grad:
            return [], graphs
        rows = [r for kind, gm in graphs.items() for r in engine.analyze(gm.graph, kind, cfg=compile_cfg)]
        for gm in graphs.values():
            engine.run_hook(POST_GRAD, gm.graph, compile_cfg)
    return rows, graphs


def _short(node) -> str:
    name = getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]


def describe_regions(graphs: dict) -> str:
    """One block per region: kind, cp, layout, then each crossing as its op chain."""
    lines = []
    for kind, gm in graphs.items():
        for r in find(gm.graph, kind, snapshot()):
            lines.append(
                f"{kind}: a2a cp={r.cp} layout={r.layout} {_short(r.attention)}"
                f" Hq={r.heads_q} Hkv={r.heads_kv}{' causal' if r.is_causal else ''}"
            )
            for name, c in list(r.incoming.items()) + list(r.outgoing.items()):
                chain = [_short(n) for n in c.before] + ["ALL_TO_ALL"] + [_short(n) for n in c.after]
                lines.append(f"  {name:8s} {c.layout}: {' -> '.join(chain)}")
    return "\n".join(lines) if lines else "no regions"


def describe_matches(graphs: dict) -> str:
    """One line per CP match of every style (graph order), then the rejected attention ops."""
    lines = []
    for kind, gm in graphs.items():
        rejected = []
        for row in engine.analyze(gm.graph, kind, rejected):
            causal = " causal" if "causal" in row.detail.split() else ""
            lines.append(f"{kind}: {row.style} cp={row.cp_size} {row.layout} {row.attention} {row.detail.split(' causal')[0]}{causal}")
        lines += [f"{kind}: not a region: {r.attention}: {r.reason}" for r in rejected]
    return "\n".join(lines) if lines else "no regions"


def count_ops(gm) -> str:
    """all_to_all and copy counts of a graph, for before/after comparisons."""
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    a2a = sum(t is torch.ops._c10d_functional.all_to_all_single.default for t in targets)
    clones = sum(t is torch.ops.aten.clone.default for t in targets)
    return f"all_to_all={a2a} clone={clones}"


def report_text(graphs: dict) -> str:
    """The report rows analysis would record for these graphs, then the rejected attention ops."""
    rows, rejected = [], []
    for kind, gm in graphs.items():
        for r in engine.analyze(gm.graph, kind, rejected):
            rows.append(f"{r.graph} {r.style} cp={r.cp_size} {r.layout} applied={r.applied} skipped={r.skipped}")
    rows += [f"rejected {r.graph} {r.attention}: {r.reason}" for r in rejected]
    return "\n".join(rows)


def collectives(gm) -> str:
    """The all_to_all calls of a graph with their buffer shapes, in order."""
    return ", ".join(
        f"a2a{list(n.args[0].meta['val'].shape)}"
        for n in gm.graph.nodes
        if n.target is torch.ops._c10d_functional.all_to_all_single.default
    )


def fused_a2a_pass(graph) -> None:
    """fused_a2a alone on a post-grad graph, with the global config as it is now."""
    engine.rewrite_graph(graph, only=("fused_a2a",))


def rewrite_summary(graphs: dict, graph_pass) -> str:
    """Per graph: collectives and copy counts before and after ``graph_pass``."""
    lines = []
    for kind, gm in graphs.items():
        before = f"{collectives(gm)} ({count_ops(gm)})"
        graph_pass(gm.graph)
        gm.recompile()
        lines.append(f"{kind} before: {before}\n{kind} after:  {collectives(gm)} ({count_ops(gm)})")
    return "\n".join(lines)


def schedule(gm) -> str:
    """The order of all-to-alls, their waits and attention calls in a graph: ``a2a#i[shape]``
    (``ce#i[shape]`` on the copy-engine transport), ``wait#i``, ``attn(h=heads)`` (query heads of
    the call)."""
    from cp_inductor.passes.analysis.sdpa_ops import SDPA_BACKWARD, SDPA_FORWARD

    c10d = torch.ops._c10d_functional
    ce = getattr(torch.ops.cp_inductor, "ce_all_to_all_start", None)
    ce_start = ce.default if ce is not None else None
    ce_wait = torch.ops.cp_inductor.ce_all_to_all_wait.default if ce is not None else None
    ids, out = {}, []
    for n in gm.graph.nodes:
        if n.target is c10d.all_to_all_single.default or (ce_start is not None and n.target is ce_start):
            ids[n] = len(ids)
            kind = "a2a" if n.target is c10d.all_to_all_single.default else "ce"
            out.append(f"{kind}#{ids[n]}{list(n.args[0].meta['val'].shape)}")
        elif (n.target is c10d.wait_tensor.default or (ce_wait is not None and n.target is ce_wait)) and n.args[0] in ids:
            out.append(f"wait#{ids[n.args[0]]}")
        elif n.target in SDPA_FORWARD or n.target in SDPA_BACKWARD:
            q = n.args[1] if n.target in SDPA_BACKWARD else n.args[0]
            out.append(f"attn(h={q.meta['val'].shape[1]})")
    return " ".join(out)


def rotations(gm, heads: bool = False) -> str:
    """Rotations, their waits and attention calls in graph order: ``nccl#i`` / ``ce#i(to dst,
    from src)``, ``wait#i``, ``attn`` (``attn(h=query heads)`` with ``heads``)."""
    from cp_inductor.lowerings import ce_transport  # noqa: F401  (registers the ops)
    from cp_inductor.passes.analysis.sdpa_ops import SDPA_BACKWARD, SDPA_FORWARD

    c10d = torch.ops._c10d_functional
    ce_start = torch.ops.cp_inductor.ce_rotate_start.default
    ce_wait = torch.ops.cp_inductor.ce_all_to_all_wait.default
    ids, out = {}, []
    for n in gm.graph.nodes:
        if n.target is c10d.all_to_all_single.default:
            ids[n] = len(ids)
            out.append(f"nccl#{ids[n]}")
        elif n.target is ce_start:
            ids[n] = len(ids)
            out.append(f"ce#{ids[n]}(to {n.args[1]}, from {n.args[2]})")
        elif n.target in (c10d.wait_tensor.default, ce_wait) and n.args[0] in ids:
            out.append(f"wait#{ids[n.args[0]]}")
        elif n.target in SDPA_FORWARD or n.target in SDPA_BACKWARD:
            q = n.args[1] if n.target in SDPA_BACKWARD else n.args[0]
            out.append(f"attn(h={q.meta['val'].shape[1]})" if heads else "attn")
    return " ".join(out)


# Passes that are not region rewrites in the report (graph and packed-call passes count too:
# cudnn_frontend_backward the cuDNN backward calls it moves on GPUs, ring_cse the merges).
WHOLE_GRAPH_PASSES = tuple(p.name for p in PASSES if p.unit != REGION)


def region_rewrites(result: dict) -> dict:
    """What the post-grad passes did to regions (check_cp_attention's counters), by rewrite."""
    return {k: v for k, v in result["rewritten"].items() if k not in WHOLE_GRAPH_PASSES}


def assert_cp_results(results, tol: float, applied=("fused_a2a",), cp: int | None = None, check_layout=False):
    """Eager and compiled CP attention within ``tol`` (relative L2) of the fp64 reference for the
    output and every gradient; the report applied exactly ``applied`` and the passes really
    rewrote the forward and the backward region with each (their counters agree with the
    report). With ``cp``: the report's rows are that forward and backward Ulysses region, and with
    ``check_layout`` in the case's layout."""
    for r in results:
        for key in ("eager_vs_ref", "compiled_vs_ref"):
            for name, err in r[key].items():
                assert err < tol, f"{r['case']} {key} {name}: {err:.2e}"
        rewritten = region_rewrites(r)
        assert r["applied"] == list(applied) and rewritten == {name: 2 for name in applied}, r
        if cp is not None:
            rows = [row if check_layout else row[:3] for row in r["report"]]
            tail = (r["case"].layout,) if check_layout else ()
            assert rows == [("forward", "a2a", cp) + tail, ("backward", "a2a", cp) + tail], rows


def gather_schedule_in_code(codes) -> list[str]:
    """All-gather / reduce-scatter / wait / attention calls in the order Inductor's wrapper code
    makes them, one string per generated module."""
    names = {"all_gather_into_tensor": "gather", "reduce_scatter_tensor": "rs", "wait_tensor": "wait"}
    return [
        " ".join(names.get(c, "attn") for c in re.findall(
            r"(all_gather_into_tensor|reduce_scatter_tensor|wait_tensor|_scaled_dot_product\w+|cudnn_attention_backward)\.default\(",
            # our cuDNN backward is called by name on CUDA
            code.replace("extern_kernels.cp_inductor_cudnn_attention_backward(", "cudnn_attention_backward.default(")))
        for code in codes
    ]


def tally_detection(stats, misses: list, spec, regions: int, found: dict, rejected: list) -> None:
    """One generated program of a recall/precision survey: ``regions`` > 0 for CP attention (it
    counts as found when the forward and the backward graph have that many regions each), 0 for
    a program that is not (any region is a false positive); misses keep what was found and why not."""
    if regions:
        stats["valid"] += 1
        if found.get("forward", 0) >= regions and found.get("backward", 0) >= regions:
            stats["found"] += 1
        else:
            misses.append((spec, found, [r.reason for r in rejected]))
    else:
        stats["not_cp"] += 1
        if any(found.values()):
            stats["false_positive"] += 1
            misses.append((spec, found))


def _survey_share(rank: int, shares: int, survey, jobs: list) -> tuple:
    return survey(*jobs[rank])


def survey_side_by_side(survey, jobs: list[tuple]) -> tuple[collections.Counter, list]:
    """``survey(*job)`` for each job, one process each (a survey traces on one core; CI has two),
    their tallies added and their misses joined."""
    stats, misses = collections.Counter(), []
    for share_stats, share_misses in run_on_ranks(_survey_share, len(jobs), survey, jobs, pg_backend=None):
        stats.update(share_stats)
        misses += share_misses
    return stats, misses


@contextlib.contextmanager
def pass_replaced(record, **fields):
    """A pass record's fields (``apply=...``) swapped for the block: records are frozen, and the
    pipeline holds them, so patching the module's function would not reach the engine. ``record``:
    a module's ``PASS``; the pipeline's record of that name is patched (pipeline.py may have added
    relations to it)."""
    record = next(p for p in PASSES if p.name == record.name)
    old = {k: getattr(record, k) for k in fields}
    for k, v in fields.items():
        object.__setattr__(record, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            object.__setattr__(record, k, v)
