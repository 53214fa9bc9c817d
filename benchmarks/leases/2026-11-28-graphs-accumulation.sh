#!/usr/bin/env bash
# CUDA graphs (training.compile_mode=reduce-overhead) with gradient accumulation: the
# trainer keeps the gradients outside the graphs' memory. One machine, one GPU, carry [.whl]
#   .whl/ = pydantic, pydantic_core, annotated_types, typing_inspection, zstandard wheels
#   tests:  the CUDA-graph GPU test (one micro-batch a step, and four accumulated), the
#           shared-bias op's, then T5-base's recipe (micro-batch 32, 4 accumulated) with
#           graphs, ours against HF's
#   recipe: T5-base's recipe, every variant, one call
#   mb128:  T5-base at micro-batch 128 (the recipe's batch in one micro-batch)
#   profile: T5-base compiled at micro-batch 128, profiled
set -uo pipefail
. benchmarks/leases/setup.sh
t5() {  # name, timeout, extra flags
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 benchmarks/train_throughput.py --shape t5-base --steps 10 --warmup 5 \
    --out "$OUT/$name" "$@" 2>&1 | tail -8
}
all=matmul,ours-compile,ours-compile-cudagraphs,hf-compile,hf-compile-cudagraphs
case "${1:-}" in
tests)
  timeout 300 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py \
    -k "cuda_graph or shared_bias or relative_bias" 2>&1 | tail -15
  t5 graphs-acc4 240 --variants matmul,ours-compile-cudagraphs,hf-compile-cudagraphs --accumulation 4 ;;
recipe) t5 recipe 560 --variants "$all" --accumulation 4 ;;
mb128) t5 mb128 560 --variants "$all" --micro-batch 128 ;;
profile)  # where a step at micro-batch 128 goes: kernels by category
  t5 profile128 300 --variants matmul,ours-compile --micro-batch 128 --profile ;;
*) echo "usage: $0 tests|recipe|mb128|profile"; exit 2 ;;
esac
rm -rf "$OUT"/*/shards-* "$OUT"/*/tokenizer-* "$OUT"/*/run-*
