"""Is the data loader ever on the critical path? Its rate beside the GPU's.

Draws micro-batches of a recipe's shape (``--shape``, as in train_throughput.py: the ~1B
recipe's sequence 2048 and micro-batch 8 by default; ``t5-base`` span-corrupts its
samples on the way) through the trainer's own DataLoader (real shards, the resumable
sampler, pinned memory where CUDA is present, ``training.num_workers`` workers with
prefetch) and reports how many tokens per second it delivers, against the tokens per
second a training step consumes (``--gpu-tokens-per-s``; by default the compiled step
measured in benchmarks/RESULTS.md for the shape). The model is shrunk to one tiny layer:
only the data side is measured.

    python benchmarks/data_loader.py --workers 0 1 2 --batches 200
    python benchmarks/data_loader.py --shape t5-base --micro-batch 128 --batches 30
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

from train_throughput import SHAPES, load_shape, prepare_shards  # noqa: E402

TINY_MODEL = [
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.num_attention_heads=2",
    "model.ffn_hidden_size=128",
]
TINY_BY_FAMILY = {"t5": ["model.num_decoder_layers=1"], "gpt": ["model.num_query_groups=2"]}

# What the compiled step consumes on one H200, tokens/s (benchmarks/RESULTS.md): 1B bf16
# (2026-11-23), T5-base at micro-batch 128 (2026-11-28).
GPU_TOKENS_PER_S = {"1b": 77_244, "t5-base": 548_762}


def loader_rate(
    shards: str, shape: str, micro_batch: int | None, workers: int, batches: int, out: Path
) -> dict:
    """Micro-batches per second from the trainer's loader, after the first one."""
    from training.trainer import Trainer

    family = "t5" if shape.startswith("t5") else "gpt"
    settings = [*TINY_MODEL, *TINY_BY_FAMILY[family], f"training.num_workers={workers}"]
    config = load_shape(shape, shards, batches + 1, False, micro_batch, settings)
    trainer = Trainer(config, out / f"loader-{shape}-{workers}")
    iterator = trainer.train_batches()
    next(iterator)  # worker start-up is paid once per run, not per step
    started = time.perf_counter()
    for _ in range(batches):
        batch = next(iterator)
    seconds = time.perf_counter() - started
    first = next(iter(batch.values()))
    tokens = batches * first.shape[0] * trainer.tokens_per_sample  # T5: encoder + decoder
    return {
        "shape": shape,
        "workers": workers,
        "micro_batch": first.shape[0],
        "tokens_per_sample": trainer.tokens_per_sample,
        "batches_per_s": batches / seconds,
        "tokens_per_s": tokens / seconds,
        "pinned": bool(first.is_pinned()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument(
        "--gpu-tokens-per-s",
        type=float,
        default=None,
        help="what a training step consumes (default: the shape's compiled step on one "
        f"H200 in RESULTS.md, {GPU_TOKENS_PER_S})",
    )
    parser.add_argument("--out", default="benchmark-out/data-loader")
    args = parser.parse_args()
    gpu_rate = args.gpu_tokens_per_s or GPU_TOKENS_PER_S.get(args.shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shards = prepare_shards(out, sentinels=100 if args.shape.startswith("t5") else 0)
    rows = [
        loader_rate(shards, args.shape, args.micro_batch, workers, args.batches, out)
        for workers in args.workers
    ]
    print("| workers | micro-batches/s | tokens/s | × what the GPU step consumes | pinned |")
    print("|---|---|---|---|---|")
    for row in rows:
        row["headroom"] = row["tokens_per_s"] / gpu_rate if gpu_rate else None
        headroom = f"{row['headroom']:,.0f}×" if gpu_rate else "(no GPU figure)"
        print(
            f"| {row['workers']} | {row['batches_per_s']:,.0f} | {row['tokens_per_s']:,.0f} | "
            f"{headroom} | {row['pinned']} |"
        )
    (out / "data-loader.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
