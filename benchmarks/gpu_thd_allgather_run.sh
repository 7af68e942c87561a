#!/usr/bin/env bash
# One H200 with FA4 installed under /tmp/site (docs/testing.md, "FlashAttention-4"): the GPU tests
# of packed sequences through K/V all-gather CP, then bench_thd_allgather.py; logs under ${OUT:-bench_out}.
# Usage: gpu_thd_allgather_run.sh tests | gpu_thd_allgather_run.sh bench NAME [bench_thd_allgather.py args]
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-bench_out}; mkdir -p "$out"
quiet() { grep -v "Warning\|exe_args\|warnings.warn\|^ *$"; }
if [ "$1" = tests ]; then
  timeout 240 python3 -m pytest -q -s tests/test_gpu_fa4.py -p no:cacheprovider -W ignore -k "thd_allgather" 2>&1 \
    | tee "$out/gpu_thd_allgather.log" | grep -E "passed|failed|^E |^flash|^eager" | head -30
else
  name=$2; shift 2
  (cd benchmarks && python3 bench_thd_allgather.py --json "$out/$name.json" "$@" 2>&1 | quiet | tee "$out/$name.log" | tail -20)
fi
