#!/usr/bin/env bash
# Which kernel backend `model.backend: auto` should pick (nvidia-h100-x2, 2026-11-28): the
# torch backend against Transformer Engine, bf16 and fp8, at T5-base (hidden 768) and GPT-2
# 350M (hidden 1024), compiled, beside HF compiled; after staging TE as
# benchmarks/leases/2026-11-28-te.sh says (`take` per part), one call per subcommand:
#   build: TE built, the GPU tests of the TE backend (the T5 biased-attention test's rerun
#          after the SDPA fix)                                carry [.te/c5, .te/rest]
#   pair:  T5-base on GPU 0 beside 350M on GPU 1
set -uo pipefail
export PYTHONPATH=/tmp/tesite${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmark-out}
mkdir -p "$OUT"
TORCH=ours-compile@model.backend=torch
TE=ours-compile@model.backend=te
FP8=mixed_precision.fp8=true
case "${1:-}" in
build)
  [ -d /tmp/tesite/transformer_engine ] || {
    bash .te/rest/device.sh take > /dev/null
    bash .te/rest/device.sh build 2>&1 | tail -2 | tee "$OUT/te-build.txt"
  }
  timeout 200 bash benchmarks/gpu_tests.sh tests/test_te_backend.py | tail -16 ;;
pair)
  CUDA_VISIBLE_DEVICES=1 timeout 560 python3 benchmarks/train_throughput.py --shape 350m --steps 10 --warmup 5 \
    --variants matmul,$TORCH,$TE,$TORCH+$FP8,$TE+$FP8,ours-compile@$FP8,hf-compile --out "$OUT/350m" > "$OUT/350m.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 timeout 560 python3 benchmarks/train_throughput.py --shape t5-base --steps 15 --warmup 5 \
    --variants matmul,$TORCH,$TE,$TORCH+$FP8,$TE+$FP8,ours-compile,hf-compile --out "$OUT/t5" 2>&1 | tail -10
  wait; tail -10 "$OUT/350m.log" ;;
*) echo "usage: $0 build|pair"; exit 2 ;;
esac
