#!/usr/bin/env bash
# Issue 20 on one 8-GPU lease (nvidia-h100-x8 or nvidia-h200-x8), written ahead so the
# whole experiment is three calls (about 1,450 s of runs within a 1,800 s budget; no
# Transformer Engine needed). Each subcommand is one device call; results under $OUT:
#   run `bash benchmarks/leases/issue20-8gpu.sh parity`   kind nvidia-h100-x8, timeout 600
#   run `bash benchmarks/leases/issue20-8gpu.sh dp`
#   run `bash benchmarks/leases/issue20-8gpu.sh tp`
# parity: TP2×PP2×DP2 against one GPU over 20 steps (bf16, the 1B shape), saved at step 10
#         as TP2×PP2×DP2 and resumed as TP2×DP2 (4 GPUs) and on one GPU.
# dp:     the 1B recipe compiled at DP = 1, 2, 4, 8 (goal: >= 97% per GPU at 8).
# tp:     the 7B layer shape compiled: one GPU, TP2×DP4, TP4×DP2 and PP4 interleaved (v2).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-benchmark-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sort | uniq -c
case "${1:-}" in
parity)
  timeout 590 python3 benchmarks/parallel_parity.py --layouts 1gpu,tp2-pp2-dp2 \
    --save-layout tp2-pp2-dp2 --save-step 10 --resume-layouts tp2-dp2,1gpu --steps 20 \
    --timeout 120 --work /tmp/parity --out "$OUT/parity" 2>&1 | tail -20 ;;
dp)
  timeout 590 python3 benchmarks/parallel_scaling.py --shape 1b --layouts 1gpu,dp2,dp4,dp8 \
    --compile --steps 4 --warmup 3 --accumulation 4 --timeout 135 --out "$OUT/dp" 2>&1 | tail -8 ;;
tp)
  timeout 590 python3 benchmarks/parallel_scaling.py --shape 7b-layers \
    --layouts 1gpu,tp2-dp4,tp4-dp2,pp4-v2 --compile --steps 3 --warmup 3 --accumulation 8 \
    --timeout 140 --out "$OUT/tp" 2>&1 | tail -8 ;;
*) echo "usage: $0 parity|dp|tp"; exit 2 ;;
esac
