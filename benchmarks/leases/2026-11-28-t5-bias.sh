#!/usr/bin/env bash
# T5's relative-bias attention through the shared-bias op (training/models/
# shared_bias_attention.py, bias gradient summed over the batch in bias_grad.py's Triton
# kernel) against the SDPA path before it, one GPU, no Transformer Engine needed.
# `.base/` is the tree before the change (`git archive bfb9c86 | tar -x -C .base`),
# carried beside the working tree so both run on the same machine in the same call.
#   tests: pydantic/zstandard from .te/rest, the new GPU tests, the attention microbenchmark
#                                                             carry [.te/rest, .base]
#   t5:    T5-base throughput: before (.base), after, HF compiled      carry [.base]
#   again: the same after the op's second version                     carry [.te/rest, .base]
#   split: the op switched off (.mid) against on, same call           carry [.te/rest, .mid]
set -uo pipefail
export PYTHONPATH=/tmp/tesite${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmark-out}
mkdir -p "$OUT"
case "${1:-}" in
tests)
  python3 -c "import pydantic, zstandard" 2>/dev/null || pip install -q --no-deps --target /tmp/tesite \
    .te/rest/{pydantic,pydantic_core,annotated_types,typing_inspection,zstandard}-*.whl
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
  timeout 150 python3 benchmarks/shared_bias_attention.py --out "$OUT" 2>&1 | tail -20
  timeout 300 bash benchmarks/gpu_tests.sh tests/test_gpu.py | tail -25 ;;
t5)
  (cd .base && timeout 280 python3 benchmarks/train_throughput.py --shape t5-base --steps 15 --warmup 5 \
    --variants matmul,ours-compile,hf-compile --out "$OUT/before" 2>&1 | tail -6)
  timeout 250 python3 benchmarks/train_throughput.py --shape t5-base --steps 15 --warmup 5 --profile \
    --variants matmul,ours-compile --out "$OUT/after" 2>&1 | tail -6 ;;
again)
  # After the kernel computes D itself and T5's bias comes contiguous: the op's GPU tests,
  # then before (ours only), after with its profile, and HF compiled, one call.
  python3 -c "import pydantic, zstandard" 2>/dev/null || pip install -q --no-deps --target /tmp/tesite \
    .te/rest/{pydantic,pydantic_core,annotated_types,typing_inspection,zstandard}-*.whl
  timeout 120 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py -k "shared_bias or relative_bias" 2>&1 | tail -3
  (cd .base && timeout 150 python3 benchmarks/train_throughput.py --shape t5-base --steps 15 --warmup 5 \
    --variants matmul,ours-compile --out "$OUT/before" 2>&1 | tail -4)
  timeout 280 python3 benchmarks/train_throughput.py --shape t5-base --steps 15 --warmup 5 --profile \
    --variants matmul,ours-compile,hf-compile --out "$OUT/after" 2>&1 | tail -5 ;;
split)
  # Which part gains: `.mid/` is this tree with the op switched off (`MIN_SCORES = 1 << 62`:
  # no padding mask, the bias broadcast through SDPA) against this tree, same call.
  python3 -c "import pydantic, zstandard" 2>/dev/null || pip install -q --no-deps --target /tmp/tesite \
    .te/rest/{pydantic,pydantic_core,annotated_types,typing_inspection,zstandard}-*.whl
  (cd .mid && timeout 120 python3 benchmarks/train_throughput.py --shape t5-base --steps 15 --warmup 5 \
    --variants ours-compile --out "$OUT/no-op" 2>&1 | tail -3)
  timeout 120 python3 benchmarks/train_throughput.py --shape t5-base --steps 15 --warmup 5 \
    --variants ours-compile --out "$OUT/op" 2>&1 | tail -3 ;;
*) echo "usage: $0 tests|t5|again|split"; exit 2 ;;
esac
