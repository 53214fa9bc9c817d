#!/usr/bin/env bash
# SwiGLU/GeGLU's forward as one Triton pass too (training/models/gated_grad.py), against
# the tree with only the one-pass backward (.base/tree/ = `git archive eb29343`, carried),
# Llama 1B bf16 and fp8 (torchao tensorwise; the op now hides the activation from the
# fp8 cast that Inductor fused into it) with HF compiled in the same call. One machine,
# one GPU, carry [.whl, .base] (.whl: pydantic, zstandard, torchao 0.18).
#   bash benchmarks/leases/2026-11-28-gated-forward.sh 1b      # after, before, HF
#   bash benchmarks/leases/2026-11-28-gated-forward.sh check   # the kernels alone, GPU tests, T5-base mb 128
set -uo pipefail
. benchmarks/leases/setup.sh
case "${1:-}" in
1b)
  timeout 250 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
    --variants matmul,ours-compile,ours-compile-fp8,hf-compile --out "$OUT/after" 2>&1 | tail -7
  (cd .base/tree && timeout 200 python3 benchmarks/train_throughput.py --shape 1b --steps 10 \
    --warmup 4 --variants ours-compile,ours-compile-fp8 --out "$OUT/before" 2>&1 | tail -5) ;;
check)
  timeout 100 python3 benchmarks/gated_activation.py --out "$OUT" 2>&1 | tail -3
  timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py -k "gated or t5 or fused" \
    2>&1 | tail -2
  timeout 200 python3 benchmarks/train_throughput.py --shape t5-base --steps 10 --warmup 5 \
    --micro-batch 128 --variants ours-compile --out "$OUT/t5" 2>&1 | tail -3 ;;
*) echo "usage: $0 1b|check"; exit 2 ;;
esac
rm -rf "$OUT"/*/shards-* "$OUT"/*/tokenizer-* "$OUT"/*/run-*
