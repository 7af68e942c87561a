#!/usr/bin/env bash
# One device-tool call: install, GPU tests and demo on NCCL, then the benchmark at the given shapes.
#   bash benchmarks/gpu_run.sh "--seq 32768" "--seq 65536"
# TRAIN="--seq 8192 --dim 1024;--seq 65536 --dim 4096 --heads 32" adds training-step benchmarks;
# SKIP_TESTS=1 skips the pytest + demo part, TESTS="-k allgather" selects tests (and skips the demo);
# BENCH=bench_allgather.py benchmarks K/V all-gather instead of Ulysses; SHAPE_TIMEOUT=s bounds each
# benchmark shape (so one device call ends inside its limit). Logs and JSON go to $OUT (or ./bench_out).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-bench_out}; mkdir -p "$OUT"
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/install.log 2>&1 || { cat /tmp/install.log; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv > "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-3600}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_nccl.py tests/test_gpu_multi.py ${TESTS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
  [ -z "${TESTS:-}" ] && torchrun --nproc-per-node "$NGPU" -m cp_inductor.demo --device cuda 2>&1 | tee "$OUT/demo.log" | grep -v Warning | tail -12
fi
IFS=';' read -ra TRAIN_SHAPES <<< "${TRAIN:-}"
j=0
for shape in "${TRAIN_SHAPES[@]}"; do
  j=$((j+1))
  torchrun --nproc-per-node "$NGPU" benchmarks/bench_train_step.py $shape --json "$OUT/train_$j.json" \
    > /tmp/train_$j.log 2>&1 || tail -30 /tmp/train_$j.log
  grep -v -i warn /tmp/train_$j.log | tail -12
done
i=0
for shape in "$@"; do
  i=$((i+1))
  timeout "${SHAPE_TIMEOUT:-3600}" torchrun --nproc-per-node "$NGPU" benchmarks/${BENCH:-bench_ulysses.py} $shape --json "$OUT/bench_$i.json" \
    > /tmp/bench_$i.log 2>&1 || tail -30 /tmp/bench_$i.log
  grep "^arm " /tmp/bench_$i.log; grep -v -i warn /tmp/bench_$i.log | grep -A30 "fwd+bwd, cp="
done
