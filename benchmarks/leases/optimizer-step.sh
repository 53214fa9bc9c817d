#!/usr/bin/env bash
# Written 2026-11-28 night, when no device time was left; its optimizer benchmark ran the
# next session (19:14 UTC, inline, and in 2026-11-28-late.sh), its profile did not (the
# night's `three` had already profiled the fp8 step). Kept as the record of that plan.
# One nvidia-h200 call, carry [.whl]: the optimizer step three ways at the 1B shape
# (benchmarks/optimizer_step.py: the trainer's fused AdamW at about 2.9 TB/s, 10.8 ms of
# the 163 ms fp8 step), then the 1B fp8 step profiled with the kernel categories that now
# name the gated MLP's own kernels.
#   bash benchmarks/leases/optimizer-step.sh
set -uo pipefail
. benchmarks/leases/setup.sh
timeout 200 python3 benchmarks/optimizer_step.py --shape 1b --device cuda --steps 20 --out "$OUT/opt" 2>&1 | tail -6
timeout 300 python3 benchmarks/train_throughput.py --shape 1b --steps 10 --warmup 4 --profile \
  --variants ours-compile-fp8 --out "$OUT/prof" 2>&1 | tail -3
head -20 "$OUT"/prof/profile-*.txt
rm -rf "$OUT"/*/shards* "$OUT"/*/tokenizer* "$OUT"/*/run-*
