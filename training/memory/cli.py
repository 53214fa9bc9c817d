"""``megalith memory``: per-GPU memory of a recipe's layout and a micro-batch/recompute plan."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from megalith.config import load_config


# Handlers import the heavy stage modules (torch, mlflow, prefect) when they run, so that
# `megalith --help` and a bad flag answer at once.
def register(subcommands: argparse._SubParsersAction) -> None:
    memory = subcommands.add_parser(
        "memory",
        help="estimate per-GPU memory of a layout and plan micro-batch and recomputation",
        description="Print, per GPU, the parameters, gradients, AdamW state, activations, "
        "logits and communication buffers of the recipe's layout (parameter counts from the "
        "real model built on the meta device, sharded as the layout shards it), then the "
        "largest micro-batch for each model.activation_checkpointing mode that fits the GPU "
        "with a 10%% + 1.5 GiB safety margin, and a recommendation. Estimates: see "
        "training/memory/estimate.py for the accounting.",
        epilog="example: megalith memory --config configs/llama-1b.yaml --nproc-per-node 8 "
        "--set parallel.tensor=2 --gpu-memory-gib 80",
    )
    memory.add_argument("--config", required=True, metavar="YAML", help="recipe")
    memory.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    memory.add_argument(
        "--nproc-per-node", type=int, metavar="N", help="GPUs per node (default: data parallel 1)"
    )
    memory.add_argument("--nnodes", type=int, default=1, metavar="M", help="nodes in the job")
    memory.add_argument(
        "--gpu-memory-gib",
        type=float,
        metavar="GIB",
        help="memory of one GPU (default: the detected CUDA device)",
    )
    memory.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    memory.set_defaults(handler=_memory)


def _memory(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.set)
    # Only now torch (building the meta model): a bad recipe fails at once.
    from training.memory.estimate import (
        MemoryPlanError,
        check_gpu_flag,
        format_plan,
        format_report,
        memory_report,
        plan,
        resolve_layout,
    )

    world = None
    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1 or args.nnodes < 1:
            raise MemoryPlanError(
                f"--nproc-per-node {args.nproc_per_node} and --nnodes {args.nnodes} must be >= 1"
            )
        world = args.nproc_per_node * args.nnodes
    sizes = resolve_layout(config, world)
    gpu_bytes = check_gpu_flag(args.gpu_memory_gib)
    report = memory_report(config, sizes)
    result = plan(config, sizes, gpu_bytes)
    if args.json:
        layout = {**asdict(sizes), "world": sizes.world}
        print(json.dumps({"layout": layout, "report": report.as_dict(), "plan": asdict(result)}))
    else:
        print(format_report(report, sizes, config))
        print(format_plan(result))
    return 0
