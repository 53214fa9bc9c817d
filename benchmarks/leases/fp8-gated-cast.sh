#!/usr/bin/env bash
# fc2's float8 input made by the gated activation (branch next/fp8-gated-cast,
# training/precision/gated_fp8.py). Not run yet. One machine; x2 runs both at once:
# carry [.whl, .base] with .base/tree/ = `git archive <main's commit>` (the tree before).
#   bash benchmarks/leases/fp8-gated-cast.sh test   # its GPU tests, then the fp8 and gated ones
#   bash benchmarks/leases/fp8-gated-cast.sh 1b     # 1B fp8 compiled, before and after, HF (~5 min)
set -uo pipefail
export PYTHONPATH=/tmp/tesite${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmark-out}
mkdir -p "$OUT"
python3 -c "import pydantic, zstandard, torchao" 2>/dev/null ||
  pip install -q --no-deps --target /tmp/tesite .whl/*.whl 2>&1 | grep -v WARNING
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
case "${1:-}" in
test)
  timeout 250 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gated_fp8.py \
    tests/test_fp8.py tests/test_gpu.py 2>&1 | tail -6 ;;
1b)
  timeout 300 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
    --variants matmul,ours-compile-fp8,hf-compile --out "$OUT/after" 2>&1 | tail -6
  (cd .base/tree && timeout 150 python3 benchmarks/train_throughput.py --shape 1b --steps 10 \
    --warmup 4 --variants ours-compile-fp8 --out "$OUT/before" 2>&1 | tail -4) ;;
*) echo "usage: $0 test|1b"; exit 2 ;;
esac
rm -rf "$OUT"/*/shards* "$OUT"/*/tokenizer* "$OUT"/*/run-*
