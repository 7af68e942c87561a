#!/usr/bin/env bash
# One H200, second call of two (docs/testing.md: the first copies .whl/p1 to /root/parts): the
# context_parallel pass's one-rank compute on the fake group, per style and auto, with the cost
# model's prediction beside it (bench_auto_cp.py); logs and JSON under $OUT.
#   attention: one attention call per (T, documents, cp)      model: HF Llama's training step
source benchmarks/gpu_fa4_install.sh
level=${1:-attention}
cd benchmarks
timeout "${BENCH_S:-540}" python3 bench_auto_cp.py --level "$level" --cp 2 4 8 --tokens ${TOKENS:-65536} --docs 1 16 \
  --iters 5 --json "$out/auto_cp_$level.json" 2>&1 | grep -v "Warning\|warn" | tee "$out/auto_cp_$level.log" | tail -40
