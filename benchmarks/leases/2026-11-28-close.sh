#!/usr/bin/env bash
# nvidia-h200 calls, 2026-11-28 close (carry [.whl]).
#   one  the optimizer step, torch's fused AdamW against the multi-tensor kernel (now the
#        default) in one run; then what a micro-batch's weight casts cost in a compiled
#        linear at the 1B shapes (benchmarks/weight_casts.py): fp8 as torchao does them, with
#        the scale precomputed, with the float8 weight precomputed; bf16 autocast's cast
#   two  the GPU tests of both; the 1B step in fp8 with and without the float8 weights cast
#        once a step (mixed_precision.fp8_weight_cache), bf16, and HF compiled beside them
#   three the same fp8 pair at 4 micro-batches a step (where a cache saves three casts)
#   four the GPU tests of fp8, the gated casts, test_gpu (CUDA graphs with fp8) and the
#        AdamW kernel with both new defaults on (multi-tensor step, cached float8 weights)
#   five where the 1B step goes now, fp8 and bf16, both defaults on (profile by category)
set -uo pipefail
. benchmarks/leases/setup.sh
case "${1:-}" in
one)
  timeout 120 python3 benchmarks/optimizer_step.py --shape 1b --device cuda --steps 30 \
    --variants fused,multi-tensor,fused --out "$OUT/opt" 2>&1 | tail -5
  timeout 300 python3 benchmarks/weight_casts.py --device cuda 2>&1 | grep -v "Failed to load\|register_constant" | tail -8 ;;
two)
  timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_multi_tensor_adamw.py \
    tests/test_fp8.py -k "multi_tensor or cached" -s 2>&1 | grep -E "passed|failed|worst|Error" | tail -6
  F=ours-compile-fp8; C=mixed_precision.fp8_weight_cache
  timeout 420 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
    --variants "$F@$C=true,$F@$C=false,ours-compile,hf-compile" --out "$OUT/tp" 2>&1 | tail -10 ;;
three)
  F=ours-compile-fp8; C=mixed_precision.fp8_weight_cache
  timeout 400 python3 benchmarks/train_throughput.py --shape 1b --steps 6 --warmup 3 --accumulation 4 \
    --variants "$F@$C=false,$F@$C=true" --out "$OUT/tp" 2>&1 | tail -6 ;;
four)
  timeout 420 bash benchmarks/gpu_tests.sh tests/test_gated_fp8.py tests/test_fp8.py tests/test_gpu.py \
    tests/test_multi_tensor_adamw.py 2>&1 | grep -E "passed|failed|PASSED|FAILED|worst|Error" | tail -40 ;;
five)
  timeout 330 python3 benchmarks/train_throughput.py --shape 1b --steps 6 --warmup 4 --profile \
    --variants ours-compile-fp8,ours-compile --out "$OUT" 2>&1 | tail -4
  for f in "$OUT"/profile-*.txt; do echo "== $f"; head -40 "$f"; done ;;
*) echo "usage: $0 one|two|three|four|five" >&2; exit 2 ;;
esac
