"""K/V all-gather CP attention, forward + backward, on GPUs: eager / Inductor / cp_inductor (each
rewrite OFF and ON, head groups G) / PyTorch native context_parallel / the one-GPU floor.

    torchrun --nproc-per-node 2 benchmarks/bench_allgather.py --batch 1 --seq 32768 --heads 32 \
        --kv-heads 8 --head-dim 128 --json out.json

The user code is ``cp_inductor.parallel.allgather_attention`` (causal: load-balanced shards, rank r
holds chunks r and 2cp-1-r), for the ``hand_*`` arms a hand-written DiT-style non-causal block
(benchmarks/handwritten.py), for the ``ring_*`` arms ``cp_inductor.parallel.ring_attention`` on
the same shards. Method, checks and peak memory as in bench_ulysses.py (the same
Bench, arms alternate per round, slowest rank per iteration, medians of paired ratios). The floor
is one GPU running one rank's share of the FLOPs in one call: Hq/cp query heads (Hkv/cp K/V heads)
over the whole sequence, with SDPA's own kernel choice.
"""

from __future__ import annotations

import argparse
import re

from bench_ulysses import NATIVE_ARMS, Bench, parse_args, run
from common import init_group
from handwritten import allgather_by_hand

from cp_inductor import parallel

OFF = {f"cp_inductor.{n}": False for n in ("head_split",)}
ARMS = {  # name -> (backend, options); "cp_off" is cp_inductor with every all-gather rewrite off
    "eager": (None,),
    "inductor": ("inductor",),
    "cp_off": ("cp_inductor", OFF),
    "cp_inductor": ("cp_inductor",),
    # the attention provider: the program's kernel (cp_inductor before FA4) / FA4 forced
    "cp_program": ("cp_inductor", {"cp_inductor.attention_provider": "program"}),
    "cp_fa4": ("cp_inductor", {"cp_inductor.attention_provider": "fa4"}),
    # the backward's reduce-scatters returned by copy-engine pulls + rank-order sum
    "cp_ogr": ("cp_inductor", {"cp_inductor.owner_grad_return": True}),
    # attention on the rank's own K/V run under the gather / after the reduce-scatter's start
    "cp_go": ("cp_inductor", {"cp_inductor.gather_overlap": True}),
    # the same, the reduce-scatter's work done by the copy engines under that attention
    "cp_go_ogr": ("cp_inductor", {"cp_inductor.gather_overlap": True, "cp_inductor.owner_grad_return": True}),
}
HAND_ARMS = {f"hand_{n}": ARMS[n] for n in ("eager", "inductor", "cp_off", "cp_inductor")}
# The helper's log-sum-exp kernel for the causal chunks, eager and under default Inductor.
KERNEL_ARMS = {f"{arm}_{k}": (ARMS[arm], k) for arm in ("eager", "inductor") for k in ("flash", "cudnn")}
# "<arm>_perchunk": any helper arm with one prefix + diagonal pair per local chunk (the helper's earlier form).
# "<arm>_hg<G>": any arm above on the helper with head_groups=G. "cp_hp<G>": cp_inductor with
# head_split (the attention backward calls split into G head groups); "cp_hpf<G>": forward too.
# The ring helper (cp_inductor.parallel.ring_attention) on the same shards: eager, default
# Inductor, cp_inductor's defaults (ce_rotation where rotations are large enough), ce_rotation off.
RING_ARMS = {
    "ring_eager": (None,), "ring_inductor": ("inductor",), "ring_cp": ("cp_inductor",),
    "ring_cp_program": ("cp_inductor", {"cp_inductor.attention_provider": "program"}),
    "ring_cp_nccl": ("cp_inductor", {"cp_inductor.ce_rotation": False}),
    "ring_cp_wide": ("cp_inductor", {"cp_inductor.narrow_rotation": False}),
    # ce_rotation off, ring graphs compiled with AOTAutograd's CSE (not rank-safe in general)
    "ring_cp_nccl_aotcse": ("cp_inductor", {"cp_inductor.ce_rotation": False, "cp_inductor.ring_cse": "aot"}),
    # the defaults with each backward step's attention call split in 4 head groups (memory)
    # cp = 2: the step-1 contribution sent home once, the step-0 backward under it
    "ring_cp_rgr": ("cp_inductor", {"cp_inductor.ring_grad_return": True}),
    "ring_cp_hp4": ("cp_inductor", {"cp_inductor.head_split": True, "cp_inductor.head_split_groups": 4}),
}
# Inductor's own compute/communication reordering (sinks waits, raises collectives).
ARMS["inductor_reorder"] = ("inductor", {"reorder_for_compute_comm_overlap": True})


class AllGatherBench(Bench):
    title = "K/V all-gather"

    kernel = "auto"  # the helper's log-sum-exp kernel (--kernel)

    @property
    def load_balanced(self) -> bool:
        return self.args.causal

    def allgather_arm(self, backend, options=None, code="helper", kernel=None, head_groups=None):
        a, kernel = self.args, kernel or self.kernel
        if code == "helper":
            fn = lambda q, k, v: parallel.allgather_attention(  # noqa: E731
                q, k, v, layout=a.layout, is_causal=a.causal, kernel=kernel, head_groups=head_groups
            )
            return self.cp_arm(fn, a.layout, backend, options)
        return self.cp_arm(allgather_by_hand, "bshd", backend, options)

    def arm(self, name: str):
        if name in NATIVE_ARMS or name == "floor":
            return super().arm(name)
        if name in RING_ARMS:
            a = self.args
            ring = lambda q, k, v: parallel.ring_attention(q, k, v, layout=a.layout, is_causal=a.causal)  # noqa: E731
            return self.cp_arm(ring, a.layout, *RING_ARMS[name])
        if name in KERNEL_ARMS:
            arm, kernel = KERNEL_ARMS[name]
            return self.allgather_arm(*arm, kernel=kernel)
        if name in HAND_ARMS:
            if self.args.causal:
                raise ValueError("the hand-written all-gather block is not causal: run with --no-causal")
            return self.allgather_arm(*HAND_ARMS[name], code="hand")
        split = re.fullmatch(r"cp_hp(f?)(\d+)", name)
        if split:
            options = {"cp_inductor.head_split": True, "cp_inductor.head_split_groups": int(split[2]),
                       "cp_inductor.head_split_forward": bool(split[1])}
            return self.allgather_arm("cp_inductor", options)
        if name.endswith("_perchunk"):  # the helper's earlier form: one stretch per chunk
            return _per_chunk(*self.arm(name.removesuffix("_perchunk")))
        grouped = re.fullmatch(r"(.+)_hg(\d+)", name)
        if grouped:  # the helper's head_groups=G: K/V gathered per group, again in the backward
            return self.allgather_arm(*ARMS[grouped[1]], head_groups=int(grouped[2]))
        return self.allgather_arm(*ARMS[name])


def _per_chunk(step, results):
    """``step`` run (and so traced) with every local chunk its own stretch: rank cp-1's two
    consecutive chunks as two prefix + diagonal pairs, not one (``parallel.chunk_runs``)."""
    from unittest import mock

    from cp_inductor.parallel import allgather

    def per_chunk(chunks, length):
        return [(c * length, slice(i * length, (i + 1) * length)) for i, c in enumerate(chunks)]

    def patched():
        with mock.patch.object(allgather, "chunk_runs", per_chunk):
            step()

    return patched, results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--kernel", default="auto")
    extra, rest = p.parse_known_args(argv)
    args = parse_args(rest, arms="eager,inductor,cp_off,cp_inductor,native,floor", profile="inductor,cp_inductor")
    init_group(args.fake_rank)
    bench = AllGatherBench(args)
    bench.kernel = extra.kernel
    run(bench, {"kernel": extra.kernel})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
