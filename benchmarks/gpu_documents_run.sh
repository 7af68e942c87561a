#!/usr/bin/env bash
# One GPU, carrying .whl/p1 at a first call (the cuDNN frontend installed: `restart` needs no more)
# or .whl/p2 at a second (FA4 too; docs/testing.md), then, logs and JSON under $OUT:
#   tests:    the document-mask and flex CP GPU tests, then `bench` (SKIP_TESTS=1: bench only)
#   bench:    the plan's host costs, flex document attention alone, torch's flex CP (T64K cp 2)
#   hf-flex:  HF Llama with flex_attention, T16K packed and plain
#   hf-sdpa:  HF Llama with sdpa, T16K packed and plain
#   titan:    a torchtitan-style decoder with a flex document mask, T16K
#   profile:  each arm's kernels and idle time (flex alone, HF flex packed)
#   quick:    the tests, the plan, flex alone, flex CP with the plan read first, HF flex packed
#   cp:       the tests, then torch's flex CP alone (T64K cp 2, no balancer and head-tail)
#   regress:  the one-GPU regression tests (test_gpu_one, test_gpu_fa4), one bench_thd and one
#             bench_ulysses --fake-rank arm through the shared timing harness
#   verify:   the tests, the one-GPU regression tests with FA4 on the path, flex alone
#   models:   HF Llama T16K, sdpa then flex_attention (IMPLS="sdpa": one), packed and plain, every
#             arm (eager included; ARMS, ITERS, INTERMEDIATE (MLP width), MODEL_S (s per impl), TAG)
#   cp-train: the context-parallel GPU tests, flex CP training included (two ranks sharing the GPU;
#             the other modes' test step leaves it out: 150 s on an H100)
#   all-tests: every GPU test in one call: cp-train's in the background beside verify's (no flex alone)
#   flex:     flex document attention alone, T32K and T64K (FLEX_T, FLEX_DOCS: the shapes; SEEDS random packs
#             each; PACKS="random equal": documents of one length too; FLEX_S seconds)
#   no-break: the tests, then HF Llama flex_attention T16K packed and plain with default Inductor
#             as torch ships and tracing over warnings (inductor_no_break), cp_inductor, the floor
#   restart:  a restarted job's first call (warm caches) on CUDA, plain SDPA (STYLES=a2a: with CP;
#             RESTART_ARGS="--profile $OUT/prof --provider program" passed on; TAG names the logs)
#   graphs:   the tests, then HF Llama sdpa T16K packed and plain under CUDA graphs (reduce-overhead):
#             default Inductor against cp_inductor with document_mask_capacity
source benchmarks/gpu_fa4_install.sh
filter() { grep -v "Warning\|warnings.warn\|exe_args\|_warn_once\|SOLUTION\|If you want\|This will allow\|_FLEX_ATTENTION\|^ *$"; }
hf() {  # impl, seconds
  timeout "$2" python3 bench_hf_masks.py --impl "$1" --tokens 16384 --docs 8 1 --iters 5 --arms inductor,cp_inductor,floor \
    --json "$out/hf_$1_t16k.json" 2>&1 | filter | tee "$out/hf_$1_t16k.log" | tail -16
}
flex_alone() {  # seconds
  timeout "$1" python3 bench_flex_documents.py --tokens ${FLEX_T:-32768 65536} --docs ${FLEX_DOCS:-8 16} --seeds "${SEEDS:-1}" --packs ${PACKS:-random} \
    --json "$out/flex_documents.json" 2>&1 | filter | tee "$out/flex_documents.log" | tail -"${TAIL:-8}"
}
bench() {
  timeout 90 python3 bench_document_plan.py --tokens 32768 --docs 8 --capacity 16 64 256 1024 --json "$out/document_plan.json" 2>&1 \
    | filter | tee "$out/document_plan.log" | tail -14
  flex_alone 150
  timeout 170 python3 bench_flex_cp.py --tokens 65536 --docs 16 --cp 2 --balances none headtail --json "$out/flex_cp_t64k.json" 2>&1 \
    | filter | tee "$out/flex_cp_t64k.log" | tail -14
}
quick() {  # what the plan changes, then HF flex packed in what time is left
  timeout 60 python3 bench_document_plan.py --tokens 32768 --docs 8 --capacity 16 64 --json "$out/document_plan.json" 2>&1 \
    | filter | tee "$out/document_plan.log" | tail -12
  flex_alone 100
  CP_INDUCTOR_DOCUMENT_SPECULATE=0 timeout 100 python3 bench_flex_cp.py --tokens 65536 --docs 16 --cp 2 --balances none \
    --json "$out/flex_cp_t64k_read_first.json" 2>&1 | filter | tee "$out/flex_cp_t64k_read_first.log" | tail -8
  timeout "${HF_S:-280}" python3 bench_hf_masks.py --impl flex_attention --tokens 16384 --docs 8 --iters 5 \
    --arms inductor,cp_inductor,floor --json "$out/hf_flex_t16k.json" 2>&1 | filter | tee "$out/hf_flex_t16k.log" | tail -10
}
mode=${1:-tests}
if [ "$mode" = all-tests ]; then
  TEST_S=${TEST_S:-420} bash "$0" cp-train > "$out/cp_train.out" 2>&1 &
  FLEX_S=1 bash "$0" verify
  wait
  cat "$out/cp_train.out"
  exit
fi
if { [ "$mode" = tests ] || [ "$mode" = verify ] || [ "$mode" = no-break ] || [ "$mode" = quick ] || [ "$mode" = graphs ] || [ "$mode" = cp ]; } && [ -z "$SKIP_TESTS" ]; then
  timeout 240 python3 -m pytest -q tests/test_document_mask.py tests/test_flex_cp.py tests/test_context_parallel.py -p no:cacheprovider -W ignore -k "gpu and not flex_training" 2>&1 \
    | tee "$out/gpu_documents.log" | grep -E "passed|failed|^E " | head -30
fi
cd benchmarks
case "$mode" in
tests|bench) bench ;;
cp)
  timeout 200 python3 bench_flex_cp.py --tokens 65536 --docs 16 --cp 2 --balances none headtail --json "$out/flex_cp_t64k.json" 2>&1 \
    | filter | tee "$out/flex_cp_t64k.log" | tail -14 ;;
quick) quick ;;
verify)
  cd ..
  timeout 170 python3 -m pytest -q -n 8 tests/test_gpu_one.py tests/test_gpu_fa4.py -p no:cacheprovider -W ignore -rf --tb=line 2>&1 \
    | tee "$out/gpu_one_fa4.log" | grep -E "passed|failed|^FAILED|^E " | head -30
  cd benchmarks
  flex_alone 130 ;;
cp-train)
  cd ..
  timeout "${TEST_S:-240}" python3 -m pytest -q tests/test_context_parallel.py -k gpu -p no:cacheprovider -W ignore -rf \
    --tb=short 2>&1 | tee "$out/gpu_cp_training.log" | grep -E "passed|failed|Error|^E " | tail -30 ;;
flex)
  flex_alone "${FLEX_S:-130}" ;;
models)
  for impl in ${IMPLS:-sdpa flex_attention}; do
    timeout "${MODEL_S:-270}" python3 bench_hf_masks.py --impl $impl --tokens 16384 --docs 8 1 --iters "${ITERS:-5}" \
      --arms "${ARMS:-eager,inductor,cp_inductor,floor}" ${INTERMEDIATE:+--intermediate "$INTERMEDIATE"} \
      --json "$out/hf_${impl}_t16k${TAG:-}.json" 2>&1 | filter | tee "$out/hf_${impl}_t16k${TAG:-}.log" | tail -12
  done ;;
hf-flex) hf flex_attention 560 ;;
no-break)
  timeout 330 python3 bench_hf_masks.py --impl flex_attention --tokens 16384 --docs 8 1 --iters 8 \
    --arms inductor,inductor_no_break,cp_inductor,floor --json "$out/hf_flex_no_break_t16k.json" 2>&1 | filter \
    | tee "$out/hf_flex_no_break_t16k.log" | tail -14 ;;
restart)  # none alone: each row's cold fills compile Triton kernels (a2a's did not fit 300 s)
  timeout "${RESTART_S:-540}" python3 bench_compile_time.py --restart --device cuda --layers 4 --styles ${STYLES:-none} \
    --repeats "${REPEATS:-2}" --dtype "${DTYPE:-float32}" --seq "${SEQ:-256}" ${RESTART_ARGS:-} --json "$out/compile_restart_cuda${TAG:-}.json" 2>&1 | filter \
    | tee "$out/compile_restart_cuda${TAG:-}.log" | tail -"${TAIL:-4}" ;;
hf-sdpa) hf sdpa 560 ;;
graphs)
  timeout 330 python3 bench_hf_masks.py --impl sdpa --tokens 16384 --docs 8 1 --iters 10 --capacity 32 \
    --arms inductor,cp_inductor,inductor_graphs,cp_graphs --json "$out/hf_sdpa_graphs_t16k.json" 2>&1 | filter \
    | tee "$out/hf_sdpa_graphs_t16k.log" | tail -12 ;;
regress)
  timeout 300 python3 -m pytest -q -n 4 ../tests/test_gpu_one.py ../tests/test_gpu_fa4.py -p no:cacheprovider -W ignore 2>&1 \
    | tee "$out/gpu_regress.log" | grep -E "passed|failed|^E |^FAILED"
  timeout 120 python3 bench_thd.py --tokens 32768 --head-dim 128 --kinds random --iters 3 --rounds 1 \
    --json "$out/thd_t32k.json" 2>&1 | filter | tee "$out/thd_t32k.log" | tail -8
  timeout 120 python3 bench_ulysses.py --fake-rank 0/2 --seq 32768 --arms inductor,cp_inductor,floor --iters 10 \
    --json "$out/ulysses_fake_t32k.json" 2>&1 | filter | tee "$out/ulysses_fake_t32k.log" | tail -10 ;;
titan)
  timeout 560 python3 bench_titan_block.py --tokens 16384 --docs 8 --json "$out/titan_block_t16k.json" 2>&1 | filter \
    | tee "$out/titan_block_t16k.log" | tail -10 ;;
profile)
  timeout 200 python3 bench_flex_documents.py --tokens 32768 65536 --docs 8 16 --arms cp_inductor,floor,floor_plan --profile \
    --json "$out/flex_profile.json" 2>&1 | filter | tee "$out/flex_profile.log" | tail -80
  timeout 380 python3 bench_hf_masks.py --impl flex_attention --tokens 16384 --docs 8 --iters 5 --arms cp_inductor,floor --profile \
    --json "$out/hf_flex_profile.json" 2>&1 | filter | tee "$out/hf_flex_profile.log" | tail -60 ;;
esac
