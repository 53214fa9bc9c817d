#!/usr/bin/env bash
# Llama 1B with and without the one-pass SwiGLU backward (training/models/gated_grad.py),
# bf16 and fp8 (torchao tensorwise), HF compiled as the peer. One machine, one GPU,
# carry [.whl, .base] (.whl holds torchao 0.18 too, for fp8) with .base/tree/ = `git archive 2a71d99` (the tree before gated_grad).
#   bash benchmarks/leases/2026-11-28-1b-gated.sh ours    # matmul peak, after and before, ours only
#   bash benchmarks/leases/2026-11-28-1b-gated.sh peer    # HF compiled, the activation alone, GPU tests
set -uo pipefail
. benchmarks/leases/setup.sh
case "${1:-}" in
ours|fp8)  # `ours` ran first without torchao there (fp8 failed); `fp8` is its fp8 half
  variants=$([ "$1" = fp8 ] && echo ours-compile-fp8 || echo ours-compile,ours-compile-fp8)
  timeout 280 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
    --variants "matmul,$variants" --out "$OUT/after" 2>&1 | tail -6
  (cd .base/tree && timeout 250 python3 benchmarks/train_throughput.py --shape 1b --steps 10 \
    --warmup 4 --variants "$variants" --out "$OUT/before" 2>&1 | tail -5) ;;
peer)
  timeout 200 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
    --variants matmul,hf-compile --out "$OUT/hf" 2>&1 | tail -4
  timeout 120 python3 benchmarks/gated_activation.py --out "$OUT" 2>&1 | tail -12
  timeout 230 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py tests/test_fp8.py \
    2>&1 | tail -15 ;;
*) echo "usage: $0 ours|fp8|peer"; exit 2 ;;
esac
rm -rf "$OUT"/*/shards-* "$OUT"/*/tokenizer-* "$OUT"/*/run-*
