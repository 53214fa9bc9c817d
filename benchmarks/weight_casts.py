"""What a micro-batch's weight casts cost in a compiled linear, fp8 and bf16.

Each linear of a compiled step under torchao's tensorwise fp8 reads its fp32 weight for
the weight's amax, casts it to float8, and may do both again in backward; under bf16
autocast it casts the fp32 weight to bf16. The optimizer could leave those behind once a
step instead (it reads and writes every weight anyway). This times one linear's forward
and backward, compiled, at a recipe's four linear shapes (QKV, attention output, the
gated MLP's ``fc1`` and ``fc2``; ``tokens`` rows), five ways:

* ``fp8``             torchao's ``Float8Linear`` as the trainer runs it;
* ``fp8-scale``       the weight's scale given (computed outside), cast in the graph;
* ``fp8-precast``     the float8 weight given, the gradient still reaching the parameter;
* ``bf16``            ``F.linear`` on the fp32 weight under bf16 autocast's cast;
* ``bf16-precast``    the bf16 weight given, the same way.

The difference to the first of each kind is the most a precomputed weight could save a
micro-batch; the gradients of ``fp8-precast`` are checked equal to ``fp8``'s.

    python benchmarks/weight_casts.py --device cuda --out $OUT
    python benchmarks/weight_casts.py --device cpu --tokens 64 --hidden 64 --steps 2
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
from torchao.float8.float8_utils import tensor_to_scale

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.optimizer_step import time_steps  # noqa: E402

VARIANTS = ("fp8", "fp8-scale", "fp8-precast", "bf16", "bf16-precast")


def linear_shapes(hidden: int) -> dict[str, tuple[int, int]]:
    """(in, out) of a Llama-style block's linears at ``hidden`` (4:1 grouped KV heads,
    gated MLP of 4 × hidden)."""
    return {
        "qkv": (hidden, hidden + hidden // 2),
        "o": (hidden, hidden),
        "fc1": (hidden, 8 * hidden),
        "fc2": (4 * hidden, hidden),
    }


class GivenWeight(torch.autograd.Function):
    """Forward: the precomputed ``copy`` in place of ``weight``; backward: the gradient to
    ``weight`` (in its dtype)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return copy

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def steps_of(
    in_features: int, out_features: int, tokens: int, device: torch.device
) -> dict[str, Callable[[], torch.Tensor]]:
    """One forward and backward a call, per variant, on the same input and weight; each
    returns the weight's gradient."""
    x = torch.randn(tokens, in_features, device=device, dtype=torch.bfloat16)
    linear = nn.Linear(in_features, out_features, bias=False, device=device)
    nn.init.normal_(linear.weight, std=0.02)
    weight = linear.weight
    config = Float8LinearConfig()
    fp8_linear = convert_to_float8_training(nn.Sequential(linear), config=config)[0]
    mm_config = fp8_linear.linear_mm_config
    scale = tensor_to_scale(weight.detach().t(), torch.float8_e4m3fn)

    def float8_weight(weight_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return hp_tensor_and_scale_to_float8(
            weight_t, scale, torch.float8_e4m3fn, mm_config, GemmInputRole.WEIGHT
        )

    weight_fp8 = float8_weight(weight.detach().t(), scale)
    weight_bf16 = weight.detach().to(torch.bfloat16)

    def loss(y: torch.Tensor) -> torch.Tensor:
        return y.float().square().mean()

    def matmul(weight_t: torch.Tensor) -> torch.Tensor:
        return loss(matmul_with_hp_or_float8_args.apply(x, weight_t, mm_config, config))

    forwards = {
        "fp8": lambda: loss(fp8_linear(x)),
        "fp8-scale": lambda: matmul(float8_weight(weight.t(), scale)),
        "fp8-precast": lambda: matmul(GivenWeight.apply(weight.t(), weight_fp8)),
        "bf16": lambda: loss(F.linear(x, weight.to(torch.bfloat16))),
        "bf16-precast": lambda: loss(F.linear(x, GivenWeight.apply(weight, weight_bf16))),
    }
    return {name: _backward_of(torch.compile(f), weight) for name, f in forwards.items()}


def _backward_of(forward: Callable[[], torch.Tensor], weight: nn.Parameter):
    def step() -> torch.Tensor:
        weight.grad = None
        forward().backward()
        return weight.grad

    return step


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    results: dict[str, dict[str, float]] = {}
    for name, (in_features, out_features) in linear_shapes(args.hidden).items():
        steps = steps_of(in_features, out_features, args.tokens, device)
        row = {v: 1e3 * time_steps(steps[v], args.steps, device) for v in VARIANTS}
        grad_diff = (steps["fp8"]().clone() - steps["fp8-precast"]()).abs().max()
        results[name] = {**row, "fp8_precast_grad_diff": float(grad_diff)}
    return {
        "date": date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "tokens": args.tokens,
        "hidden": args.hidden,
        "results": results,
    }


def table(report: dict) -> str:
    lines = ["| linear | " + " | ".join(VARIANTS) + " | fp8-precast grad Δ |"]
    lines.append("|---" * (len(VARIANTS) + 2) + "|")
    sums = dict.fromkeys(VARIANTS, 0.0)
    for name, row in report["results"].items():
        cells = " | ".join(f"{row[v]:.3f}" for v in VARIANTS)
        lines.append(f"| {name} | {cells} | {row['fp8_precast_grad_diff']:.1e} |")
        for variant in VARIANTS:
            sums[variant] += row[variant]
    lines.append("| all four (ms) | " + " | ".join(f"{sums[v]:.3f}" for v in VARIANTS) + " | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--tokens", type=int, default=16384, help="Rows of a micro-batch.")
    parser.add_argument("--hidden", type=int, default=2048, help="1B Llama: 2048.")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("benchmark-out"))
    args = parser.parse_args()
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weight-casts.json").write_text(json.dumps(report, indent=2))
    print(table(report))


if __name__ == "__main__":
    main()
