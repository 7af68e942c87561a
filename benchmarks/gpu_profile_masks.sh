#!/usr/bin/env bash
# One H200, second call of two (docs/testing.md): where a document-mask step's time goes: the
# plan's host costs and capacity padding, then HF flex's kernels per arm; logs under $OUT.
source benchmarks/gpu_fa4_install.sh
cd benchmarks
timeout 120 python3 bench_document_plan.py --tokens 32768 --docs 8 --capacity 64 256 1024 4096 --json "$out/document_plan.json" > "$out/document_plan.log" 2>&1
grep -v "Warning\|warn" "$out/document_plan.log" | tail -20
timeout 300 python3 bench_hf_masks.py --impl flex_attention --tokens 16384 --docs ${HF_DOCS:-8} --iters 5 --arms ${HF_ARMS:-cp_inductor,floor} --profile --json "$out/hf_flex_profile.json" > "$out/hf_flex_profile.log" 2>&1
echo "hf rc $?"; grep -v "Warning\|warnings.warn\|exe_args\|_warn_once" "$out/hf_flex_profile.log" | tail -60
