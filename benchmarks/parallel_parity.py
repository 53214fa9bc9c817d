"""Parallel layouts against one GPU over NCCL, and a checkpoint resharded across layouts.

Every run is ``megalith train --nproc-per-node N`` (the command users run) on the same
shards, seed, global batch and schedule, so every layout sees the same samples in the
same order; only the reduction order and the bf16 rounding of the partial sums differ.

1. **Parity**: each layout in ``--layouts`` trains ``--steps`` steps; its loss and
   gradient-norm curves are compared step by step with the one-GPU run (``1gpu``):
   worst relative loss difference, at step 1 (same weights: forward numerics only) and
   over the run (the trajectories drift apart as bf16 roundings compound).
2. **Reshard**: the ``--save-layout`` run also checkpoints at ``--save-step``; that
   checkpoint resumes in every ``--resume-layouts`` layout (other TP/PP/DP sizes and GPU
   counts) and trains to ``--steps``. Reported: consumed samples after resume (the data
   order), the resumed losses against the saving layout's own continuation and against
   one GPU, the save's write time and the resume's read time.

    python benchmarks/parallel_parity.py --layouts 1gpu,tp2-dp2,tp2-pp2,pp2-dp2 \\
        --save-layout tp2-pp2 --resume-layouts tp2-dp2,tp2,1gpu --out results/

Layout names as ``parallel_scaling.py`` (dpN tpN ppN cpN vN sp zero1 fsdp). ``--shape
tiny --device cpu`` smoke-runs the whole script on gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.parallel_scaling import SHAPES, parse_layout  # noqa: E402
from benchmarks.train_throughput import prepare_shards  # noqa: E402

RESUMED = re.compile(r"resumed from \S+ at step (\d+) in ([0-9.]+) s")
# The background writer's log line: its time reaches metrics.jsonl only if the write ends
# before the run's last step.
WRITTEN = re.compile(r"checkpoint step (\d+): training blocked [0-9.]+ s, written in ([0-9.]+) s")


def settings(args, layout: str, shards: str, checkpoint_interval: int) -> dict:
    """The config keys of one run: the shape, the layout, and what all runs share."""
    overrides = parse_layout(layout)[1]
    return {
        "data.output": shards,
        "training.device": args.device,
        "training.micro_batch_size": args.micro_batch,
        "training.global_batch_size": args.global_batch,
        "training.train_iters": args.steps,
        "training.eval_interval": 0,
        "training.log_interval": 1,
        "training.compile": args.compile,
        "training.num_workers": 2,
        "scheduler.warmup_iters": max(args.steps // 6, 1),
        "logging.mlflow": False,
        "checkpoint.interval": checkpoint_interval,
        "checkpoint.keep_last": 2,  # the save-step checkpoint outlives the final one
        **{k: v for k, v in SHAPES[args.shape].items() if k != "training.micro_batch_size"},
        **overrides,
        **dict(item.split("=", 1) for item in args.set),
    }


def train(args, layout: str, output: Path, values: dict, resume: bool = False) -> dict:
    """One ``megalith train`` run; its metrics, wall time and (on resume) read time."""
    gpus = parse_layout(layout)[0]
    command = [sys.executable, "-m", "pipelines.cli", "train", "--config", args.config]
    for key, value in values.items():
        command += ["--set", f"{key}={json.dumps(value) if isinstance(value, bool) else value}"]
    command += ["--output", str(output), "--quiet"]
    if gpus > 1:
        command += ["--nproc-per-node", str(gpus)]
    if resume:
        command.append("--resume")
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT
        )
    except subprocess.TimeoutExpired as timeout:
        tail = timeout.stderr or b""
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"error": f"timed out after {args.timeout} s\n{tail[-3000:]}"}
    wall = time.perf_counter() - started
    if done.returncode:
        return {"error": (done.stdout[-1500:] + "\n" + done.stderr[-4000:]).strip(), "wall_s": wall}
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    result = {"gpus": gpus, "wall_s": round(wall, 1), "records": records}
    written = WRITTEN.findall(done.stderr + done.stdout)
    if written:
        result["checkpoint_write_s"] = {int(step): float(s) for step, s in written}
    found = RESUMED.findall(done.stderr + done.stdout)
    if found:
        result["resumed_at"] = int(found[0][0])
        result["resume_read_s"] = max(float(seconds) for _, seconds in found)  # slowest rank
    return result


def curve(result: dict, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in result.get("records", []) if key in r}


def compare(result: dict, reference: dict) -> dict:
    """Worst relative differences of loss and grad norm against ``reference``."""
    out = {}
    for key in ("loss", "grad_norm"):
        mine, theirs = curve(result, key), curve(reference, key)
        steps = sorted(set(mine) & set(theirs))
        if not steps:
            return {"error": "no common steps"}
        diffs = {s: abs(mine[s] - theirs[s]) / abs(theirs[s]) for s in steps}
        worst = max(diffs, key=diffs.get)
        out[key] = {
            "first_step": steps[0],
            "at_first_step": diffs[steps[0]],
            "worst": diffs[worst],
            "worst_step": worst,
            "at_last_step": diffs[steps[-1]],
            "steps": len(steps),
        }
    return out


def parity(args, shards: str, work: Path, out: Path, report: dict) -> None:
    runs = report["runs"]
    for layout in args.layouts.split(","):
        interval = args.save_step if layout == args.save_layout else 0
        runs[layout] = train(
            args, layout, work / f"run-{layout}", settings(args, layout, shards, interval)
        )
        print(layout, summary(runs[layout]), flush=True)
        save(report, out)
    base = runs.get("1gpu", {})
    for layout, result in runs.items():
        if layout != "1gpu" and "records" in result and "records" in base:
            result["vs_1gpu"] = compare(result, base)


def reshard(args, shards: str, work: Path, out: Path, report: dict) -> None:
    saved = report["runs"].get(args.save_layout, {})
    source = work / f"run-{args.save_layout}" / "checkpoints"
    step_dir = source / f"step-{args.save_step:08d}"
    if "records" not in saved or not step_dir.is_dir():
        report["reshard"] = {
            "error": f"no step-{args.save_step} checkpoint from {args.save_layout}"
        }
        return
    timings = {
        key: next((round(r[key], 2) for r in saved["records"] if key in r), None)
        for key in ("checkpoint_blocked_s", "checkpoint_write_s")
    }
    if timings["checkpoint_write_s"] is None:  # still writing at the last step: its log line
        logged = saved.get("checkpoint_write_s", {}).get(args.save_step)
        timings["checkpoint_write_s"] = None if logged is None else round(logged, 2)
    report["reshard"] = {**timings, "resumed": {}}
    for layout in args.resume_layouts.split(","):
        output = work / f"resume-{layout}"
        shutil.rmtree(output, ignore_errors=True)
        (output / "checkpoints").mkdir(parents=True)
        shutil.copytree(step_dir, output / "checkpoints" / step_dir.name)
        (output / "checkpoints" / "latest.json").write_text(
            json.dumps({"step": args.save_step, "path": step_dir.name})
        )
        values = settings(args, layout, shards, 0)
        result = train(args, layout, output, values, resume=True)
        if "records" in result:
            after = {"records": [r for r in saved["records"] if r["step"] > args.save_step]}
            result["vs_saving_layout"] = compare(result, after)
            base = report["runs"].get("1gpu", {})
            if "records" in base:
                result["vs_1gpu"] = compare(result, base)
        report["reshard"]["resumed"][layout] = result
        print("resume", layout, summary(result), flush=True)
        save(report, out)


def summary(result: dict) -> str:
    if "error" in result:
        return "FAILED " + result["error"][-600:]
    losses = [round(r["loss"], 4) for r in result["records"]]
    return f"{result['wall_s']} s, losses {losses[:3]} ... {losses[-2:]}"


def save(report: dict, out: Path) -> None:
    """After every run: a later one that stalls must not lose the earlier figures."""
    (out / "parity.json").write_text(json.dumps(report, indent=1))


def table(report: dict) -> str:
    lines = [
        f"{report['device']}, shape {report['shape']}, {report['steps']} steps, global batch "
        f"{report['global_batch']} × {report['seq_length']} tokens, micro-batch "
        f"{report['micro_batch']}, {report['dtype']}, {report['mode']}",
        "| layout | GPUs | loss Δrel step 1 | worst loss Δrel (step) | loss Δrel last step | "
        "worst grad-norm Δrel | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout, r in report["runs"].items():
        if "error" in r:
            lines.append(f"| {layout} | failed: {r['error'].splitlines()[0][:100]} |")
            continue
        if layout == "1gpu":
            lines.append(f"| 1gpu (reference) | 1 | | | | | {r['wall_s']} |")
            continue
        loss, norm = r["vs_1gpu"]["loss"], r["vs_1gpu"]["grad_norm"]
        lines.append(
            f"| {layout} | {r['gpus']} | {loss['at_first_step']:.1e} | {loss['worst']:.1e} "
            f"({loss['worst_step']}) | {loss['at_last_step']:.1e} | {norm['worst']:.1e} | "
            f"{r['wall_s']} |"
        )
    shard = report.get("reshard") or {}
    if "error" in shard:
        lines += ["", f"Reshard: {shard['error']}"]
    if "resumed" in shard:
        lines += [
            "",
            f"Checkpoint of {report['save_layout']} at step {report['save_step']}: training "
            f"blocked {shard['checkpoint_blocked_s']} s (async save), written in "
            f"{shard['checkpoint_write_s']} s",
            "| resumed as | GPUs | read s | first step | loss Δrel vs saving layout (worst) | "
            "loss Δrel vs 1 GPU (worst) | wall s |",
            "|---|---|---|---|---|---|---|",
        ]
        for layout, r in shard["resumed"].items():
            if "error" in r:
                lines.append(f"| {layout} | failed: {r['error'].splitlines()[-1][:100]} |")
                continue
            own, one = r["vs_saving_layout"]["loss"], r.get("vs_1gpu", {}).get("loss", {})
            lines.append(
                f"| {layout} | {r['gpus']} | {r.get('resume_read_s')} | {own['first_step']} | "
                f"{own['worst']:.1e} | {one.get('worst', float('nan')):.1e} | {r['wall_s']} |"
            )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, deltas) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = curve(report["runs"].get("1gpu", {}), "loss")
    named = [(layout, r) for layout, r in report["runs"].items() if "records" in r]
    named += [
        (f"resumed {layout}", r)
        for layout, r in report.get("reshard", {}).get("resumed", {}).items()
        if "records" in r
    ]
    for name, result in named:
        losses = curve(result, "loss")
        steps = sorted(losses)
        curves.plot(steps, [losses[s] for s in steps], label=name, lw=1)
        common = [s for s in steps if s in base]
        if name != "1gpu" and common:
            deltas.semilogy(
                common, [abs(losses[s] - base[s]) / base[s] + 1e-9 for s in common], label=name
            )
    curves.set(xlabel="step", ylabel="training loss", title="Loss, every layout")
    deltas.set(xlabel="step", ylabel="|Δloss| / loss vs 1 GPU", title="Relative difference")
    curves.legend(fontsize=7)
    deltas.legend(fontsize=7)
    figure.suptitle(report["device"], fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--config", default=str(ROOT / "configs" / "llama-1b.yaml"))
    parser.add_argument("--layouts", default="1gpu,tp2-dp2,tp2-pp2,pp2-dp2")
    parser.add_argument("--save-layout", default="tp2-pp2")
    parser.add_argument("--save-step", type=int, default=12)
    parser.add_argument("--resume-layouts", default="tp2-dp2,tp2,1gpu")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--timeout", type=int, default=150, help="Seconds per run.")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--compile", action="store_true", help="training.compile=true.")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="Any config key."
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmark-out"))
    parser.add_argument("--work", help="Where runs and checkpoints go (default: --out).")
    args = parser.parse_args()
    import torch

    out, work = Path(args.out), Path(args.work or args.out)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    from megalith.config import load_config

    t5 = load_config(args.config).model.family == "t5"
    shards = prepare_shards(work, sentinels=100 if t5 else 0)  # span corruption's sentinels
    cuda = args.device == "cuda"
    gpu = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if cuda else "CPU (gloo)"
    seq = SHAPES[args.shape].get("data.seq_length", 2048)
    report = {
        "date": str(date.today()),
        "device": f"{gpu}, torch {torch.__version__}",
        "shape": args.shape,
        "steps": args.steps,
        "global_batch": args.global_batch,
        "micro_batch": args.micro_batch,
        "seq_length": seq,
        "dtype": SHAPES[args.shape].get("mixed_precision.dtype", "bf16"),
        "mode": "compiled" if args.compile else "eager",
        "save_layout": args.save_layout,
        "save_step": args.save_step,
        "runs": {},
    }
    parity(args, shards, work, out, report)
    if args.save_layout in args.layouts.split(","):
        reshard(args, shards, work, out, report)
    save(report, out)
    print(table(report), flush=True)
    (out / "parity.md").write_text(table(report) + "\n")
    try:
        plot(report, out / "parity.png")
    except ImportError:
        print("matplotlib missing: no plot", flush=True)


if __name__ == "__main__":
    main()
