"""Is the data loader ever on the critical path? Its rate beside the GPU's.

Draws micro-batches of the ~1B recipe's shape (sequence 2048, micro-batch 8) through
the trainer's own DataLoader (real shards, the resumable sampler, pinned memory where
CUDA is present, ``training.num_workers`` workers with prefetch) and reports how many
tokens per second it delivers, against the tokens per second a training step consumes
(``--gpu-tokens-per-s``: the compiled 1B step measured in benchmarks/RESULTS.md). The
model is shrunk to one tiny layer: only the data side is measured.

    python benchmarks/data_loader.py --workers 0 1 2 --batches 200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from train_throughput import load_shape, prepare_shards  # noqa: E402

TINY_MODEL = [
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.num_attention_heads=2",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
]


def loader_rate(shards: str, workers: int, batches: int, out: Path) -> dict:
    """Micro-batches per second from the trainer's loader, after the first one."""
    from training.trainer import Trainer

    settings = [*TINY_MODEL, f"training.num_workers={workers}"]
    config = load_shape("1b", shards, batches + 1, False, None, settings)
    trainer = Trainer(config, out / f"loader-{workers}")
    iterator = trainer.train_batches()
    next(iterator)  # worker start-up is paid once per run, not per step
    started = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
    seconds = time.perf_counter() - started
    tokens = batches * batch["tokens"].shape[0] * config.data.seq_length
    return {
        "workers": workers,
        "micro_batch": batch["tokens"].shape[0],
        "seq_length": config.data.seq_length,
        "batches_per_s": batches / seconds,
        "tokens_per_s": tokens / seconds,
        "pinned": bool(batch["tokens"].is_pinned()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument(
        "--gpu-tokens-per-s",
        type=float,
        default=77_244,
        help="what a training step consumes (default: compiled bf16 1B on one H200, RESULTS.md)",
    )
    parser.add_argument("--out", default="benchmark-out/data-loader")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shards = prepare_shards(out)
    rows = [loader_rate(shards, workers, args.batches, out) for workers in args.workers]
    print("| workers | micro-batches/s | tokens/s | × what the GPU step consumes | pinned |")
    print("|---|---|---|---|---|")
    for row in rows:
        row["headroom"] = row["tokens_per_s"] / args.gpu_tokens_per_s
        print(
            f"| {row['workers']} | {row['batches_per_s']:,.0f} | {row['tokens_per_s']:,.0f} | "
            f"{row['headroom']:,.0f}× | {row['pinned']} |"
        )
    (out / "data-loader.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
