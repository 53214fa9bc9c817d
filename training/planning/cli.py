"""``megalith plan``: the fastest parallel layouts of a recipe on a cluster of N GPUs."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from megalith.config import load_config
from training.memory.activations import GIB
from training.planning.hardware import GPUS, UnknownGPUError, gpu_kind
from training.planning.layout import Cluster, PlanError, SearchResult, search


def register(subcommands: argparse._SubParsersAction) -> None:
    plan = subcommands.add_parser(
        "plan",
        help="search TP/PP/DP/CP/EP layouts of a recipe on N GPUs we may not have",
        description="Search tensor, pipeline, data, context and expert parallelism, virtual "
        "pipeline stages, fp8, activation recomputation and the micro-batch for a recipe on a "
        "cluster of --gpus GPUs; refuse layouts that do not fit in memory (the memory "
        "planner's accounting) and rank the rest by a compute + communication time model "
        "calibrated on benchmarks/RESULTS.md (training/planning/). Predictions, not "
        "measurements: see docs/multi-node.md.",
        epilog="example: megalith plan --model configs/llama-1b.yaml --gpus 64 --gpu h100 --top 5",
    )
    plan.add_argument("--model", required=True, metavar="YAML", help="recipe")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    plan.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs in all")
    plan.add_argument("--gpu", default="h100", help=f"GPU kind: {', '.join(GPUS)}")
    where = plan.add_mutually_exclusive_group()
    where.add_argument("--nodes", type=int, metavar="M", help="nodes (GPUs per node = N / M)")
    where.add_argument("--gpus-per-node", type=int, default=8, metavar="G")
    plan.add_argument("--global-batch", type=int, metavar="B", help="sequences per step")
    plan.add_argument("--seq", type=int, metavar="S", help="sequence length")
    plan.add_argument("--top", type=int, default=5, metavar="K", help="layouts to print")
    plan.add_argument(
        "--ib-gbits",
        type=float,
        metavar="GBITS",
        help="InfiniBand per GPU in Gb/s (default: 400; 200 for a100)",
    )
    plan.add_argument(
        "--dp-overlap",
        type=float,
        default=0.5,
        metavar="F",
        help="share of the data-parallel gradient reduction hidden by the backward pass",
    )
    plan.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    plan.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace) -> int:
    config = load_config(args.model, args.set)
    try:
        gpu = gpu_kind(args.gpu)
    except UnknownGPUError as error:
        raise PlanError(f"--gpu: {error}") from None
    gpus_per_node = args.gpus_per_node
    if args.nodes is not None:
        if args.nodes < 1 or args.gpus % args.nodes:
            raise PlanError(f"--gpus {args.gpus} does not split evenly over --nodes {args.nodes}")
        gpus_per_node = args.gpus // args.nodes
    if args.top < 1:
        raise PlanError(f"--top must be >= 1, got {args.top}")
    cluster = Cluster(gpu, args.gpus, gpus_per_node, args.ib_gbits or gpu.ib_gbits, args.dp_overlap)
    batch = args.global_batch or config.training.global_batch_size
    seq = args.seq or config.data.seq_length
    result = search(config, cluster, global_batch=batch, seq=seq, top=args.top)
    if args.json:
        print(json.dumps(_as_json(result, cluster, batch, seq)))
    else:
        print(format_result(result, cluster, config.name, batch, seq))
    return 0 if result.best else 1


def _table(result: SearchResult) -> list[str]:
    lines = [
        f"{'#':>2}  {'layout':<27}{'dp mode':<22}{'prec':<6}{'recompute':<10}{'mb':>4}"
        f"{'GiB/GPU':>9}{'step s':>9}{'tokens/s':>13}{'MFU':>7}  time split"
    ]
    for rank, p in enumerate(result.best, 1):
        t = p.time
        split = ", ".join(
            f"{label} {value / t.total:.0%}"
            for label, value in (
                ("tp", t.tensor_parallel),
                ("cp", t.context_parallel),
                ("ep", t.expert_parallel),
                ("bubble", t.pipeline_bubble),
                ("p2p", t.pipeline_p2p),
                ("dp", t.data_parallel),
            )
            if value / t.total >= 0.005
        )
        lo = p.layout
        lines.append(
            f"{rank:>2}  {lo.describe():<27}{lo.data_parallel_mode:<22}{lo.precision:<6}"
            f"{lo.recompute:<10}{lo.micro_batch_size:>4}{p.memory.total / GIB:>9.1f}"
            f"{t.total:>9.2f}{p.tokens_per_s:>13,.0f}{p.mfu:>7.1%}  "
            f"compute {t.compute / t.total:.0%}{', ' + split if split else ''}"
        )
    lines.append("train the first: --set " + " --set ".join(result.best[0].layout.overrides()))
    return lines


def _as_json(result: SearchResult, cluster: Cluster, batch: int, seq: int) -> dict:
    return {
        "cluster": {**asdict(cluster), "nodes": cluster.nodes},
        "global_batch": batch,
        "seq": seq,
        "considered": result.considered,
        "fitting": result.fitting,
        "usable_gib": result.usable_bytes / GIB,
        "best": [prediction.as_dict() for prediction in result.best],
        "refused_by_reason": result.refused_by_reason,
        "refused_examples": [
            {"layout": asdict(r.layout), "reason": r.reason} for r in result.refused[:5]
        ],
    }


def format_result(result: SearchResult, cluster: Cluster, name: str, batch: int, seq: int) -> str:
    gpu = cluster.gpu
    lines = [
        f"{name} on {cluster.gpus} x {gpu.name} ({cluster.nodes} node(s) of "
        f"{min(cluster.gpus, cluster.gpus_per_node)}, InfiniBand {cluster.ib_gbits:g} Gb/s per "
        f"GPU), global batch {batch} x seq {seq}: {result.considered} layouts, "
        f"{result.fitting} fit in {result.usable_bytes / GIB:.1f} GiB usable",
    ]
    if not result.best:
        lines.append("no layout fits; the closest:")
        shown: set[tuple] = set()
        for refusal in sorted(result.refused, key=lambda r: r.needed_bytes):
            lo = refusal.layout
            key = (lo.describe(), lo.data_parallel_mode, lo.recompute, lo.micro_batch_size)
            if key in shown:
                continue
            shown.add(key)
            lines.append(
                f"  {lo.describe()} {lo.data_parallel_mode}, recompute {lo.recompute}, "
                f"micro-batch {lo.micro_batch_size}: {refusal.reason}"
            )
            if len(shown) == 3:
                break
        lines.append("  (more GPUs, or a larger GPU with --gpu, lower the memory per GPU)")
    else:
        lines += _table(result)
    if result.refused_by_reason:
        counts = ", ".join(f"{n} {reason}" for reason, n in result.refused_by_reason.items())
        lines.append(f"refused: {counts}")
    return "\n".join(lines)
