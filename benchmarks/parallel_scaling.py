"""Multi-GPU scaling of the real trainer: tokens/s per GPU for each layout against one GPU.

Each layout runs under ``torchrun`` in its own job (NCCL, one process per GPU) with the
same per-GPU work as the one-GPU run (weak scaling): every model replica processes
``--accumulation`` micro-batches of ``micro_batch_size`` per optimizer step. The timed
steps are the trainer's, run as ``Trainer.fit`` runs them (each step's metrics read once
the next step is queued; until 2026-11-27 evening each step was read before the next was
launched, which left the GPU idle at every step boundary): real shards and DataLoader,
bf16 autocast, fused AdamW, clipping, the layout's collectives. Eager mode unless
``--compile`` (then the one-GPU baseline is compiled too), so the comparison is between
layouts, not a peak figure (``train_throughput.py`` has those).

    python benchmarks/parallel_scaling.py --shape 1b --layouts 1gpu,dp2,tp2 --out results/

Efficiency = (tokens/s ÷ GPUs) ÷ (one GPU's tokens/s). For pipeline layouts the
report gives the trainer's measures (``training.parallel.pipeline``): the bubble of the
critical (busiest) stage, its step time outside its own compute over that compute,
beside the (p − 1)/(v·m) theory with m = ``--accumulation``; the GPUs' mean idle share
of the step (bubble plus the stages' imbalance); and the imbalance itself.

Shapes: ``1b`` is configs/llama-1b.yaml; ``7b-layers`` has the layer shape of a Llama-2
7B (hidden 4096, 32 heads, FFN 11008) with 8 layers instead of 32 so that one GPU can
hold the model and its AdamW state; tensor-parallel efficiency depends on the layer
shape, not the depth.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES: dict[str, dict] = {
    "1b": {},
    "7b-layers": {
        "model.hidden_size": 4096,
        "model.num_attention_heads": 32,
        "model.num_query_groups": 32,
        "model.ffn_hidden_size": 11008,
        "model.num_layers": 8,
        "training.micro_batch_size": 4,
    },
    # A smoke test of this script on CPU (gloo): --shape tiny --device cpu
    "tiny": {
        "model.hidden_size": 64,
        "model.num_attention_heads": 4,
        "model.num_query_groups": 2,
        "model.ffn_hidden_size": 128,
        "model.num_layers": 4,
        "model.vocab_size": 2048,
        "model.max_position_embeddings": 128,
        "data.seq_length": 128,
        "training.micro_batch_size": 2,
        "mixed_precision.dtype": "fp32",
    },
}

# Layout names: parts joined by "-", e.g. 1gpu, dp4, dp2-zero1, tp2-sp, pp4-v2, tp2-pp2,
# tp2-dp2, cp2, dp2-ep2. dpN/tpN/ppN/cpN set the sizes (GPUs = their product), epN the
# expert-parallel size (carved out of data x context, no GPUs of its own), vN the virtual
# pipeline stages (interleaved schedule), zb the zero-bubble schedule (ZB1P, with or
# without vN), sp sequence parallelism, async sequence parallelism with async TP (needs
# --compile), ub sequence parallelism with TE's userbuffers overlap (parallel.tp_comm_overlap,
# needs --set model.backend=te), zero1/fsdp the data-parallel mode (default ddp), mbN this
# layout's micro-batch: the step keeps the tokens of --accumulation micro-batches of the
# shape's (or --set's) size, in fewer, larger ones (e.g. tp2-ub-mb16 against 1gpu at 8 x 2).
_SIZE_KEYS = {
    "dp": None,
    "tp": "parallel.tensor",
    "pp": "parallel.pipeline",
    "cp": "parallel.context",
    "v": "parallel.virtual_pipeline",
}
_FLAGS = {
    "sp": {"parallel.sequence_parallel": True},
    "async": {"parallel.sequence_parallel": True, "parallel.async_tensor_parallel": True},
    "ub": {"parallel.sequence_parallel": True, "parallel.tp_comm_overlap": True},
    "zero1": {"parallel.data_parallel_mode": "distributed_optimizer"},
    "fsdp": {"parallel.data_parallel_mode": "fsdp"},
    "zb": {"parallel.pipeline_schedule": "zero-bubble"},
}


def parse_layout(name: str) -> tuple[int, dict]:
    """``(GPUs, config overrides)`` of a layout name."""
    # Expert parallelism only where the name says epN: a recipe's own parallel.expert
    # (moe-8x350m's 8) assumes its GPU count.
    if name == "1gpu":
        return 1, {"parallel.expert": 1}
    gpus, overrides = 1, {"parallel.data_parallel_mode": "ddp", "parallel.expert": 1}
    parts = name.split("-")
    for part in sorted(parts, key=lambda part: part in _FLAGS):  # flags last: zb overrides vN
        if part in _FLAGS:
            overrides.update(_FLAGS[part])
            continue
        prefix = part.rstrip("0123456789")
        if prefix not in (*_SIZE_KEYS, "ep", "mb") or prefix == part:
            raise SystemExit(
                f"layout {name!r}: unknown part {part!r} "
                "(dpN tpN ppN cpN epN vN mbN zb sp async ub zero1 fsdp)"
            )
        size = int(part[len(prefix) :])
        if prefix == "mb":  # the layout's micro-batch (build_config keeps the step's tokens)
            overrides["training.micro_batch_size"] = size
            continue
        if prefix == "ep":  # carved out of data x context: no GPUs of its own
            overrides["parallel.expert"] = size
            continue
        if prefix == "v":
            overrides["parallel.virtual_pipeline"] = size
            overrides["parallel.pipeline_schedule"] = "interleaved"
            continue
        gpus *= size
        if _SIZE_KEYS[prefix]:
            overrides[_SIZE_KEYS[prefix]] = size
    return gpus, overrides


def build_config(
    shape: str,
    layout: str,
    shards: str,
    steps: int,
    accumulation: int,
    compile_model: bool,
    sets: list[str] = (),
):
    from megalith.config import load_config, parse_override

    gpus, overrides = parse_layout(layout)
    layout_micro = overrides.pop("training.micro_batch_size", None)
    values = {
        "data.inputs": [],
        "data.output": shards,
        "training.train_iters": steps,
        "training.eval_interval": 0,
        "training.compile": compile_model,
        "training.num_workers": 2,
        "logging.mlflow": False,
        "checkpoint.interval": 0,
        **SHAPES[shape],
        **overrides,
    }
    for text in sets:  # --set: every layout, after the layout's own keys
        path, value = parse_override(text)
        values[".".join(path)] = value
    config = load_config(ROOT / "configs" / "llama-1b.yaml", values=values)
    sizes = config.parallel
    data_parallel = gpus // (sizes.tensor * sizes.pipeline * sizes.context)
    global_batch = config.training.micro_batch_size * accumulation * data_parallel
    micro = layout_micro or config.training.micro_batch_size
    if global_batch % (micro * data_parallel):
        raise SystemExit(
            f"layout {layout!r}: micro-batch {micro} on {data_parallel} replicas does not "
            f"divide the step's {global_batch} samples"
        )
    config.training = config.training.model_copy(
        update={"micro_batch_size": micro, "global_batch_size": global_batch}
    )
    return config


def worker(args) -> None:
    import torch

    from benchmarks.train_throughput import FitSteps
    from training.metrics.memory import cuda_alloc_retries
    from training.runtime.distributed import distributed
    from training.runtime.launch import comm_overlap_env
    from training.trainer import Trainer

    config = build_config(
        args.shape,
        args.layout,
        args.shards,
        args.warmup + args.steps + PROFILED_STEPS * args.profile,
        args.accumulation,
        args.compile,
        args.set,
    )
    config.training.device = args.device
    os.environ.update(comm_overlap_env(config))  # before CUDA starts, as megalith train does
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # A stalled rank prints every thread's stack before the driver's timeout kills it.
    faulthandler.dump_traceback_later(max(args.timeout - 15, 10), exit=True)
    with distributed(args.device) as (_, device):
        trainer = Trainer(config, Path(args.out) / f"run-{args.shape}-{args.layout}")
        step = FitSteps(trainer, trainer.train_batches())
        for _ in range(args.warmup):
            step()
        sync()
        started = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        seconds = time.perf_counter() - started
        records = step.finish()[-args.steps :]
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        if args.profile:  # every rank steps; rank 0 records its kernels
            _profile(args, trainer, step)
        memory = torch.tensor(float(peak), device=device)
        torch.distributed.all_reduce(memory, op=torch.distributed.ReduceOp.MAX)
        if trainer.is_main:
            tokens = args.steps * config.training.global_batch_size * config.data.seq_length
            per_replica = config.training.global_batch_size // trainer.parallel.sizes.dp
            result = {
                "tokens_per_s": tokens / seconds,
                "micro_batches": per_replica // config.training.micro_batch_size,
                "flops_per_token": trainer.flops_per_token,
                "losses": [r["loss"] for r in records],
                # The trainer's own measures (training.parallel.pipeline's docstring).
                **{
                    key: _mean([r.get(key) for r in records])
                    for key in ("pipeline_bubble", "pipeline_idle", "pipeline_imbalance")
                },
                "peak_memory_gb": memory.item() / 2**30,
                "cuda_alloc_retries": cuda_alloc_retries() if cuda else 0,
            }
            print("RESULT " + json.dumps(result), flush=True)


PROFILED_STEPS = 2


def _profile(args, trainer, step, steps: int = PROFILED_STEPS) -> None:
    """``steps`` more steps, rank 0's under torch.profiler (OUT/profile-SHAPE-LAYOUT.txt:
    GPU time per kernel category, including NCCL's and TE's userbuffers' kernels)."""
    from benchmarks.train_throughput import profile_steps

    if trainer.is_main:
        profile_steps(step, Path(args.out), f"{args.shape}-{args.layout}", steps)
    else:
        for _ in range(steps):
            step()
    step.finish()


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def run_layout(args, layout: str, shards: str) -> dict:
    gpus = parse_layout(layout)[0]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(gpus), __file__, "--worker", "--layout", layout,
        "--shape", args.shape, "--shards", shards, "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--accumulation", str(args.accumulation), "--device", args.device,
        "--out", args.out, "--timeout", str(args.timeout), *(["--compile"] if args.compile else []),
        *(["--profile"] if args.profile else []),
        *[arg for text in args.set for arg in ("--set", text)],
    ]  # fmt: skip
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as timeout:
        tail = (timeout.stderr or b"")[-6000:]
        text = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"error": f"timed out after {args.timeout} s\n{text}", "wall_s": args.timeout}
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        result = {"error": (done.stdout[-2000:] + "\n" + done.stderr[-6000:]).strip()}
    else:
        result = json.loads(lines[-1].removeprefix("RESULT "))
        result["gpus"] = gpus
        result["stderr_tail"] = done.stderr[-1500:]  # compiler warnings (async TP's, say)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def bubble_theory(layout: str, accumulation: int) -> float | None:
    overrides = parse_layout(layout)[1]
    stages = overrides.get("parallel.pipeline", 1)
    if stages == 1:
        return None
    virtual = overrides.get("parallel.virtual_pipeline") or 1
    return (stages - 1) / (virtual * accumulation)  # the 1F1B / interleaved theory


def same_data_difference(layout: str, result: dict, one_gpu: dict) -> str:
    """Worst relative loss difference against one GPU, for layouts with one model replica:
    they train on the same samples from the same weights, so anything beyond bf16 rounding
    (about 1e-3) means the layout computes something else. Layouts with data parallelism
    see more samples per step (weak scaling): no comparison."""
    gpus, overrides = parse_layout(layout)
    model_parallel = (
        overrides.get("parallel.tensor", 1)
        * overrides.get("parallel.pipeline", 1)
        * overrides.get("parallel.context", 1)
    )
    ours, theirs = result.get("losses"), one_gpu.get("losses")
    if layout == "1gpu" or gpus != model_parallel or not ours or not theirs:
        return "-"
    return f"{max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True)):.1e}"


def read_baseline(path: Path, report: dict) -> dict:
    """The one-GPU result of another run of this script (``--baseline``), e.g. one run at
    the same time on another GPU of the machine; it must have timed the same shape, mode
    and micro-batches per step."""
    try:
        other = json.loads(path.read_text())
        one_gpu = other["results"]["1gpu"]
        one_gpu["tokens_per_s"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--baseline {path}: no one-GPU result in it ({exc!r})") from None
    for key in ("shape", "mode", "accumulation"):
        if other.get(key) != report[key]:
            raise SystemExit(
                f"--baseline {path}: {key} is {other.get(key)!r}, this run's is {report[key]!r}"
            )
    return {"file": str(path), "device": other.get("device"), "1gpu": one_gpu}


def table(report: dict) -> str:
    results = report["results"]
    one_gpu = results.get("1gpu") or report.get("baseline", {}).get("1gpu", {})
    base = one_gpu.get("tokens_per_s")
    peak = report.get("matmul_tflops") or float("nan")
    baseline = report.get("baseline")
    lines = [
        f"{report['device']}, shape {report['shape']}, {report['accumulation']} micro-batches "
        f"per replica per step, {report['mode']}; bf16 matmul peak {peak:.0f} TFLOP/s"
        + "".join(f"; --set {text}" for text in report.get("settings", []))
        + (f"; one GPU: {baseline['file']}" if baseline and "1gpu" not in results else ""),
        "| layout | GPUs | tokens/s | tokens/s per GPU | efficiency vs 1 GPU | MFU (989) | "
        "of matmul peak | peak mem GiB | bubble (critical stage) / theory (p−1)/(v·m) | "
        "GPU idle | stage imbalance | loss Δrel vs 1 GPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "tokens_per_s" not in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[0][:120]} |")
            continue
        per_gpu = r["tokens_per_s"] / r["gpus"]
        efficiency = per_gpu / base if base else float("nan")
        achieved = per_gpu * r["flops_per_token"]
        theory = bubble_theory(name, r.get("micro_batches", report["accumulation"]))
        bubble = "- | - | -"
        if theory and r.get("pipeline_bubble") is not None:
            bubble = (
                f"{100 * r['pipeline_bubble']:.1f}% / {100 * theory:.1f}% | "
                f"{100 * r['pipeline_idle']:.1f}% | {100 * r['pipeline_imbalance']:.1f}%"
            )
        lines.append(
            f"| {name} | {r['gpus']} | {r['tokens_per_s']:,.0f} | {per_gpu:,.0f} | "
            f"{100 * efficiency:.1f}% | {100 * achieved / 989e12:.1f}% | "
            f"{100 * achieved / (peak * 1e12):.1f}% | {_memory_cell(r)} | {bubble} | "
            f"{same_data_difference(name, r, one_gpu)} |"
        )
    return "\n".join(lines)


def _memory_cell(result: dict) -> str:
    """Peak memory, and the allocator's cache-emptying retries when there were any."""
    retries = result.get("cuda_alloc_retries", 0)
    cell = f"{result['peak_memory_gb']:.1f}"
    return f"{cell} ({retries} allocator retries)" if retries else cell


def drive(args) -> None:
    import torch

    from benchmarks.train_throughput import prepare_shards, run_matmul

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shards = prepare_shards(out)
    cuda = args.device == "cuda"
    gpu = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if cuda else "CPU"
    report = {
        "date": str(date.today()),
        "shape": args.shape,
        "accumulation": args.accumulation,
        "mode": "compiled" if args.compile else "eager",
        "settings": args.set,
        "device": f"{gpu} (torch {torch.__version__})",
        "matmul_tflops": run_matmul()["tflops"] if cuda else None,
        "results": {},
    }
    if args.baseline:
        report["baseline"] = read_baseline(Path(args.baseline), report)
    for layout in args.layouts.split(","):
        report["results"][layout] = run_layout(args, layout, shards)
        print(layout, json.dumps(report["results"][layout])[:400], flush=True)
        # After every layout: a later one that stalls must not lose the earlier figures.
        (out / f"scaling-{args.shape}.json").write_text(json.dumps(report, indent=2))
    print(table(report), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--layouts", default="1gpu,dp2,tp2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=240, help="Seconds per layout.")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--compile", action="store_true", help="training.compile=true (default: eager)."
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A config key for every layout, e.g. parallel.ddp_bucket_mb=200.",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then profile 2 more steps on rank 0: OUT/profile-SHAPE-LAYOUT.txt",
    )
    parser.add_argument(
        "--baseline",
        help="scaling-SHAPE.json of another run whose one-GPU result the efficiencies use "
        "(for layouts run apart from their baseline, e.g. beside it on other GPUs)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmark-out"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--shards", help=argparse.SUPPRESS)
    args = parser.parse_args()
    worker(args) if args.worker else drive(args)


if __name__ == "__main__":
    main()
