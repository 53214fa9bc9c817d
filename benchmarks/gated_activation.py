"""SwiGLU/GeGLU alone on one GPU, compiled, bf16: Inductor's forward and backward against
the one-pass forward and backward kernels Megalith ships (:mod:`training.models.gated_grad`),
at T5-base's encoder (micro-batch 128) and Llama 1B's MLP (micro-batch 8). Each result is
checked against fp32, and each kernel's bandwidth is reported against the bytes it must
move.

    python3 benchmarks/gated_activation.py --out results/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.shared_bias_attention import time_ms  # noqa: E402
from training.models import gated_grad  # noqa: E402

SHAPES = {  # name: (rows, F, activation)
    "t5-base-encoder": (65536, 2048, "gelu_tanh"),
    "llama-1b-mlp": (16384, 8192, "silu"),
}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def measure(rows: int, width: int, activation: str) -> dict:
    torch.manual_seed(0)
    x = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
    exact = x.detach().float().requires_grad_(True)
    want = gated_grad.gated_reference(exact, activation)
    want.backward(grad.float())
    row = {"rows": rows, "F": width, "activation": activation}
    forward_gb, backward_gb = rows * width * 6 / 1e9, rows * width * 10 / 1e9
    for name, fn in (("inductor", gated_grad.gated_reference), ("one-pass", gated_grad.gated)):
        compiled = torch.compile(lambda x, fn=fn: fn(x, activation))

        def step(compiled=compiled):
            compiled(x).backward(grad)
            x.grad = None

        out = compiled(x)
        row[f"{name}_forward_error"] = relative_error(out, want)
        out.backward(grad)
        row[f"{name}_backward_error"] = relative_error(x.grad, exact.grad)
        x.grad = None
        forward = time_ms(lambda compiled=compiled: compiled(x).detach())
        backward = time_ms(step) - forward
        row[f"{name}_forward_ms"], row[f"{name}_backward_ms"] = forward, backward
        row[f"{name}_backward_tb_s"] = backward_gb / backward
    for name in ("inductor", "one-pass"):
        row[f"{name}_forward_tb_s"] = forward_gb / row[f"{name}_forward_ms"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.shapes.split(","):
        rows.append({"shape": name, **measure(*SHAPES[name])})
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "gated_activation.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
