#!/usr/bin/env bash
# One GPU, second call of two (carrying .whl/p2; docs/testing.md): the context_parallel pass's
# one-rank compute on the fake group, per style and auto, with the cost model's prediction beside
# it (bench_auto_cp.py); logs and JSON under $OUT.
#   attention: one attention call per (T, documents, cp)      model: HF Llama's training step
source benchmarks/gpu_fa4_install.sh
level=${1:-attention}
cd benchmarks
timeout "${BENCH_S:-540}" python3 bench_auto_cp.py --level "$level" --cp ${CPS:-2 4 8} --tokens ${TOKENS:-65536} --docs ${DOCS:-1 16} ${STYLES:+--styles $STYLES} \
  --iters 5 ${COST_DEVICE:+--cost-device "$COST_DEVICE"} --json "$out/auto_cp_$level.json" 2>&1 | grep -v "Warning\|warn" | tee "$out/auto_cp_$level.log" | tail -40
if [ -n "$GPU_ONE" ]; then  # the one-GPU regression tests with FA4 installed
  cd ..
  timeout 240 python3 -m pytest -q -n 8 tests/test_gpu_one.py -p no:cacheprovider -W ignore -rf --tb=line 2>&1 \
    | tee "$out/gpu_one_fa4.log" | grep -E "passed|failed|^FAILED|^E " | head -30
fi
