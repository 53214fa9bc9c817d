#!/usr/bin/env bash
# The GPU runs of 2026-11-28 (benchmarks/RESULTS.md, "TE's fused MLP under the userbuffers
# overlap; TP=2 compiled"), on one nvidia-h100-x2 lease (x4 was asked for, none came; the
# 2-D rows moved to te-next.sh) with Transformer Engine staged as
# ../shared/te/README.md says, the core wheel re-split into parts of 52.5 MB so that the
# last part and .te/rest travel together with the tree under 64 MiB, device.sh copied
# into .te/rest (after `bash ../shared/te/prepare.sh`):
#   cat .te/c*/part-* > /tmp/core.whl && rm -r .te/c? && (cd /tmp && split -b 52500000 -d -a 1 core.whl part-)
#   for i in 0 1 2 3 4 5; do mkdir -p .te/c$i && mv /tmp/part-$i .te/c$i/; done
#   cp ../shared/te/device.sh .te/rest/
#   for N in 0..4: run `bash .te/rest/device.sh take`  carry [.te/cN, .te/rest/device.sh]
#   run `bash benchmarks/leases/2026-11-28-te.sh build`  carry [.te/c5, .te/rest]
#   run `bash benchmarks/leases/2026-11-28-te.sh tp`, then `tp16`, then `profile`
# A second lease (SDPA in place of TE's attention, model.attention_backend=cudnn): the same
# staging, then `attn` (builds TE first where it is not built yet) carry [.te/c5, .te/rest],
# then `delayed` (`attn1b` did not run).
set -uo pipefail
export PYTHONPATH=/tmp/tesite${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmark-out}
mkdir -p "$OUT"
TE_FP8=(--set model.backend=te --set mixed_precision.fp8=true --set training.micro_batch_size=8)
case "${1:-}" in
build)
  bash .te/rest/device.sh take > /dev/null
  bash .te/rest/device.sh build 2>&1 | tail -5 | tee "$OUT/te-build.txt"
  timeout 240 bash benchmarks/gpu_tests.sh tests/test_te_backend.py tests/test_te_tensor_parallel.py | tail -25
  # bf16, so the comparison measures the overlap and not fp8 scale rounding
  timeout 240 python3 benchmarks/parallel_parity.py --shape 1b --set model.num_layers=8 \
    --set model.backend=te --layouts 1gpu,tp2-sp,tp2-ub --save-layout none --steps 12 \
    --micro-batch 2 --global-batch 16 --timeout 75 --out "$OUT/parity" 2>&1 | tail -25 ;;
tp)
  timeout 580 python3 benchmarks/parallel_scaling.py --shape 7b-layers --layouts 1gpu,tp2-sp,tp2-ub \
    --compile --steps 3 --warmup 3 --accumulation 2 --timeout 180 "${TE_FP8[@]}" \
    --out "$OUT/tp" 2>&1 | tail -30 ;;
tp16)  # TP=2 at micro-batch 16 x 1: the same 32,768 tokens a step as one GPU's 8 x 2
  S=(--shape 7b-layers --compile --steps 3 --warmup 3 --timeout 170 --set model.backend=te
     --set mixed_precision.fp8=true)
  timeout 250 python3 benchmarks/parallel_scaling.py "${S[@]}" --layouts tp2 --accumulation 2 \
    --set training.micro_batch_size=8 --out "$OUT/tp-a" 2>&1 | tail -4
  timeout 330 python3 benchmarks/parallel_scaling.py "${S[@]}" --layouts tp2-ub,tp2 --accumulation 1 \
    --set training.micro_batch_size=16 --out "$OUT/tp-b" 2>&1 | tail -5 ;;
profile)
  timeout 280 python3 benchmarks/parallel_scaling.py --shape 7b-layers --compile --steps 3 --warmup 3 \
    --timeout 250 --set model.backend=te --set mixed_precision.fp8=true --layouts tp2-ub \
    --accumulation 1 --set training.micro_batch_size=16 --profile --out "$OUT/prof" 2>&1 | tail -3 ;;
attn)  # TE's attention against SDPA's cuDNN kernel, one GPU at 8 x 2 and TP=2 overlapped at 16 x 1
  [ -d /tmp/tesite/transformer_engine ] || {
    bash .te/rest/device.sh take > /dev/null
    bash .te/rest/device.sh build 2>&1 | tail -2 | tee "$OUT/te-build.txt"
  }
  S=(--shape 7b-layers --compile --steps 3 --warmup 3 --timeout 150 --set model.backend=te
     --set mixed_precision.fp8=true)
  for attention in auto cudnn; do
    timeout 200 python3 benchmarks/parallel_scaling.py "${S[@]}" --layouts 1gpu --accumulation 2 \
      --set training.micro_batch_size=8 --set model.attention_backend=$attention \
      --out "$OUT/one-$attention" 2>&1 | tail -1
    timeout 200 python3 benchmarks/parallel_scaling.py "${S[@]}" --layouts tp2-ub --accumulation 1 \
      --set training.micro_batch_size=16 --set model.attention_backend=$attention \
      --out "$OUT/tp2-$attention" 2>&1 | tail -1
  done ;;
delayed)  # delayed scaling (TE's attention): one GPU at 8 x 2, TP=2 overlapped at 16 x 1
  S=(--shape 7b-layers --compile --steps 3 --warmup 3 --timeout 120 --set model.backend=te
     --set mixed_precision.fp8=true --set mixed_precision.fp8_recipe=delayed)
  timeout 125 python3 benchmarks/parallel_scaling.py "${S[@]}" --layouts 1gpu --accumulation 2 \
    --set training.micro_batch_size=8 --out "$OUT/one-delayed" 2>&1 | tail -1
  timeout 125 python3 benchmarks/parallel_scaling.py "${S[@]}" --layouts tp2-ub --accumulation 1 \
    --set training.micro_batch_size=16 --out "$OUT/tp2-delayed" 2>&1 | tail -1 ;;
attn1b)  # (not run: device time was spent) the 1B recipe, TE fp8 delayed compiled, TE's attention against SDPA's cuDNN, beside HF
  fp8=model.backend=te+mixed_precision.fp8=true+mixed_precision.fp8_recipe=delayed
  timeout 580 python3 benchmarks/train_throughput.py --shape 1b --steps 8 --warmup 4 \
    --variants hf-compile,ours-compile@$fp8,ours-compile@$fp8+model.attention_backend=cudnn \
    --out "$OUT/1b" 2>&1 | tail -8 ;;
*) echo "usage: $0 build|tp|tp16|profile|attn|delayed|attn1b"; exit 2 ;;
esac
