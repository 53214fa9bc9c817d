"""``megalith train``: pretrain a GPT from a recipe."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from preprocessing.storage import atomic_write_json
from training.config import load_config


def register(subcommands: argparse._SubParsersAction) -> None:
    train = subcommands.add_parser(
        "train",
        help="pretrain a GPT from a recipe (configs/*.yaml)",
        description="Train a GPT on prepared shards. Writes OUTPUT/metrics.jsonl (one JSON "
        "object per optimizer step), OUTPUT/checkpoints/step-*/ (safetensors + JSON) and "
        "OUTPUT/model/ (the final model package); tracks the run in MLflow unless "
        "logging.mlflow=false.",
        epilog="example: megalith train --config configs/tiny-cpu.yaml --set training.train_iters=50",
    )
    train.add_argument("--config", required=True, metavar="YAML", help="recipe")
    train.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    train.add_argument("--output", metavar="DIR", help="run directory (default runs/NAME)")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    train.add_argument("--quiet", action="store_true", help="log lines instead of a progress bar")
    train.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    values = {"checkpoint.resume": True} if args.resume else {}
    config = load_config(args.config, args.set, values)
    # Only now the heavy imports (torch, ~seconds): a bad config fails at once.
    from registry.tracking import lineage_tags, open_run_logger
    from training.trainer import train

    output = Path(args.output or Path("runs") / config.name)
    sources = [source.path for source in config.data.training_sources()]
    run_logger = open_run_logger(
        config.logging,
        run_name=config.logging.run_name or config.name,
        rank=0,
        workdir=Path.cwd(),
        tags=lineage_tags(sources, storage_options=config.data.storage_options),
    )
    if args.quiet:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    status = "FAILED"
    try:
        result = train(config, output, run_logger, show_progress=not args.quiet)
        if hasattr(run_logger, "log_loss_curve"):
            run_logger.log_loss_curve(output / "metrics.jsonl")
        status = "FINISHED"
    finally:
        run_logger.close(status)
    run_id = getattr(run_logger, "run_id", None)
    if run_id:
        summary = json.loads((output / "result.json").read_text())
        atomic_write_json(str(output / "result.json"), {**summary, "mlflow_run_id": run_id})
    print(f"trained {result.steps} steps: loss {result.final_loss:.4f}", end="")
    print(f", validation loss {result.val_loss:.4f}" if result.val_loss is not None else "")
    print(f"  {result.tokens_per_s:,.0f} tokens/s; metrics in {output / 'metrics.jsonl'}")
    print(f"  checkpoint {result.checkpoint}; model package {result.model_package}")
    return 0
