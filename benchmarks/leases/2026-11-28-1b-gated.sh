#!/usr/bin/env bash
# Llama 1B with and without the one-pass SwiGLU backward (training/models/gated_grad.py),
# bf16 and fp8 (torchao tensorwise), HF compiled as the peer. One machine, one GPU,
# carry [.whl, .base] with .base/tree/ = `git archive 2a71d99` (the tree before gated_grad).
#   bash benchmarks/leases/2026-11-28-1b-gated.sh ours    # matmul peak, after and before, ours only
#   bash benchmarks/leases/2026-11-28-1b-gated.sh peer    # HF compiled, the activation alone, GPU tests
set -uo pipefail
export PYTHONPATH=/tmp/tesite${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmark-out}
mkdir -p "$OUT"
python3 -c "import pydantic, zstandard" 2>/dev/null || pip install -q --no-deps --target /tmp/tesite .whl/*.whl
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
case "${1:-}" in
ours)
  timeout 280 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
    --variants matmul,ours-compile,ours-compile-fp8 --out "$OUT/after" 2>&1 | tail -6
  (cd .base/tree && timeout 250 python3 benchmarks/train_throughput.py --shape 1b --steps 10 \
    --warmup 4 --variants ours-compile,ours-compile-fp8 --out "$OUT/before" 2>&1 | tail -5) ;;
peer)
  timeout 200 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
    --variants matmul,hf-compile --out "$OUT/hf" 2>&1 | tail -4
  timeout 120 python3 benchmarks/gated_activation.py --out "$OUT" 2>&1 | tail -12
  timeout 230 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py tests/test_fp8.py \
    2>&1 | tail -15 ;;
*) echo "usage: $0 ours|peer"; exit 2 ;;
esac
rm -rf "$OUT"/*/shards-* "$OUT"/*/tokenizer-* "$OUT"/*/run-*
