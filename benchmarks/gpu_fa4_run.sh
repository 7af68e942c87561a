#!/usr/bin/env bash
# One H200 with FA4 installed under /tmp/site (see docs/measurements.md, "FA4 on the GPU machine"):
# the FA4 GPU tests, then the benchmarks behind the FA4 goals, logs under ${OUT:-bench_out}.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
out=${OUT:-bench_out}; mkdir -p "$out"
quiet() { grep -v "Warning\|exe_args\|warnings.warn\|^ *$"; }
timeout 120 python3 -m pytest -q tests/test_gpu_fa4.py -p no:cacheprovider -W ignore -k "calling or compiled_dense" 2>&1 | tee "$out/gpu_fa4_new.log" | grep -E "passed|failed|^E " | head -20
cd benchmarks
timeout 200 python3 bench_thd.py --tokens 65536 --head-dim 128 --kinds random --masks causal full --rounds 2 --iters 3 \
  --json "$out/thd_t64k_d128.json" 2>&1 | quiet | tee "$out/thd_t64k_d128.log" | tail -8
timeout 100 python3 bench_thd.py --block --tokens 65536 --head-dim 128 --kinds random --rounds 2 --iters 3 \
  --json "$out/block_t64k.json" 2>&1 | quiet | tee "$out/block_t64k.log" | tail -5
for bench in "bench_ulysses.py --arms inductor,cp_program,cp_inductor,floor" \
             "bench_allgather.py --arms inductor,cp_program,cp_inductor,ring_inductor,ring_cp_program,ring_cp,floor"; do
  name=${bench%%.py*}
  timeout 110 python3 $bench --fake-rank 0/2 --seq 32768 --heads 32 --kv-heads 8 --head-dim 128 --rounds 2 --iters 5 \
    --warmup 3 --json "$out/${name}_s32k.json" 2>&1 | quiet | tee "$out/${name}_s32k.log" | tail -14
done
