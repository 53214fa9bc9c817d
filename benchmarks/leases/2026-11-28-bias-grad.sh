#!/usr/bin/env bash
# The bias-gradient kernel with D = rowsum(dO * O) computed once per row (a small kernel)
# rather than once per key tile, exp2, and more tiles to time, against the kernel before.
# One machine, one GPU, carry [.whl, .base]:
#   .whl/  = pydantic, pydantic_core, annotated_types, typing_inspection, zstandard wheels
#   .base/tree/ = `git archive e216c12` (the kernel before); .base/bias_grad_old.py its kernel
set -uo pipefail
. benchmarks/leases/setup.sh
timeout 240 python3 -m pytest -p no:cacheprovider -q tests/test_bias_grad.py 2>&1 | tail -2
timeout 240 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_gpu.py \
  -k "shared_bias or relative_bias" 2>&1 | tail -2
timeout 120 python3 - <<'PY' | tee "$OUT/kernels.txt"
import importlib.util, statistics, torch
from training.models import bias_grad as new
spec = importlib.util.spec_from_file_location("old", ".base/bias_grad_old.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)

def time_ms(fn, iters=20, repeats=5):
    for _ in range(3): fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); a.record()
        for _ in range(iters): fn()
        b.record(); torch.cuda.synchronize(); times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)

for batch in (32, 128):  # T5-base's encoder: 12 heads, 512 x 512, head size 64
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    q, k, v, do = (r(batch, 12, 512, 64) for _ in range(4))
    bias = r(12, 512, 512)
    scale = 64 ** -0.5
    scores = scale * q @ k.transpose(-1, -2) + bias
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ v
    want = new.bias_grad_reference(q, k, v, out, do, lse, bias, scale=scale)
    del scores
    bf = [t.bfloat16() for t in (q, k, v, out, do)]
    for name, module in (("before", old), ("after", new)):
        call = lambda: module.bias_grad(*bf, lse, bias.bfloat16(), scale=scale)
        err = (call().float() - want).abs().max().item() / want.abs().max().item()
        best = module._bias_grad_kernel.best_config
        print(f"B={batch} {name}: {time_ms(call):.3f} ms, error {err:.2e}, tiles {best}", flush=True)
PY
t5() {  # name, tree
  (cd "$2" && timeout 200 python3 benchmarks/train_throughput.py --shape t5-base --steps 10 --warmup 5 \
    --micro-batch 128 --variants ours-compile --out "$OUT/$1" 2>&1 | tail -3)
}
t5 before .base/tree
t5 after .
t5 before2 .base/tree
rm -rf "$OUT"/*/shards-* "$OUT"/*/tokenizer-* "$OUT"/*/run-*
