#!/usr/bin/env bash
# What ran on nvidia-h100-x4 (4x H100 80GB HBM3), 2026-11-28 02:50-03:08 UTC, after staging
# TE as benchmarks/leases/2026-11-28-te.sh says (`take` per part, c0..c4), one call each:
#   build (carry [.te/c5, .te/rest]), pair, twod, then by hand (GPU 1 beside GPU 0):
#     CUDA_VISIBLE_DEVICES=1 python3 benchmarks/train_throughput.py --shape t5-base --steps 10 \
#       --warmup 5 --variants ours --out $OUT/t5e &
#     CUDA_VISIBLE_DEVICES=0 python3 benchmarks/train_throughput.py --shape t5-base --steps 10 \
#       --warmup 5 --profile --variants ours-compile --out $OUT/t5p
# (`ours` then left model.backend at auto, which resolved to TE with TE installed.)
#   build: TE built, the GPU tests of the TE backend (T5's biased attention through TE's
#          post_scale_bias among them: its first run)        carry [.te/c5, .te/rest]
#   t5:    T5-base, TE's attention with the relative bias's gradient against the torch
#          backend and HF, compiled, one GPU (the 40% MFU goal; 24.4% today)
#   twod:  DP=4 against TP=2 × DP=2 under FSDP and overlapped (needs nvidia-h100-x4)
set -uo pipefail
export PYTHONPATH=/tmp/tesite${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmark-out}
mkdir -p "$OUT"
case "${1:-}" in
build)
  [ -d /tmp/tesite/transformer_engine ] || {
    bash .te/rest/device.sh take > /dev/null
    bash .te/rest/device.sh build 2>&1 | tail -2 | tee "$OUT/te-build.txt"
  }
  timeout 300 bash benchmarks/gpu_tests.sh tests/test_te_backend.py tests/test_te_tensor_parallel.py | tail -30 ;;
t5)
  timeout 580 python3 benchmarks/train_throughput.py --shape t5-base --steps 15 --warmup 5 \
    --variants matmul,ours-compile,ours-compile@model.backend=te,ours-compile@model.backend=te+mixed_precision.fp8=true,hf-compile \
    --out "$OUT/t5" 2>&1 | tail -9 ;;
twod)
  timeout 580 python3 benchmarks/parallel_scaling.py --shape 7b-layers --layouts dp4,tp2-dp2-fsdp,tp2-dp2-ub \
    --compile --steps 3 --warmup 3 --accumulation 2 --timeout 150 --set model.backend=te \
    --set mixed_precision.fp8=true --set training.micro_batch_size=8 --out "$OUT/twod" 2>&1 | tail -8 ;;
ub)  # one GPU at 8 x 2 beside TP=2 overlapped at 16 x 1 (mb16: the same tokens a step), then ring exchange
  S=(--shape 7b-layers --compile --steps 3 --warmup 3 --timeout 120 --set model.backend=te
     --set mixed_precision.fp8=true --accumulation 2 --set training.micro_batch_size=8)
  timeout 280 python3 benchmarks/parallel_scaling.py "${S[@]}" --layouts 1gpu,tp2-ub-mb16 \
    --out "$OUT/ub-default" 2>&1 | tail -4
  timeout 125 python3 benchmarks/parallel_scaling.py "${S[@]}" --layouts tp2-ub-mb16 \
    --set 'parallel.tp_comm_overlap_config={proj_fprop: {method: ring_exchange}, fc2_fprop: {method: ring_exchange}}' \
    --out "$OUT/ub-ring" 2>&1 | tail -1
  timeout 125 python3 benchmarks/parallel_scaling.py "${S[@]}" --layouts tp2-ub-mb16 \
    --set 'parallel.tp_comm_overlap_config={proj_fprop: {num_sm: 8, num_splits: 2}, fc2_fprop: {num_sm: 8, num_splits: 2}}' \
    --out "$OUT/ub-sm8" 2>&1 | tail -1 ;;
pair)  # four GPUs: T5 on the fourth while the overlap runs on the first two
  CUDA_VISIBLE_DEVICES=3 bash "$0" t5 > "$OUT/t5.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0,1 bash "$0" ub
  wait; tail -9 "$OUT/t5.log" ;;
*) echo "usage: $0 build|t5|twod|ub|pair"; exit 2 ;;
esac
