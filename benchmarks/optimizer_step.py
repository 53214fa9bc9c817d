"""The optimizer step at a recipe's parameter shapes, four ways.

The trainer's step is the fused AdamW kernel with gradient clipping folded in through
``grad_scale`` (:func:`training.optim.adamw.step_with_clipping`): at the 1B shape on an
H200 it takes 10.8 ms of a 163 ms fp8 step (benchmarks/RESULTS.md), about 2.9 TB/s of
its 28 bytes a parameter (p, g, m, v read; p, m, v written) where the HBM gives 4.8.
This times, on the same parameters and gradients:

* ``fused``           the trainer's step (grad norm, then the fused kernel);
* ``fused-flat``      the same kernel over one flat buffer per weight-decay group, every
                      parameter a view into it (Megatron's contiguous buffers);
* ``compiled-foreach`` AdamW's foreach step and the clip coefficient's multiply compiled
                      together by Inductor;
* ``multi-tensor``    the same step as one Triton launch a group
                      (:class:`training.optim.multi_tensor_adamw.MultiTensorAdamW`; on
                      the CPU it runs torch's single-tensor step).

For each: ms a step, the bandwidth it reaches, and the largest difference of its
parameters from ``fused``'s after the timed steps (AdamW is elementwise, so any layout
computes the same update; compiled code may round differently).

    python benchmarks/optimizer_step.py --shape 1b --device cuda --out $OUT
    python benchmarks/optimizer_step.py --shape tiny --device cpu --steps 2 --out results/
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.train_throughput import SHAPE_SETTINGS, SHAPES  # noqa: E402
from megalith.config import load_config  # noqa: E402
from training.models import meta_model  # noqa: E402
from training.models.flops import param_groups  # noqa: E402
from training.optim import multi_tensor_adamw  # noqa: E402
from training.optim.adamw import step_with_clipping  # noqa: E402

BYTES_PER_PARAM = 28  # fp32 p, g, m, v read; p, m, v written
VARIANTS = ("fused", "fused-flat", "compiled-foreach", "multi-tensor")


def shapes_of(shape: str, settings: list[str]) -> tuple[list[torch.Size], list[torch.Size]]:
    """The recipe's parameter shapes, split into AdamW's decay and no-decay groups."""
    config = load_config(SHAPES[shape], SHAPE_SETTINGS.get(shape, []) + settings)
    decay, no_decay = param_groups(meta_model(config.model), 0.1)
    return [p.shape for p in decay["params"]], [p.shape for p in no_decay["params"]]


def make_params(
    groups: tuple[list[torch.Size], list[torch.Size]], device: torch.device, flat: bool
) -> list[list[torch.nn.Parameter]]:
    """Seeded parameters with seeded gradients: every variant starts from the same ones.
    ``flat``: one parameter per group whose gradient holds the group's gradients in order."""
    generator = torch.Generator().manual_seed(0)
    made = []
    for shapes in groups:
        values = [torch.randn(s, generator=generator) * 0.02 for s in shapes]
        grads = [torch.randn(s, generator=generator) * 1e-3 for s in shapes]
        if flat:
            values = [torch.cat([v.reshape(-1) for v in values])]
            grads = [torch.cat([g.reshape(-1) for g in grads])]
        params = []
        for value, grad in zip(values, grads, strict=True):
            param = torch.nn.Parameter(value.to(device))
            param.grad = grad.to(device)
            params.append(param)
        made.append(params)
    return made


def build_step(variant: str, groups: list[list[torch.nn.Parameter]]) -> Callable[[], None]:
    """One optimizer step of ``variant`` (its norm and clipping included)."""
    params = [p for group in groups for p in group]
    grads = [p.grad for p in params]
    decay = [{"params": groups[0], "weight_decay": 0.1}, {"params": groups[1], "weight_decay": 0.0}]
    if variant in ("fused", "fused-flat", "multi-tensor"):
        if variant == "multi-tensor":
            optimizer = multi_tensor_adamw.MultiTensorAdamW(decay, lr=3e-4, betas=(0.9, 0.95))
        else:
            optimizer = torch.optim.AdamW(decay, lr=3e-4, betas=(0.9, 0.95), fused=True)

        def step() -> None:
            step_with_clipping(optimizer, torch.nn.utils.get_total_norm(grads), 1.0)

        return step
    # A constant learning rate here; under a schedule it would be a tensor (capturable),
    # or each new value would recompile.
    optimizer = torch.optim.AdamW(decay, lr=3e-4, betas=(0.9, 0.95), foreach=True)

    @torch.compile
    def compiled_step() -> None:
        norm = torch.nn.utils.get_total_norm(grads)
        torch._foreach_mul_(grads, (1.0 / (norm + 1e-6)).clamp(max=1.0))
        optimizer.step()

    return compiled_step


def time_steps(step: Callable[[], None], steps: int, device: torch.device) -> float:
    """Seconds a step, after warm-up steps (compilation, the fused kernel's state)."""
    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def flat_values(groups: list[list[torch.nn.Parameter]]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for group in groups for p in group])


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    groups = shapes_of(args.shape, args.set)
    count = sum(s.numel() for shapes in groups for s in shapes)
    start = flat_values(make_params(groups, device, flat=True))
    results, reference = {}, None
    for variant in args.variants:
        params = make_params(groups, device, flat=variant == "fused-flat")
        seconds = time_steps(build_step(variant, params), args.steps, device)
        values = flat_values(params)
        reference = values if reference is None else reference
        results[variant] = {
            "ms": 1e3 * seconds,
            "tb_per_s": count * BYTES_PER_PARAM / seconds / 1e12,
            "max_abs_update": (values - start).abs().max().item(),
            "max_abs_diff_vs_first": (values - reference).abs().max().item(),
        }
        del params, values
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"date": str(date.today()), "shape": args.shape, "device": f"{name} (torch {torch.__version__})",
            "parameters": count, "steps": args.steps, "results": results}  # fmt: skip


def table(report: dict) -> str:
    lines = [f"{report['device']}, {report['shape']}: {report['parameters']:,} parameters, "
             f"{report['steps']} timed steps", "| variant | ms a step | TB/s | max abs diff |",
             "|---|---|---|---|"]  # fmt: skip
    for variant, r in report["results"].items():
        lines.append(
            f"| {variant} | {r['ms']:.2f} | {r['tb_per_s']:.2f} | {r['max_abs_diff_vs_first']:.1e} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    parser.add_argument("--set", action="append", default=[], help="A config key, KEY=VALUE.")
    parser.add_argument("--out", type=Path, default=Path("benchmark-out"))
    args = parser.parse_args()
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"optimizer-{args.shape}.json").write_text(json.dumps(report, indent=2))
    print(table(report))


if __name__ == "__main__":
    main()
