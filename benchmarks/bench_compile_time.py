"""Compile time: the first call (forward and backward) of an L-layer stack, default Inductor
against cp_inductor, each in a fresh process with every cache off; with ``--restart``, a
restarted job's first call instead: a fresh process fills a fresh cache dir, a second fresh
process on that dir is timed (Inductor's and AOTAutograd's caches on, as by default).

    python benchmarks/bench_compile_time.py --layers 4 8 16 32 --styles a2a allgather ring none --repeats 3
    python benchmarks/bench_compile_time.py --restart --layers 4 --styles none a2a --repeats 3
    python benchmarks/bench_compile_time.py --restart --layers 4 --styles auto_ulysses auto_allgather auto_ring --repeats 3

``auto_ulysses``, ``auto_allgather``, ``auto_ring``: context parallelism the model does not write
(``cp_inductor.testing.auto_cp.Decoder``, causal, the same sizes, a batch of one row cut by
``shard_batch``) under cp_inductor with that style forced, against default Inductor compiling the
same single-device model on the full row (it cannot make it context-parallel).

The stack: ``cp_inductor.testing.train_step.TransformerBlock`` layers (RMSNorm, QKV projection, CP
attention through our helpers on PyTorch's fake group of 2 ranks, output projection, MLP), dim
256, 4 heads / 2 K/V heads, sequence 256 (``none``: plain SDPA, no CP). Per (style, layers,
backend): the median over ``--repeats`` fresh processes (the backends interleaved) of the wall
time from ``torch.compile`` (the backend's lookup, where cp_inductor imports its Inductor
modules) through the first call, the median of the paired ratios, and for
cp_inductor the time its own passes took (the sum of what ``TORCH_LOGS=cp_inductor`` logs per
pass, ``passes/observe.py``). CPU by default; ``--device cuda`` on a GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, logging, re, sys, time
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore
import cp_inductor
from cp_inductor.testing.train_step import StepConfig, TransformerBlock
import os
if os.environ.get("CP_BENCH_PROVIDER"):  # --provider: which kernel our lowerings pick
    cp_inductor.config.attention_provider = os.environ["CP_BENCH_PROVIDER"]

style, layers, backend, device, dtype, seq = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], getattr(torch, sys.argv[5]), int(sys.argv[6])
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
by_pass = {}
NESTED = ("varlen_cudnn", "uniform_thd")  # inside dynamo_passes

class Passes(logging.Handler):
    def emit(self, record):
        m = re.search(r"cp_inductor pass (\w+) on .*\((\d+\.\d) ms\)$", record.getMessage())
        if m and m.group(1) not in NESTED:
            by_pass[m.group(1)] = by_pass.get(m.group(1), 0.0) + float(m.group(2)) / 1e3

class CacheWhy(logging.Handler):  # why AOTAutograd's cache missed or was bypassed, in its words
    seen = []
    def emit(self, record):
        message = record.getMessage()
        if "ypass" in message or "unable to" in message or "miss" in message:
            self.seen.append(message[:300])

logging.getLogger("cp_inductor").addHandler(Passes())
for name in ("torch._functorch._aot_autograd.autograd_cache", "torch._inductor.codecache"):
    logging.getLogger(name).addHandler(CacheWhy())
    logging.getLogger(name).setLevel(logging.INFO)
logging.getLogger("cp_inductor").setLevel(logging.INFO)
logging.getLogger("cp_inductor").propagate = False
cfg = StepConfig(style=style if style != "none" else "a2a", seq=seq, dim=256, heads=4, kv_heads=2, batch=1)

class Plain(torch.nn.Module):  # no CP: the same block with SDPA over the local sequence
    def __init__(self):
        super().__init__()
        self.block = TransformerBlock(cfg)
    def forward(self, x):
        b = self.block
        s = x.shape[1]
        qkv = b.wqkv(b.norm1(x)).view(1, s, cfg.heads + 2 * cfg.kv_heads, -1)
        q, k, v = (t.transpose(1, 2) for t in qkv.split([cfg.heads, cfg.kv_heads, cfg.kv_heads], dim=2))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
        x = x + b.wo(o.flatten(2))
        return x + b.mlp(b.norm2(x))

if style.startswith("auto_"):  # CP the model does not write: our decoder, cp_inductor inserts the style
    from cp_inductor.parallel import shard_batch
    from cp_inductor.testing.auto_cp import Decoder, packed_batch
    torch.manual_seed(0)
    stack = Decoder(mask="causal", dim=cfg.dim, heads=cfg.heads, kv_heads=cfg.kv_heads, layers=layers).to(device)
    batch = {k: v.to(device) for k, v in packed_batch([cfg.seq]).items() if k != "position_ids"}
else:
    stack = torch.nn.Sequential(*[Plain() if style == "none" else TransformerBlock(cfg) for _ in range(layers)]).to(device, dtype)
    x = torch.randn(1, cfg.seq // 2, cfg.dim, device=device, dtype=dtype, requires_grad=True)
profile = os.environ.get("CP_BENCH_PROFILE")
if profile:  # in the script, not `python -m cProfile`: that changes the globals Dynamo guards on
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
import gc
gc_s, gc_full, gc_began = [0.0], [0], [0.0]
def gc_timer(phase, info):  # the collector's pauses inside the timed part, whoever triggers them
    if phase == "start":
        gc_began[0] = time.perf_counter()
    else:
        gc_s[0] += time.perf_counter() - gc_began[0]
        gc_full[0] += info["generation"] == 2
gc.callbacks.append(gc_timer)
start = time.perf_counter()  # before the backend's lookup: cp_inductor's imports its Inductor there
if style.startswith("auto_") and backend == "cp_inductor":  # this rank's tokens, the style forced
    options = {"cp_inductor.context_parallel": dist.group.WORLD, "cp_inductor.context_parallel_style": style[5:]}
    fn, args = torch.compile(stack, backend=backend, fullgraph=True, options=options), shard_batch(batch)
elif style.startswith("auto_"):  # default Inductor: the same single-device model on the full batch
    fn, args = torch.compile(stack, backend=backend, fullgraph=True), batch
else:
    fn, args = torch.compile(stack, backend=backend, fullgraph=True), None
looked_up = time.perf_counter()
out = fn(**args) if args is not None else fn(x).sum()
forward_done = time.perf_counter()
out.backward()
if device == "cuda":
    torch.cuda.synchronize()
phases = {"lookup": looked_up - start, "forward": forward_done - looked_up, "backward": time.perf_counter() - forward_done,
          "gc": gc_s[0], "gc_full": gc_full[0]}
gc.callbacks.remove(gc_timer)
if profile:
    profiler.disable()
    profiler.dump_stats(profile)
fa4_dir = os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR") if os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1" else None
print(json.dumps({"seconds": time.perf_counter() - start, "phases": phases, "passes_s": sum(by_pass.values()), "by_pass": by_pass,
                  "fa4_cached_files": sum(len(f) for _, _, f in os.walk(fa4_dir)) if fa4_dir else None,
                  "regions": len(cp_inductor.report()), "report": str(cp_inductor.report())[:3000],
                  "aot_cache_hits": torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"],
                  "aot_cache": dict(torch._dynamo.utils.counters["aot_autograd"]), "cache_log": CacheWhy.seen}))
"""


def first_call(style: str, layers: int, backend: str, device: str, cache_dir: str | None = None,
               fa4_cache: bool = True, profile: str | None = None, dtype: str = "float32", seq: int = 256) -> dict:
    """A fresh process's first call: every cache off, or (``cache_dir``) the caches on, in that dir
    (FA4's kernels too unless ``fa4_cache`` is False); ``profile``: cProfile's stats of the timed
    part written to that file."""
    if cache_dir is None:
        env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TORCHINDUCTOR_FX_GRAPH_CACHE": "0",
               "TORCHINDUCTOR_AUTOGRAD_CACHE": "0"}
    else:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        if not fa4_cache:
            env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "0"
    command = [sys.executable, "-c", CHILD, style, str(layers), backend, device, dtype, str(seq)]
    if profile and profile.endswith(".txt"):  # py-spy's wall-clock samples (raw stacks), no tracing overhead
        command = ["py-spy", "record", "--nonblocking", "--format", "raw", "--rate", "1000", "--output", profile, "--"] + command
    elif profile:
        env["CP_BENCH_PROFILE"] = profile
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])  # (py-spy prints too)


def timed_samples(path: str) -> dict[str, int]:
    """py-spy's raw stacks cut to the child's timed part: per function (``name (file)``), the
    samples whose stack holds it (each stack counts a function once: a wall-clock cumulative)."""
    first = CHILD[:CHILD.index("\nstart = ")].count("\n") + 2  # the child's lines, 1-based
    last = CHILD[:CHILD.index("\nphases = ")].count("\n") + 1
    inside = re.compile(r"\(<string>:(\d+)\)")
    seen: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if not any(first <= int(m.group(1)) <= last for fr in frames if (m := inside.search(fr))):
                continue
            seen["(timed part)"] = seen.get("(timed part)", 0) + int(count)
            for fn in {re.sub(r":\d+\)$", ")", fr) for fr in frames}:
                seen[fn] = seen.get(fn, 0) + int(count)
    return seen


def profiled(a, style: str, layers: int) -> None:
    """One restart per backend under a profiler: cProfile (its top functions by cumulative time),
    or with ``--sampler`` py-spy's wall-clock samples, the functions where the two differ most."""
    import pstats

    os.makedirs(a.profile, exist_ok=True)
    samples = {}
    for backend in ("inductor", "cp_inductor"):
        path = os.path.join(a.profile, f"{style}_{backend}." + ("txt" if a.sampler else "pstats"))
        with tempfile.TemporaryDirectory() as cache:
            first_call(style, layers, backend, a.device, cache, not a.no_fa4_cache, dtype=a.dtype, seq=a.seq)
            seconds = first_call(style, layers, backend, a.device, cache, not a.no_fa4_cache, profile=path, dtype=a.dtype, seq=a.seq)["seconds"]
        print(f"--- {style} {backend}: {seconds:.2f} s profiled", flush=True)
        if a.sampler:
            samples[backend] = timed_samples(path)
            continue
        stats = pstats.Stats(path)
        stats.sort_stats("tottime").print_stats(15)
        stats.sort_stats("cumulative").print_stats("cp_inductor/|cudnn|_find_and_load|backends/registry", 25)
    if samples:  # 1000 samples a second: a count is milliseconds
        ind, ours = samples["inductor"], samples["cp_inductor"]
        print("    wall ms in the timed part (py-spy, 1 kHz; ms with the function on the stack): inductor, cp_inductor, difference")
        for fn in sorted(set(ind) | set(ours), key=lambda f: -(ours.get(f, 0) - ind.get(f, 0)))[:40]:
            print(f"    {ind.get(fn, 0):6d} {ours.get(fn, 0):6d} {ours.get(fn, 0) - ind.get(fn, 0):+6d}  {fn[:150]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--styles", nargs="+", default=["a2a", "allgather", "ring", "none"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--restart", action="store_true", help="time a restarted job's first call (warm caches)")
    ap.add_argument("--no-fa4-cache", action="store_true", help="--restart: FA4 compiles its kernels in every process")
    ap.add_argument("--profile", metavar="DIR", help="--restart: one more restart per backend and style under "
                    "cProfile (DIR/<style>_<backend>.pstats), its top functions printed")
    ap.add_argument("--sampler", action="store_true", help="--profile with py-spy's wall-clock samples (py-spy on "
                    "the PATH) instead of cProfile, whose tracing inflates small Python calls")
    ap.add_argument("--dtype", default="float32", help="the stack's and its input's dtype (bfloat16 on a GPU: the "
                    "kernels users train with)")
    ap.add_argument("--seq", type=int, default=256, help="the whole sequence (each of the 2 fake ranks holds half); "
                    "on a GPU, 32768 puts the dense calls in the provider map's measured range")
    ap.add_argument("--provider", help="cp_inductor's attention_provider (auto, fa4, cudnn, program)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.provider:  # every child reads it (they inherit the environment)
        os.environ["CP_BENCH_PROVIDER"] = a.provider
    if a.restart:
        # A restarted job imports our package from byte code (pip writes it at install; an editable
        # install at the first import), unless PYTHONDONTWRITEBYTECODE is set, as on the benchmark
        # machines: written here, as pip would, so that no arm compiles our sources at each restart.
        import compileall

        import cp_inductor
        compileall.compile_dir(os.path.dirname(cp_inductor.__file__), quiet=1)
    print(f"{'style':>9} {'layers':>6} | {'inductor s':>10} {'cp_inductor s':>13} {'ratio':>6} {'paired':>6} | {'our passes s':>12} | largest passes (s)")
    rows = []
    for style in a.styles:
        for layers in a.layers:
            # Interleaved (A B A B ...): single first calls vary by 10-20% on 2 cores, and drift
            # over minutes; each pair's ratio is taken, then their median.
            runs = {"inductor": [], "cp_inductor": []}
            for _ in range(a.repeats):
                for b in runs:
                    if a.restart:
                        with tempfile.TemporaryDirectory() as cache:
                            fill = first_call(style, layers, b, a.device, cache, not a.no_fa4_cache, dtype=a.dtype, seq=a.seq)  # the job before
                            runs[b].append(first_call(style, layers, b, a.device, cache, not a.no_fa4_cache, dtype=a.dtype, seq=a.seq))
                            runs[b][-1]["fill"] = {k: fill[k] for k in ("seconds", "regions", "report")}
                    else:
                        runs[b].append(first_call(style, layers, b, a.device, dtype=a.dtype, seq=a.seq))
            ind = statistics.median(r["seconds"] for r in runs["inductor"])
            ours = statistics.median(r["seconds"] for r in runs["cp_inductor"])
            paired = statistics.median(o["seconds"] / i["seconds"] for i, o in zip(runs["inductor"], runs["cp_inductor"]))
            passes = statistics.median(r["passes_s"] for r in runs["cp_inductor"])
            rows.append({"style": style, "layers": layers, "inductor_s": ind, "cp_inductor_s": ours,
                         "ratio": ours / ind, "paired_ratio": paired, "our_passes_s": passes, "runs": runs})
            top = sorted(runs["cp_inductor"][0]["by_pass"].items(), key=lambda kv: -kv[1])[:4]
            print(f"{style:>9} {layers:>6} | {ind:10.1f} {ours:13.1f} {ours / ind:6.2f} {paired:6.2f} | {passes:12.2f} | "
                  + ", ".join(f"{n} {t:.2f}" for n, t in top), flush=True)
            for b, rs in runs.items():  # where each backend's first call went (medians; gc: the collector's pauses)
                print(f"    {b} phases s: " + ", ".join(
                    f"{k} {statistics.median(r['phases'][k] for r in rs):.2f}" for k in ("lookup", "forward", "backward", "gc"))
                    + f", full collections {statistics.median(r['phases']['gc_full'] for r in rs):.0f}", flush=True)
            first = runs["cp_inductor"][0]
            compiled = first.get("fill", first)  # the process that compiled (the fill of a restart)
            print(f"    cp_inductor regions: {compiled['regions']}"
                  + (f" at the fill, {first['regions']} replayed at the restart" if a.restart else ""), flush=True)
            if not compiled["regions"] and style != "none":
                print("    " + compiled["report"].replace("\n", "\n    "), flush=True)
            if a.restart:
                for b, rs in runs.items():  # why a restart missed AOTAutograd's cache, where it did
                    for why in dict.fromkeys(line for r in rs for line in r["cache_log"]):
                        print(f"    {b} restart: {why}", flush=True)
            if a.restart and a.profile:
                profiled(a, style, layers)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
