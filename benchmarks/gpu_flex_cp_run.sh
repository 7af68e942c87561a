#!/usr/bin/env bash
# One H200, after the first call of docs/testing.md's two (it copies .whl/p1 to /root/parts):
# FA4's wheels joined and installed under /tmp/site (once per machine), then
#   tests:  the flex CP GPU tests and torch's flex CP benchmark (one rank's compute, T64K cp 2)
#   hf:     HF Llama with flex_attention, T16K packed and plain
# logs and JSON under $OUT.
source benchmarks/gpu_fa4_install.sh
filter() { grep -v "Warning\|warnings.warn\|exe_args\|_warn_once\|SOLUTION\|If you want\|This will allow\|_FLEX_ATTENTION\|^ *$"; }
case "${1:-tests}" in
tests)
  [ -n "$SKIP_TESTS" ] ||
  timeout 300 python3 -m pytest -q tests/test_flex_cp.py tests/test_document_mask.py -p no:cacheprovider -W ignore -k gpu 2>&1 | tee "$out/gpu_flex_cp.log" | grep -E "passed|failed|^E "
  cd benchmarks
  timeout 330 python3 bench_flex_cp.py --tokens 65536 --docs 16 --cp 2 --balances none headtail --json "$out/flex_cp_t64k.json" 2>&1 \
    | filter | tee "$out/flex_cp_t64k.log" | tail -14 ;;
hf)
  cd benchmarks
  timeout 560 python3 bench_hf_masks.py --impl flex_attention --tokens 16384 --docs 8 1 --iters 5 --arms inductor,cp_inductor,floor --json "$out/hf_flex_t16k.json" 2>&1 \
    | filter | tee "$out/hf_flex_t16k.log" | tail -16 ;;
esac
