"""Preprocessing throughput against SentencePiece's own batch encoding (the ceiling).

Measured in one run on the same text and cores:

* ceiling: ``SentencePieceProcessor.encode(texts, num_threads=k)`` over documents already
  in memory (no reading, no writing), for k = 1 and k = N;
* Megalith: ``prepare_dataset`` (read jsonl, tokenize in worker processes, write shards)
  with 1 and N workers; the tokenize pass is timed on its own and with the scan pass.

    python benchmarks/preprocess.py --megabytes 30 --workers 2 --repeats 3

It prints a table and the matching rows for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import sentencepiece

from megalith.config import DataConfig, TokenizerConfig
from preprocessing.prepare import prepare_dataset
from preprocessing.tokenizer import load_tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.ray_cluster for --ray, from any directory
SAMPLE = ROOT / "preprocessing" / "sample_corpus" / "stories.jsonl"


def make_corpus(path: Path, megabytes: float) -> list[str]:
    """Repeat the sample corpus (each copy's documents shuffled differently) to the size asked."""
    import random

    texts = [json.loads(line)["text"] for line in SAMPLE.read_text().splitlines() if line.strip()]
    target = int(megabytes * 1e6)
    written = 0
    documents = []
    rng = random.Random(0)
    with path.open("w") as handle:
        while written < target:
            copy = texts[:]
            rng.shuffle(copy)
            for text in copy:
                line = json.dumps({"text": text}) + "\n"
                handle.write(line)
                documents.append(text)
                written += len(line.encode())
                if written >= target:
                    break
    return documents


def time_ceiling(model: str, documents: list[str], threads: int) -> dict:
    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    processor.encode(documents[:200], num_threads=threads)  # warm-up
    started = time.perf_counter()
    tokens = 0
    for start in range(0, len(documents), 512):
        ids = processor.encode(documents[start : start + 512], num_threads=threads)
        tokens += sum(map(len, ids))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "documents": len(documents), "tokens": tokens}


def time_pipeline(
    corpus: Path, model: str, workers: int, output: Path, ray_address: str | None = None
) -> dict:
    """``prepare_dataset`` on ``workers`` local processes, or on Ray given an address."""
    tokenizer = load_tokenizer(model)
    data = DataConfig(
        inputs=[str(corpus)], output=str(output), workers=workers, shards=4, append_eod=False,
        engine="ray" if ray_address else "local", ray_address=ray_address,
    )  # fmt: skip
    started = time.perf_counter()
    report = prepare_dataset(data, tokenizer, show_progress=False)
    total = time.perf_counter() - started
    return {
        "seconds": report.tokenize_seconds,
        "seconds_with_scan": total,
        "documents": report.tokenized_documents,
        "tokens": report.tokenized_tokens,
        "bytes": report.tokenized_bytes,
        "nodes": len(report.nodes),
        "shards": [f.sha256 for shard in report.manifest.shards for f in shard.files.values()],
    }


def _median(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda run: run["seconds"])[len(runs) // 2]


def rate(result: dict, key: str = "seconds") -> dict:
    return {
        "docs_per_s": result["documents"] / result[key],
        "tokens_per_s": result["tokens"] / result[key],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=float, default=40.0, help="corpus size to generate")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="N")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each; medians are kept")
    parser.add_argument(
        "--ray",
        action="store_true",
        help="also time the Ray engine (two local nodes of one CPU, or --ray-address)",
    )
    parser.add_argument("--ray-address", help="the Ray cluster for --ray")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        corpus = scratch / "corpus.jsonl"
        documents = make_corpus(corpus, args.megabytes)
        mb = corpus.stat().st_size / 1e6
        tokenizer = train_tokenizer(
            documents[:20000], TokenizerConfig(vocab_size=args.vocab_size), str(scratch / "tok")
        )
        model = tokenizer.model_path
        rows = []
        for workers in sorted({1, args.workers}):
            # Interleave the two and keep the medians: this machine's speed drifts by ±15%.
            ceilings, runs = [], []
            for repeat in range(args.repeats):
                ceilings.append(time_ceiling(model, documents, workers))
                runs.append(
                    time_pipeline(corpus, model, workers, scratch / f"s-{workers}-{repeat}")
                )
            ceiling, ours = _median(ceilings), _median(runs)
            assert ours["tokens"] == ceiling["tokens"], "pipeline and ceiling tokenized other text"
            rows.append((workers, ceiling, ours))
        if args.ray:
            from tests.ray_cluster import given_or_local  # Ray is an optional extra

            with given_or_local(args.ray_address) as address:
                runs = [
                    time_pipeline(corpus, model, 1, scratch / f"ray-{repeat}", address)
                    for repeat in range(args.repeats)
                ]
            ray_run = _median(runs)

    print(
        f"\ncorpus {mb:.1f} MB, {len(documents):,} documents, {rows[0][1]['tokens']:,} tokens, vocab {args.vocab_size}"
    )
    print(
        f"{'cores':>5} {'ceiling tok/s':>14} {'megalith tok/s':>15} {'ratio':>6} {'docs/s':>9} {'MB/s':>6} {'with scan tok/s':>16}"
    )
    base = rate(rows[0][2])["tokens_per_s"]
    lines = []
    for workers, ceiling, ours in rows:
        c, o, s = rate(ceiling), rate(ours), rate(ours, "seconds_with_scan")
        ratio = o["tokens_per_s"] / c["tokens_per_s"]
        print(
            f"{workers:>5} {c['tokens_per_s']:>14,.0f} {o['tokens_per_s']:>15,.0f} {ratio:>6.2f} "
            f"{o['docs_per_s']:>9,.0f} {ours['bytes'] / ours['seconds'] / 1e6:>6.1f} {s['tokens_per_s']:>16,.0f}"
        )
        lines.append(
            f"| {date.today()} | {platform.node() or 'cpu'} ({os.cpu_count()} cores) | {workers} | "
            f"{mb:.0f} MB jsonl | {c['tokens_per_s']:,.0f} | {o['tokens_per_s']:,.0f} | {ratio:.2f} | "
            f"{o['docs_per_s']:,.0f} | {ours['bytes'] / ours['seconds'] / 1e6:.1f} | "
            f"{o['tokens_per_s'] / base / workers:.2f} |"
        )
    if args.ray:
        r = rate(ray_run)
        same = ray_run["shards"] == rows[0][2]["shards"]
        print(
            f"ray on {ray_run['nodes']} node(s): {r['tokens_per_s']:,.0f} tok/s, "
            f"{r['docs_per_s']:,.0f} docs/s, {ray_run['bytes'] / ray_run['seconds'] / 1e6:.1f} "
            f"MB/s; the same shard bytes as the local engine's: {same}"
        )
    print("\nrows for benchmarks/RESULTS.md:")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
