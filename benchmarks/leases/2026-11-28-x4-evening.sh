#!/usr/bin/env bash
# One nvidia-h200-x4 lease, 2026-11-28 evening; carry [.whl] (pydantic, zstandard,
# torchao 0.18). Each subcommand is one device call; results under $OUT.
#   one: four jobs side by side, one per GPU group (each job's variants run one after
#        another on its own GPUs, so every comparison is within one GPU):
#        GPU 0    the CUDA-graph GPU tests (fp8 among them) and the host-sync detector's,
#                 then 1B fp8 compiled with and without CUDA graphs, HF compiled
#        GPU 1    T5-base micro-batch 128 compiled, with and without CUDA graphs: step
#                 time against host launch time, and where one step syncs
#        GPU 2,3  TP=2 saved at step 12, resumed on one GPU (issue 20: reshard to one GPU)
#   two (nvidia-h200-x2): the residual stream in bf16 (model.fp32_residual=false) against
#        fp32, side by side. GPU 0: the host-sync detector's test; T5-base micro-batch 128
#        compiled; 1B bf16 compiled. GPU 1: 1B fp8 compiled; 350M, 300 steps on a corpus
#        that does not repeat (the loss curves).
#   t5-profile: one GPU, the bf16-residual T5 step profiled by kernel.
#   ab (nvidia-h200-x2): 'two's throughput pairs again, nothing else running beside them.
#   final (one GPU): T5 and 1B compiled at the new default, then the GPU tests.
#   three: all four GPUs: the TP=2 x PP=2 checkpoint resumed on one GPU; compiled DP=4
#        with larger DDP buckets (issue 20: DP efficiency)
set -uo pipefail
. benchmarks/leases/setup.sh
case "${1:-}" in
one)
  (
    export CUDA_VISIBLE_DEVICES=0
    timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py \
      tests/test_benchmarks.py -k "cuda_graph or host_syncs" 2>&1 | tail -4
    timeout 370 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
      --variants matmul,ours-compile-fp8,ours-compile-fp8-cudagraphs,hf-compile --out "$OUT/1b" 2>&1 | tail -9
  ) > "$OUT/gpu0.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 560 python3 benchmarks/train_throughput.py --shape t5-base \
    --steps 10 --warmup 5 --micro-batch 128 --variants matmul,ours-compile,ours-compile-cudagraphs \
    --out "$OUT/t5" > "$OUT/gpu1.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=2,3 timeout 560 python3 benchmarks/parallel_parity.py --layouts 1gpu,tp2 \
    --save-layout tp2 --save-step 12 --resume-layouts 1gpu --steps 24 --timeout 150 \
    --work /tmp/parity --out "$OUT/parity" > "$OUT/gpu23.log" 2>&1 &
  wait
  tail -n 12 "$OUT"/gpu*.log ;;
two)  # on nvidia-h200-x2 (the x4 kind was no longer lent): two jobs side by side
  R=model.fp32_residual=false
  (
    export CUDA_VISIBLE_DEVICES=0
    timeout 100 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_benchmarks.py -k host_syncs 2>&1 | tail -3
    timeout 230 python3 benchmarks/train_throughput.py --shape t5-base --steps 10 --warmup 5 \
      --micro-batch 128 --variants matmul,ours-compile,ours-compile@$R --out "$OUT/t5" 2>&1 | tail -7
    timeout 230 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
      --variants matmul,ours-compile,ours-compile@$R --out "$OUT/1b" 2>&1 | tail -7
  ) > "$OUT/gpu0.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1
    timeout 230 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
      --variants matmul,ours-compile-fp8,ours-compile-fp8@$R --out "$OUT/1b-fp8" 2>&1 | tail -7
    python3 benchmarks/code_corpus.py --megabytes 60 --workers 12 --out /tmp/code 2>&1 | tail -2
    timeout 300 python3 benchmarks/fp8_convergence.py --shape 350m --steps 300 \
      --variants bf16,bf16-residual --shards /tmp/code/shards --out "$OUT/conv" 2>&1 | tail -6
  ) > "$OUT/gpu1.log" 2>&1 &
  wait
  tail -n 14 "$OUT"/gpu*.log ;;
t5-profile)  # one GPU: where T5-base's step goes with the residual stream in bf16
  timeout 300 python3 benchmarks/train_throughput.py --shape t5-base --steps 10 --warmup 5 \
    --micro-batch 128 --profile --variants ours-compile@model.fp32_residual=false --out "$OUT/t5" 2>&1 | tail -4
  head -40 "$OUT"/t5/profile-*.txt | cut -c1-200 ;;
ab)  # nvidia-h200-x2, nothing CPU-heavy beside the timed runs (in 'two' the corpus build on
    # GPU 1's side slowed GPU 0's second T5 run to 232 ms a step): fp32 against bf16 residual
  F=model.fp32_residual=true R=model.fp32_residual=false
  (
    export CUDA_VISIBLE_DEVICES=0
    timeout 240 python3 benchmarks/train_throughput.py --shape t5-base --steps 10 --warmup 5 \
      --micro-batch 128 --variants matmul,ours-compile@$F,ours-compile@$R --out "$OUT/t5" 2>&1 | tail -6
    timeout 240 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
      --variants matmul,ours-compile@$F,ours-compile@$R --out "$OUT/1b" 2>&1 | tail -6
  ) > "$OUT/gpu0.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 400 python3 benchmarks/train_throughput.py --shape 1b --steps 10 \
    --warmup 4 --variants matmul,ours-compile-fp8@$F,ours-compile-fp8@$R,hf-compile \
    --out "$OUT/1b-fp8" > "$OUT/gpu1.log" 2>&1 &
  wait
  tail -n 9 "$OUT"/gpu*.log ;;
final)  # one GPU, at the commit that made the bf16 stream the default (RMSNorm's weight cast
    # to the input's dtype came with it): T5 and 1B compiled as users get them, then the GPU tests
  timeout 120 python3 benchmarks/train_throughput.py --shape t5-base --steps 10 --warmup 5 \
    --micro-batch 128 --variants ours-compile --out "$OUT/t5" 2>&1 | tail -3
  timeout 110 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
    --variants ours-compile --out "$OUT/1b" 2>&1 | tail -3
  timeout 170 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py tests/test_fp8.py \
    tests/test_benchmarks.py 2>&1 | tail -4 ;;
three)
  timeout 300 python3 benchmarks/parallel_parity.py --layouts 1gpu,tp2-pp2 --save-layout tp2-pp2 \
    --save-step 12 --resume-layouts 1gpu --steps 24 --timeout 110 --work /tmp/parity \
    --out "$OUT/parity" 2>&1 | tail -12
  timeout 270 python3 benchmarks/parallel_scaling.py --shape 1b --layouts dp4 --compile --steps 4 \
    --warmup 3 --accumulation 4 --timeout 120 --set parallel.ddp_bucket_mb=100 --out "$OUT/dp" 2>&1 | tail -6 ;;
*) echo "usage: $0 one|two|t5-profile|ab|final|three"; exit 2 ;;
esac
rm -rf "$OUT"/*/shards* "$OUT"/*/tokenizer* "$OUT"/*/run-* "$OUT"/*/runs /tmp/parity
