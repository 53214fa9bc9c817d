#!/usr/bin/env bash
# One nvidia-h200-x4 call, 2026-11-28 night; carry [.whl, .base] with .base/gated/ =
# `git archive next/fp8-gated-cast` (fc2's float8 input made by the gated activation).
# Four jobs, one per GPU; every before/after pair runs on one GPU, one after the other.
#   GPU 0  the gated branch's GPU tests (its own, fp8's, test_gpu.py); then where the 1B
#          bf16 step goes now (bf16 residual stream), profiled by kernel category
#   GPU 1  1B fp8 compiled: main, then the gated branch; HF compiled; the matmul peak
#   GPU 2  1B bf16 compiled, then with Inductor's GEMM autotuning (Triton templates with
#          fused prologues/epilogues, TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1)
#   GPU 3  the same for 1B fp8 (torchao's scaled matmuls as Triton templates)
#   two: with .base/tree/ = `git archive 72d9890` (before the RoPE tables cached before
#        compiling) and .base/gated/ rebased on that change:
#   GPU 0  the gated branch's failing GPU test with its whole traceback; CUDA-graph tests
#   GPU 1  1B bf16 compiled: before, after; HF compiled
#   GPU 2  1B fp8 compiled: before, after, the gated branch
#   GPU 3  the GPU tests at main (RoPE's cached table under CUDA graphs among them)
#   three: with .base/tree/ = `git archive ec181dc` (before fc1's float8 output gradient):
#   GPU 0  the GPU tests in call one's order (gated fp8, fp8, test_gpu.py)
#   GPU 1  1B fp8 compiled: before, after; HF compiled
#   GPU 2  1B bf16 and fp8 compiled at main, profiled by kernel category
#   GPU 3  1B bf16 compiled at main; HF compiled
#   four (issue 20, DP efficiency compiled; and the whole fp8 kernel list):
#          GPU 0: the one-GPU baseline; GPU 1: 1B fp8 profiled (the profile file comes
#          back); GPUs 2-3: DP=2 with 100 MB buckets; then all four: DP=4 with 100 MB
#          buckets, then with the default 25 MB
set -uo pipefail
. benchmarks/leases/setup.sh
TP="python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4"
HERE=$PWD
case "${1:-}" in
one)
  (
    export CUDA_VISIBLE_DEVICES=0
    (cd .base/gated && timeout 250 python3 -m pytest -m gpu -p no:cacheprovider -q \
      tests/test_gated_fp8.py tests/test_fp8.py tests/test_gpu.py 2>&1 | tail -6)
    timeout 300 $TP --profile --variants ours-compile --out "$OUT/profile" 2>&1 | tail -3
    head -30 "$OUT"/profile/profile-*.txt | cut -c1-200
  ) > "$OUT/gpu0.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1
    timeout 200 $TP --variants matmul,ours-compile-fp8 --out "$OUT/fp8-main" 2>&1 | tail -4
    (cd .base/gated && timeout 150 $TP --variants ours-compile-fp8 --out "$OUT/fp8-gated" 2>&1 | tail -3)
    timeout 200 $TP --variants hf-compile --out "$OUT/hf" 2>&1 | tail -3
  ) > "$OUT/gpu1.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=2
    timeout 150 $TP --variants ours-compile --out "$OUT/bf16" 2>&1 | tail -3
    TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 timeout 420 $TP --variants ours-compile \
      --out "$OUT/bf16-autotune" 2>&1 | tail -3
  ) > "$OUT/gpu2.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=3
    timeout 150 $TP --variants ours-compile-fp8 --out "$OUT/fp8" 2>&1 | tail -3
    TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 timeout 420 $TP --variants ours-compile-fp8 \
      --out "$OUT/fp8-autotune" 2>&1 | tail -3
  ) > "$OUT/gpu3.log" 2>&1 &
  wait
  tail -n 40 "$OUT"/gpu*.log ;;
two)
  (
    export CUDA_VISIBLE_DEVICES=0
    cd .base/gated && timeout 280 python3 -m pytest -m gpu -p no:cacheprovider -q -x \
      --tb=long tests/test_gpu.py -k cuda_graph 2>&1 | tail -120
  ) > "$OUT/gpu0.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=1
    (cd .base/tree && timeout 150 $TP --variants matmul,ours-compile --out "$OUT/bf16-before" 2>&1 | tail -4)
    timeout 150 $TP --variants ours-compile --out "$OUT/bf16-after" 2>&1 | tail -3
    timeout 200 $TP --variants hf-compile --out "$OUT/hf" 2>&1 | tail -3
  ) > "$OUT/gpu1.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=2
    (cd .base/tree && timeout 150 $TP --variants ours-compile-fp8 --out "$OUT/fp8-before" 2>&1 | tail -3)
    timeout 150 $TP --variants ours-compile-fp8 --out "$OUT/fp8-after" 2>&1 | tail -3
    (cd .base/gated && timeout 150 $TP --variants ours-compile-fp8 --out "$OUT/fp8-gated" 2>&1 | tail -3)
  ) > "$OUT/gpu2.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=3 timeout 400 python3 -m pytest -m gpu -p no:cacheprovider -q \
    tests/test_gpu.py tests/test_fp8.py 2>&1 | tail -8 > "$OUT/gpu3.log" &
  wait
  tail -n 150 "$OUT"/gpu*.log ;;
three)
  CUDA_VISIBLE_DEVICES=0 timeout 330 python3 -m pytest -m gpu -p no:cacheprovider -q \
    tests/test_gated_fp8.py tests/test_fp8.py tests/test_gpu.py 2>&1 | tail -40 > "$OUT/gpu0.log" &
  (
    export CUDA_VISIBLE_DEVICES=1
    (cd .base/tree && timeout 150 $TP --variants matmul,ours-compile-fp8 --out "$OUT/fp8-before" 2>&1 | tail -4)
    timeout 120 $TP --variants ours-compile-fp8 --out "$OUT/fp8-after" 2>&1 | tail -3
    timeout 150 $TP --variants hf-compile --out "$OUT/hf" 2>&1 | tail -3
  ) > "$OUT/gpu1.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=2
    timeout 330 $TP --profile --variants ours-compile,ours-compile-fp8 --out "$OUT/profile" 2>&1 | tail -5
    for f in "$OUT"/profile/profile-*.txt; do head -36 "$f" | cut -c1-160; done
  ) > "$OUT/gpu2.log" 2>&1 &
  (
    export CUDA_VISIBLE_DEVICES=3
    timeout 150 $TP --variants matmul,ours-compile --out "$OUT/bf16" 2>&1 | tail -4
    timeout 150 $TP --variants hf-compile --out "$OUT/hf3" 2>&1 | tail -3
  ) > "$OUT/gpu3.log" 2>&1 &
  wait
  tail -n 80 "$OUT"/gpu*.log ;;
four)
  S="python3 benchmarks/parallel_scaling.py --shape 1b --compile --steps 4 --warmup 3 --accumulation 4 --timeout 150"
  B=parallel.ddp_bucket_mb=100
  CUDA_VISIBLE_DEVICES=0 $S --layouts 1gpu --out "$OUT/s1" > "$OUT/log.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 200 $TP --profile --variants ours-compile-fp8 --out "$OUT/prof" > "$OUT/prof.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=2,3 $S --layouts dp2 --set $B --out "$OUT/s2" > "$OUT/s2.log" 2>&1 &
  wait
  $S --layouts dp4 --set $B --out "$OUT/s4" >> "$OUT/log.txt" 2>&1
  $S --layouts dp4 --out "$OUT/s4d" >> "$OUT/log.txt" 2>&1
  cat "$OUT/s2.log" "$OUT/prof.log" >> "$OUT/log.txt"; rm -f "$OUT/s2.log" "$OUT/prof.log"
  grep -v "^\s*$" "$OUT/log.txt" | grep -i "| \|error\|Traceback" | tail -40 ;;
*) echo "usage: $0 one|two|three|four"; exit 2 ;;
esac
cd "$HERE" && rm -rf "$OUT"/*/shards* "$OUT"/*/tokenizer* "$OUT"/*/run-* "$OUT"/*/runs
