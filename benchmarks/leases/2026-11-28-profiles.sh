#!/usr/bin/env bash
# Where the step goes now that SwiGLU/GeGLU run as one-pass ops (commit 23c1bc3): Llama 1B
# fp8 tensorwise and T5-base at micro-batch 128, compiled, kernels by category
# (OUT/*/profile-VARIANT.txt). One machine, one GPU, carry [.whl] (pydantic, zstandard, torchao).
set -uo pipefail
. benchmarks/leases/setup.sh
timeout 190 python3 benchmarks/train_throughput.py --shape 1b --steps 6 --warmup 4 --profile \
  --variants ours-compile-fp8 --out "$OUT/1b" 2>&1 | tail -3
timeout 170 python3 benchmarks/train_throughput.py --shape t5-base --steps 6 --warmup 5 --profile \
  --micro-batch 128 --variants ours-compile --out "$OUT/t5" 2>&1 | tail -3
rm -rf "$OUT"/*/shards* "$OUT"/*/tokenizer* "$OUT"/*/run-*
