"""FP8 convergence: does the fp8 loss curve track bf16's over the first few hundred steps?

Trains one model shape from the same seed on the same batches, once per variant, through
the real Trainer (real shards and DataLoader, fused AdamW, clipping, the schedule), each
variant in its own process:

* ``bf16``            the plain torch backend in bf16 autocast: the reference
* ``fp8-tensorwise``  torchao float8, one dynamic scale per tensor
* ``fp8-rowwise``     torchao float8, a scale per row
* ``te-bf16``, ``te-fp8``  the Transformer Engine backend without / with fp8
  (tensorwise = Float8CurrentScaling); added by default where transformer_engine imports
* ``bf16-fp32-residual``  bf16 with the residual stream kept in fp32
  (``model.fp32_residual: true``; the default is bf16 as Megatron's); on request

It writes ``fp8-convergence-SHAPE.json`` (every loss, tokens/s, the comparison) and
``fp8-convergence-SHAPE.png`` (the curves and |Δloss| against bf16), and prints, per
variant, max and mean |Δloss| against bf16 over the last 100 steps (all steps if fewer)
with tokens/s. A variant passes when mean |Δ| <= ``--tolerance`` (default 0.05 nats)
and max |Δ| <= 3 × tolerance. Why 0.05: both runs see the same batches, so the data
noise cancels; bf16 runs that differ only in kernels (compiled or not) stay within
~0.01-0.03 at this stage, and published float8 recipes (torchao, TE) track bf16 to
about 0.01-0.02 after thousands of steps; a broken scaling shows up as 0.1 and more.

The learning rate warms up over the first 10% of steps and decays (cosine) to the
end, so that 300 steps move the loss a lot; the recipe's own long warm-up would not.
Data: by default the shipped sample corpus (prepared once under OUT/shards, as
train_throughput.py does; small, so the 1b shape sees it several times, which is
fine for comparing curves); ``--shards DIR`` uses a real shard set.

    python benchmarks/fp8_convergence.py --shape 1b --steps 300 --out $OUT
    python benchmarks/fp8_convergence.py --shape tiny --steps 4 --variants bf16,fp8-tensorwise  # CPU smoke

``--shape tiny`` is train_throughput.py's CPU smoke shape (float8 matmuls on CPU are a
slow reference kernel: only the smallest models are practical there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import train_throughput as tt  # noqa: E402  (a sibling script: shapes, shards)

FP8 = "mixed_precision.fp8=true"
VARIANTS = {
    "bf16": ["model.backend=torch"],
    "fp8-tensorwise": ["model.backend=torch", FP8, "mixed_precision.fp8_recipe=tensorwise"],
    "fp8-rowwise": ["model.backend=torch", FP8, "mixed_precision.fp8_recipe=rowwise"],
    "te-bf16": ["model.backend=te"],
    "te-fp8": ["model.backend=te", FP8, "mixed_precision.fp8_recipe=tensorwise"],
    # bf16 with the residual stream kept in fp32 (HF's numerics under autocast)
    "bf16-fp32-residual": ["model.backend=torch", "model.fp32_residual=true"],
}
REFERENCE = "bf16"
WINDOW = 100  # the last steps compared


def default_variants() -> list[str]:
    from training.models.backend import transformer_engine_available

    names = ["bf16", "fp8-tensorwise", "fp8-rowwise"]
    return names + (["te-bf16", "te-fp8"] if transformer_engine_available() else [])


def build_config(args, variant: str):
    """The shape's recipe with this variant's settings and the short schedule."""
    from megalith.config import load_config

    warmup = max(1, args.steps // 10)
    settings = tt.SHAPE_SETTINGS.get(args.shape, []) + VARIANTS[variant] + list(args.set)
    config = load_config(
        tt.SHAPES[args.shape],
        settings,
        values={
            "data.inputs": [],
            "data.output": args.shards,
            "training.train_iters": args.steps,
            "training.eval_interval": 0,
            "training.compile": args.compile,
            "training.num_workers": 2,
            "training.seed": args.seed,
            "mixed_precision.dtype": "bf16",
            "scheduler.name": "cosine",
            "scheduler.warmup_iters": warmup,
            "scheduler.decay_iters": args.steps,
            "logging.mlflow": False,
            "checkpoint.interval": 0,
        },
    )
    mbs = args.micro_batch or config.training.micro_batch_size
    config.training = config.training.model_copy(
        update={"micro_batch_size": mbs, "global_batch_size": mbs}
    )
    return config


def run_variant(args) -> dict:
    """In the worker process: train and time every step."""
    from training.trainer import Trainer

    config = build_config(args, args.variant)
    trainer = Trainer(config, Path(args.out) / f"run-{args.variant}")
    batches = trainer.train_batches()
    losses, seconds = [], []
    while trainer.step < config.training.train_iters:
        started = time.perf_counter()
        losses.append(trainer.train_step(batches)["loss"])  # .item() synchronises
        seconds.append(time.perf_counter() - started)
    steady = seconds[min(5, len(seconds) - 1) :]  # compilation and warm-up left out
    tokens = config.training.global_batch_size * config.data.seq_length
    return {
        "losses": losses,
        "tokens_per_s": tokens * len(steady) / sum(steady),
        "backend": trainer.model.backend.name,
        "micro_batch": config.training.micro_batch_size,
        "seq_length": config.data.seq_length,
        "compile": config.training.compile,
    }


def compare(reference: list[float], losses: list[float], tolerance: float) -> dict:
    """max and mean |Δloss| over the last WINDOW steps, and whether they are in tolerance."""
    window = min(WINDOW, len(reference), len(losses))
    deltas = [abs(a - b) for a, b in zip(reference[-window:], losses[-window:], strict=True)]
    worst, mean = max(deltas), sum(deltas) / window
    return {
        "window": window,
        "max_abs_delta": worst,
        "mean_abs_delta": mean,
        "tolerance_mean": tolerance,
        "tolerance_max": 3 * tolerance,
        "passed": mean <= tolerance and worst <= 3 * tolerance,
    }


def plot(report: dict, path: Path) -> bool:
    """The loss curves and |Δloss| against bf16; False where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = {k: v for k, v in report["results"].items() if "losses" in v}
    reference = results.get(REFERENCE, {}).get("losses")
    figure, (curves, deltas) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    for name, result in results.items():
        steps = range(1, len(result["losses"]) + 1)
        (line,) = curves.plot(steps, result["losses"], label=name, linewidth=1)
        if reference and name != REFERENCE:
            delta = [abs(a - b) for a, b in zip(result["losses"], reference, strict=False)]
            deltas.plot(steps[: len(delta)], delta, label=name, linewidth=1, color=line.get_color())
    curves.set_ylabel("training loss")
    names = " vs ".join(results)
    curves.set_title(f"{names}, shape {report['shape']} ({report['device']})")
    curves.legend()
    deltas.axhline(report["tolerance"], color="grey", linestyle="--", label="tolerance (mean)")
    deltas.set_xlabel("step")
    deltas.set_ylabel(f"|loss - {REFERENCE} loss|")
    deltas.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def summary(report: dict) -> str:
    lines = [
        f"{report['device']}, shape {report['shape']}, {report['steps']} steps, |Δloss| against "
        f"{REFERENCE} over the last {WINDOW} steps (tolerance: mean <= {report['tolerance']:g}, "
        f"max <= {3 * report['tolerance']:g})",
        "| variant | final loss | max abs Δ | mean abs Δ | in tolerance | tokens/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        if "losses" not in r:
            last = ([line for line in r.get("error", "").splitlines() if line.strip()] or [""])[-1]
            lines.append(f"| {name} | error: {last[-300:]} | | | | |")
            continue
        c = r.get("comparison")
        delta = (
            f"{c['max_abs_delta']:.4f} | {c['mean_abs_delta']:.4f} | {'yes' if c['passed'] else 'NO'}"
            if c
            else "reference | | "
        )
        lines.append(f"| {name} | {r['losses'][-1]:.4f} | {delta} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def worker_command(args, variant: str) -> list[str]:
    command = [
        sys.executable, __file__, "--worker", "--variant", variant, "--shape", args.shape,
        "--shards", args.shards, "--steps", str(args.steps), "--seed", str(args.seed),
        "--out", str(args.out), "--compile" if args.compile else "--no-compile",
    ]  # fmt: skip
    if args.micro_batch:
        command += ["--micro-batch", str(args.micro_batch)]
    for setting in args.set:
        command += ["--set", setting]
    return command


def drive(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.shards = args.shards or tt.prepare_shards(out)
    variants = args.variants.split(",") if args.variants else default_variants()
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; expected some of {', '.join(VARIANTS)}")
    results = {}
    for variant in variants:
        results[variant] = tt.run_worker(worker_command(args, variant), error_chars=3000)
        print(variant, "done" if "losses" in results[variant] else "FAILED", flush=True)
    reference = results.get(REFERENCE, {}).get("losses")
    for name, result in results.items():
        if reference and name != REFERENCE and "losses" in result:
            result["comparison"] = compare(reference, result["losses"], args.tolerance)
    report = {
        "date": str(date.today()),
        "shape": args.shape,
        "steps": args.steps,
        "device": tt._device(),
        "tolerance": args.tolerance,
        "results": results,
    }
    stem = out / f"fp8-convergence-{args.shape}"
    Path(f"{stem}.json").write_text(json.dumps(report, indent=2))
    plotted = plot(report, Path(f"{stem}.png"))
    print(summary(report))
    print(f"wrote {stem}.json" + (f" and {stem}.png" if plotted else " (no matplotlib: no plot)"))
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(tt.SHAPES), default="350m")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--variants", default=None, help=f"comma-separated, of: {', '.join(VARIANTS)}"
    )
    parser.add_argument("--tolerance", type=float, default=0.05, help="mean |Δloss|, nats")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--shards", default=None, help="a prepared shard set (default: sample)")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the model (default: on CUDA)",
    )
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for every variant")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmark-out"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile is None:
        import torch

        args.compile = torch.cuda.is_available()
    if args.worker:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
    else:
        drive(args)


if __name__ == "__main__":
    main()
