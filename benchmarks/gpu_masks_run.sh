#!/usr/bin/env bash
# One H200, second call of two (docs/testing.md): FA4's wheels joined and installed under
# /tmp/site, then the document-mask GPU tests and the HF Llama benchmark; logs under $OUT.
source benchmarks/gpu_fa4_install.sh
timeout 150 python3 -m pytest -q tests/test_document_mask.py -p no:cacheprovider -W ignore -k "gpu_flex or gpu_document" 2>&1 | tee "$out/gpu_document_mask.log" | grep -E "passed|failed|^E " | head -20
cd benchmarks
timeout 200 python3 bench_flex_documents.py --tokens 32768 65536 32768 --docs 8 16 64 --json "$out/flex_documents.json" 2>&1 \
  | grep -v "Warning\|warnings.warn\|exe_args" | tee "$out/flex_documents.log" | tail -12
timeout 330 python3 bench_hf_masks.py --impl flex_attention --tokens 16384 --docs 8 1 --iters 5 --arms inductor,cp_inductor,floor --json "$out/hf_flex_t16k.json" 2>&1 \
  | grep -v "Warning\|warnings.warn\|exe_args" | tee "$out/hf_flex_t16k.log" | tail -16
