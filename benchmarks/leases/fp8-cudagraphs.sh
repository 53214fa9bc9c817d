#!/usr/bin/env bash
# CUDA graphs over torchao's fp8 (branch next/fp8-cudagraphs: compile_mode_problems no
# longer refuses fp8 with model.backend torch). Not run yet. One machine, one GPU, carry
# [.whl] (pydantic, zstandard, torchao 0.18).
#   bash benchmarks/leases/fp8-cudagraphs.sh test   # the GPU test, bf16 and fp8 (~2 min)
#   bash benchmarks/leases/fp8-cudagraphs.sh 1b     # 1B fp8 default vs graphs, HF compiled (~6 min)
#   bash benchmarks/leases/fp8-cudagraphs.sh t5     # T5-base mb 128: step vs host launch time
set -uo pipefail
export PYTHONPATH=/tmp/tesite${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-benchmark-out}
mkdir -p "$OUT"
python3 -c "import pydantic, zstandard, torchao" 2>/dev/null || pip install -q --no-deps --target /tmp/tesite .whl/*.whl 2>&1 | grep -v WARNING
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
case "${1:-}" in
test)
  timeout 300 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py -k cuda_graph 2>&1 | tail -3 ;;
1b)
  timeout 500 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 \
    --variants matmul,ours-compile-fp8,ours-compile-fp8-cudagraphs,hf-compile --out "$OUT/1b" 2>&1 | tail -7 ;;
t5)
  timeout 300 python3 benchmarks/train_throughput.py --shape t5-base --steps 10 --warmup 5 \
    --micro-batch 128 --variants ours-compile,ours-compile-cudagraphs --out "$OUT/t5" 2>&1 | tail -4 ;;
*) echo "usage: $0 test|1b|t5"; exit 2 ;;
esac
rm -rf "$OUT"/*/shards* "$OUT"/*/tokenizer* "$OUT"/*/run-*
