#!/usr/bin/env bash
# Settles what 2026-11-28-t5-bias.sh left open: how much of T5-base's gain is the
# shared-bias op's, and whether `--profile` moves the timed steps. One machine, one GPU.
#   .base/ = `git archive bfb9c86` (before the op and the dropped mask)
#   .mid/  = this tree with the op switched off (`MIN_SCORES = 1 << 62`)
#   .whl/  = pydantic, pydantic_core, annotated_types, typing_inspection, zstandard wheels
#   same:  the GPU tests of the op, then before / op off / op on / op on with --profile,
#          interleaved, no HF                                 carry [.whl, .base, .mid]
#   why:   the op, the op off and before, with and without --profile and with 3 more
#          configured iterations                              carry [.whl, .base, .mid]
#   kernels: the op's GPU tests, its microbenchmark three times (one process each), T5-base
#          with the op's kernel auto, cudnn, efficient         carry [.whl, .k-cudnn, .k-efficient]
#          (run at 742bfc5's parent plus a version of the op, not kept, whose kernel "auto"
#          timed cuDNN and the memory-efficient kernel on first use; .k-*/ = that tree with
#          `_kernel` forced: benchmarks/RESULTS.md says what it measured)
#   graphs: CUDA graphs (training.compile_mode=reduce-overhead) for T5-base and HF's  carry [.whl]
#   batch: the CUDA-graph GPU test, then T5-base at micro-batch 128 (the config's global
#          batch in one micro-batch), graphs or not, against HF's   carry [.whl]
set -uo pipefail
. benchmarks/leases/setup.sh
t5() {  # name, tree, extra flags (a later --warmup overrides the 5)
  local name=$1 tree=$2; shift 2
  (cd "$tree" && timeout ${T5_TIMEOUT:-150} python3 benchmarks/train_throughput.py --shape t5-base --steps 15 --warmup 5 \
    --out "$OUT/$name" "$@" 2>&1 | tail -7)
}
case "${1:-}" in
same)
  timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py -k "shared_bias or relative_bias" 2>&1 | tail -3
  t5 before1 .base --variants matmul,ours-compile
  t5 no-op1 .mid --variants ours-compile
  t5 op1 . --variants ours-compile
  t5 op-profile . --variants ours-compile --profile
  t5 before2 .base --variants ours-compile ;;
why)
  # The op ran 11% faster with --profile than without in `same`. --profile adds 3
  # configured iterations and profiles after the timed steps: separate the two.
  t5 op-20 . --variants ours-compile
  t5 op-23 . --variants ours-compile --warmup 8
  t5 op-20-profile . --variants ours-compile --profile
  t5 no-op-20-profile .mid --variants ours-compile --profile
  t5 no-op-23 .mid --variants ours-compile --warmup 8
  t5 before-23 .base --variants ours-compile --warmup 8 ;;
kernels)
  # The op's kernel chosen per shape by timing (auto) against cuDNN and the memory-
  # efficient kernel forced (.k-cudnn/, .k-efficient/: this tree with `_kernel` set).
  timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py -k "shared_bias or relative_bias" 2>&1 | tail -3
  for i in 1 2 3; do
    timeout 90 python3 benchmarks/shared_bias_attention.py --out "$OUT/micro$i" 2>&1 | grep -v '"decoder"' | cut -c1-200
  done
  t5 auto1 . --variants ours-compile --profile
  t5 cudnn .k-cudnn --variants ours-compile --profile
  t5 efficient .k-efficient --variants ours-compile --profile
  t5 auto2 . --variants ours-compile --profile
  rm -rf "$OUT"/*/shards-* "$OUT"/*/tokenizer-* "$OUT"/*/run-* ;;
graphs)
  # training.compile_mode=reduce-overhead (CUDA graphs): its GPU test, then T5-base with
  # and without graphs against HF compiled with and without them, one call.
  timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py -k "cuda_graph" 2>&1 | tail -3
  t5 graphs . --variants matmul,ours-compile,ours-compile-cudagraphs,hf-compile,hf-compile-cudagraphs --profile
  rm -rf "$OUT"/*/shards-* "$OUT"/*/tokenizer-* "$OUT"/*/run-* ;;
batch)
  # Not run yet (next GPU session): the CUDA-graph test in its final form (one micro-batch a
  # step), then T5-base at micro-batch 128, with and without graphs, against HF's.
  timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py -k "cuda_graph" 2>&1 | tail -3
  t5 mb128 . --variants matmul,ours-compile,ours-compile-cudagraphs,hf-compile,hf-compile-cudagraphs --micro-batch 128
  rm -rf "$OUT"/*/shards-* "$OUT"/*/tokenizer-* "$OUT"/*/run-* ;;
*) echo "usage: $0 same|why|kernels|graphs|batch"; exit 2 ;;
esac
