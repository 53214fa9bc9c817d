"""Curation: near-duplicate precision and recall, throughput against datatrove, index memory.

One run, one machine, one corpus:

* corpus: Zipf-distributed synthetic English-like prose (paragraphs of sentences), and
  planted near duplicates: copies of chosen documents, placed later in the stream, with
  k word edits each (substitute, insert or delete a word; k = 1, 2, 4, 8, 16, 32). The
  ground truth is which document each copy came from and its k.
* precision / recall of near-duplicate removal (only that rule on) for Megalith
  (datasketch MinHash + LSH) and datatrove (its 4-stage MinHash deduplication) with the
  same shingles (word 5-grams) and the same bands x rows.
* throughput of the whole curation pass, one process each: Megalith's `curate_corpus`
  (exact + Gopher quality and repetition rules + decontamination + MinHash LSH, writing
  jsonl) against datatrove's GopherRepetitionFilter + GopherQualityFilter +
  C4QualityFilter, then MinHash signature, buckets, cluster and filter (writing jsonl):
  docs/s and MB/s by wall clock and per CPU-second (one core each).
* memory of the LSH index (and of the exact-duplicate keys) measured with tracemalloc
  while indexing n documents, per million documents and projected to a billion.

    pip install datatrove==0.10.1 spacy   # the benchmark only; datatrove's English words
    python benchmarks/curate.py --documents 20000 --planted 3000 --index-documents 100000

datatrove is not a project dependency: without it the datatrove columns are skipped.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import random
import resource
import shutil
import sys
import tempfile
import time
import tracemalloc
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from megalith.config import CurateConfig, DataConfig
from preprocessing.curate import curate_corpus
from preprocessing.dedup import ExactDuplicates, NearDuplicates, shingles

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.ray_cluster for --ray, from any directory
SAMPLE_TASK = ROOT / "evaluation" / "tasks" / "sample_facts.jsonl"
EDITS = (1, 2, 4, 8, 16, 32)
COMMON = [
    "the",
    "of",
    "and",
    "to",
    "a",
    "in",
    "is",
    "that",
    "it",
    "was",
    "for",
    "on",
    "with",
    "as",
    "be",
    "at",
    "by",
    "this",
    "have",
    "from",
    "or",
    "had",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "an",
    "your",
    "which",
    "their",
    "said",
    "if",
    "do",
    "will",
    "each",
    "about",
    "how",
    "up",
    "out",
    "them",
    "then",
    "she",
    "many",
    "some",
    "so",
    "these",
    "would",
    "other",
    "into",
    "has",
    "more",
    "her",
    "two",
    "like",
    "him",
    "see",
]


# --------------------------------------------------------------------------- corpus


class Prose:
    """Zipf-distributed words in sentences and paragraphs: text that passes Gopher's rules."""

    def __init__(self, seed: int, vocabulary: int = 20_000):
        self.rng = np.random.default_rng(seed)
        letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
        weights = np.linspace(2.0, 0.2, len(letters))
        made = set(COMMON)
        words = list(COMMON)
        while len(words) < vocabulary:
            word = "".join(
                self.rng.choice(letters, self.rng.integers(3, 10), p=weights / weights.sum())
            )
            if word not in made:
                made.add(word)
                words.append(word)
        self.words = np.array(words)
        ranks = np.arange(1, vocabulary + 1)
        self.p = 1.0 / (ranks + 2.7)
        self.p /= self.p.sum()

    def sample(self, count: int) -> list[str]:
        return list(self.words[self.rng.choice(len(self.words), count, p=self.p)])

    def document(self) -> str:
        paragraphs = []
        for _ in range(self.rng.integers(3, 8)):
            sentences = []
            for _ in range(self.rng.integers(2, 6)):
                words = self.sample(int(self.rng.integers(6, 20)))
                sentences.append(" ".join([words[0].capitalize(), *words[1:]]) + ".")
            paragraphs.append(" ".join(sentences))
        return "\n".join(paragraphs)


def edited(text: str, edits: int, prose: Prose, rng: random.Random) -> str:
    """``text`` after ``edits`` random word substitutions, insertions and deletions."""
    words = text.split(" ")
    for _ in range(edits):
        position = rng.randrange(len(words))
        operation = rng.choice(("substitute", "insert", "delete"))
        if operation == "substitute":
            words[position] = prose.sample(1)[0]
        elif operation == "insert":
            words.insert(position, prose.sample(1)[0])
        elif len(words) > 1:
            del words[position]
    return " ".join(words)


def make_corpus(path: Path, documents: int, planted: int, seed: int) -> dict:
    """Write the corpus as jsonl; return the ground truth ``{copy id: [source id, k]}``."""
    prose = Prose(seed)
    rng = random.Random(seed)
    base = [prose.document() for _ in range(documents)]
    sources = sorted(rng.sample(range(documents), planted))
    placed: list[tuple[float, str, str]] = [(i, f"d{i}", text) for i, text in enumerate(base)]
    truth = {}
    for number, source in enumerate(sources):
        k = EDITS[number % len(EDITS)]
        copy_id = f"c{number}"
        truth[copy_id] = [f"d{source}", k]
        where = rng.uniform(source + 0.5, documents)
        placed.append((where, copy_id, edited(base[source], k, prose, rng)))
    placed.sort()
    with path.open("w") as handle:
        for _, doc_id, text in placed:
            handle.write(json.dumps({"text": text, "id": doc_id}) + "\n")
    return truth


def jaccard_by_edits(path: Path, truth: dict, shingle: int) -> dict[int, float]:
    """The mean true Jaccard similarity of the 5-gram shingle sets of each copy and its
    source, per number of edits."""
    texts = {}
    for line in path.open():
        record = json.loads(line)
        texts[record["id"]] = record["text"]
    found: dict[int, list[float]] = {}
    for copy_id, (source, k) in truth.items():
        a, b = set(shingles(texts[copy_id], shingle)), set(shingles(texts[source], shingle))
        found.setdefault(k, []).append(len(a & b) / len(a | b))
    return {k: float(np.mean(v)) for k, v in sorted(found.items())}


def scores(removed: set[str], truth: dict) -> dict:
    """Precision over every removed document; recall per number of edits."""
    planted = set(truth)
    hits = removed & planted
    recall = {}
    for k in EDITS:
        copies = {c for c, (_, edits) in truth.items() if edits == k}
        recall[k] = len(removed & copies) / max(1, len(copies))
    return {
        "removed": len(removed),
        "true_positives": len(hits),
        "false_positives": len(removed - planted),
        "precision": len(hits) / max(1, len(removed)),
        "recall": len(hits) / max(1, len(planted)),
        "recall_by_edits": recall,
    }


# --------------------------------------------------------------------------- runs


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def ids_of(path: Path) -> dict[str, str]:
    return {json.loads(line)["text"]: json.loads(line)["id"] for line in path.open()}


def run_ours(corpus: Path, work: Path, curate: CurateConfig, task_files: list[str]) -> dict:
    out = work / "ours"
    shutil.rmtree(out, ignore_errors=True)
    data = DataConfig(
        inputs=[str(corpus)], curate=curate.model_copy(update={"output": str(out)}), workers=1
    )
    wall, cpu = time.perf_counter(), cpu_seconds()
    report = curate_corpus(data, task_files, show_progress=False)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    by_text = ids_of(corpus)
    kept = {
        by_text[json.loads(line)["text"]]
        for f in sorted(out.glob("part-*.jsonl"))
        for line in f.open()
    }
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "kept": kept,
        "removed_by_rule": dict(report.record.removed.counts),
        "bands_rows": [report.lsh_bands, report.lsh_rows],
    }


def run_datatrove(corpus: Path, work: Path, filters: bool, bands: int, rows: int) -> dict:
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from loguru import logger

    logger.remove()  # datatrove logs every stage's stats; the table below is the result
    _encode_before_xxhash()
    root = work / ("datatrove-full" if filters else "datatrove-minhash")
    shutil.rmtree(root, ignore_errors=True)
    config = MinhashConfig(n_grams=5, num_buckets=bands, hashes_per_bucket=rows)

    def run(pipeline: list, name: str, tasks: int = 1) -> None:
        LocalPipelineExecutor(
            pipeline, tasks=tasks, workers=1, logging_dir=str(root / "logs" / name)
        ).run()

    def reader(folder: Path) -> JsonlReader:
        return JsonlReader(str(folder), glob_pattern="*.jsonl*")

    wall, cpu = time.perf_counter(), cpu_seconds()
    source = corpus.parent
    if filters:
        run([reader(source), GopherRepetitionFilter(), GopherQualityFilter(), C4QualityFilter(),
             JsonlWriter(str(root / "filtered"))], "filters")  # fmt: skip
        source = root / "filtered"
    run(
        [reader(source), MinhashDedupSignature(str(root / "signatures"), config=config)],
        "signatures",
    )
    run([MinhashDedupBuckets(str(root / "signatures"), str(root / "buckets"), config=config)],
        "buckets", tasks=bands)  # fmt: skip
    run(
        [MinhashDedupCluster(str(root / "buckets"), str(root / "remove"), config=config)], "cluster"
    )
    run(
        [reader(source), MinhashDedupFilter(str(root / "remove")), JsonlWriter(str(root / "kept"))],
        "filter",
    )
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    kept = set()
    for path in (root / "kept").glob("*.jsonl.gz"):
        with gzip.open(path, "rt") as handle:
            kept |= {json.loads(line)["id"] for line in handle}
    return {"wall_s": wall, "cpu_s": cpu, "kept": kept}


def _encode_before_xxhash() -> None:
    """datatrove 0.10.1 hands str to xxhash, which xxhash 4 (the project's pin) refuses:
    encode first, as xxhash 3 did inside."""
    import xxhash
    from datatrove.utils.hashes import xxhash as hashes

    hashes.xxhash32 = lambda data: xxhash.xxh32_intdigest(_bytes(data))
    hashes.xxhash64 = lambda data: xxhash.xxh64_intdigest(_bytes(data))


def _bytes(data: str | bytes) -> bytes:
    return data.encode("utf-8") if isinstance(data, str) else data


def index_memory(documents: int, curate: CurateConfig, seed: int) -> dict:
    """Bytes held by the LSH index and the exact keys after indexing ``documents`` distinct
    documents (each near no other, so each enters the index), measured by tracemalloc."""
    prose = Prose(seed + 1)
    texts = (" ".join(prose.sample(120)) for _ in range(documents))
    tracemalloc.start()
    near = NearDuplicates(curate.near_dedup)
    base = tracemalloc.get_traced_memory()[0]
    for ordinal, text in enumerate(texts):
        near.check(text, ordinal)
    lsh = tracemalloc.get_traced_memory()[0] - base
    exact = ExactDuplicates()
    base = tracemalloc.get_traced_memory()[0]
    for ordinal in range(documents):
        exact.check(f"document {ordinal}", ordinal)
    keys = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    indexed = len(near)
    return {"documents": documents, "indexed": indexed, "lsh_bytes": lsh, "exact_bytes": keys}


# --------------------------------------------------------------------------- report


def rates(documents: int, megabytes: float, run: dict) -> dict:
    return {
        "docs_per_s": documents / run["wall_s"],
        "mb_per_s": megabytes / run["wall_s"],
        "docs_per_cpu_s": documents / run["cpu_s"],
        "mb_per_cpu_s": megabytes / run["cpu_s"],
    }


SCALING = (
    ("local, 1 worker (in the driver)", {"workers": 1}),
    ("local, 2 worker processes", {"workers": 2}),
    ("ray, 2 nodes x 1 CPU", {"engine": "ray"}),
)


def run_scaling(
    corpus: Path, work: Path, task_files: list[str], address: str, documents: int, megabytes: float
) -> list[dict]:
    """The whole curation pass on each engine; each must keep the same bytes."""
    rows = []
    for label, settings in SCALING:
        out = work / "scaling"
        shutil.rmtree(out, ignore_errors=True)
        data = DataConfig(
            inputs=[str(corpus)], ray_address=address, **settings,
            curate=CurateConfig(output=str(out)),
        )  # fmt: skip
        wall = time.perf_counter()
        report = curate_corpus(data, task_files, show_progress=False)
        wall = time.perf_counter() - wall
        rows.append(
            {
                "engine": label,
                "wall_s": wall,
                "docs_per_s": documents / wall,
                "mb_per_s": megabytes / wall,
                "nodes": len(report.nodes),
                "outputs": {name: info.sha256 for name, info in report.record.outputs.items()},
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--documents", type=int, default=20_000, help="distinct documents")
    parser.add_argument("--planted", type=int, default=3_000, help="near-duplicate copies")
    parser.add_argument("--index-documents", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-datatrove", action="store_true")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="also time the whole pass on local 1 and 2 workers and on Ray (needs ray)",
    )
    parser.add_argument(
        "--ray-address", help="the Ray cluster for --scaling (default: two local nodes)"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="curate-bench-"))
    corpus = work / "corpus" / "corpus.jsonl"
    corpus.parent.mkdir()
    truth = make_corpus(corpus, args.documents, args.planted, args.seed)
    total = args.documents + args.planted
    megabytes = corpus.stat().st_size / 1e6
    curate = CurateConfig()
    near_only = CurateConfig.model_validate(
        {
            "exact_dedup": {"enabled": False},
            "quality": {"enabled": False},
            "decontamination": {"enabled": False},
        }
    )
    bands, rows = NearDuplicates(curate.near_dedup).bands, NearDuplicates(curate.near_dedup).rows
    results: dict = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "documents": total,
        "megabytes": megabytes,
        "jaccard_by_edits": jaccard_by_edits(corpus, truth, curate.near_dedup.shingle_size),
        "bands_rows": [bands, rows],
    }
    ours_near = run_ours(corpus, work, near_only, [])
    results["ours_near"] = scores(set(ids_of(corpus).values()) - ours_near["kept"], truth)
    ours_full = run_ours(corpus, work, curate, [str(SAMPLE_TASK)])
    results["ours_full"] = {
        **rates(total, megabytes, ours_full),
        "removed_by_rule": ours_full["removed_by_rule"],
    }
    all_ids = set(ids_of(corpus).values())
    if not args.no_datatrove:
        near = run_datatrove(corpus, work, filters=False, bands=bands, rows=rows)
        results["datatrove_near"] = scores(all_ids - near["kept"], truth)
        full = run_datatrove(corpus, work, filters=True, bands=bands, rows=rows)
        results["datatrove_full"] = {**rates(total, megabytes, full), "kept": len(full["kept"])}
    results["ours_full"]["kept"] = len(ours_full["kept"])
    if args.scaling:
        from tests.ray_cluster import given_or_local  # Ray is an optional extra

        with given_or_local(args.ray_address) as address:
            results["scaling"] = run_scaling(
                corpus, work, [str(SAMPLE_TASK)], address, total, megabytes
            )
    results["memory"] = [index_memory(n, curate, args.seed) for n in args.index_documents]
    shutil.rmtree(work, ignore_errors=True)
    print_report(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))


def print_report(results: dict) -> None:
    print(f"{results['date']}, {results['machine']}: {results['documents']:,} documents, "
          f"{results['megabytes']:.1f} MB; LSH {results['bands_rows'][0]} bands x {results['bands_rows'][1]} rows")  # fmt: skip
    print("\nnear duplicates: recall by word edits (true Jaccard of the 5-gram shingles)")
    print("| engine | precision | recall | " + " | ".join(
        f"k={k} (J {results['jaccard_by_edits'][k]:.2f})" for k in EDITS) + " | false positives |")  # fmt: skip
    print("|---" * (len(EDITS) + 4) + "|")
    for name in ("ours_near", "datatrove_near"):
        if name in results:
            r = results[name]
            cells = " | ".join(f"{r['recall_by_edits'][k]:.3f}" for k in EDITS)
            print(
                f"| {name.split('_')[0]} | {r['precision']:.4f} | {r['recall']:.3f} | {cells} | {r['false_positives']} |"
            )
    print("\nwhole curation pass, one process")
    print("| engine | docs/s | MB/s | docs per CPU-s | MB per CPU-s | kept |")
    print("|---|---|---|---|---|---|")
    for name in ("ours_full", "datatrove_full"):
        if name in results:
            r = results[name]
            print(f"| {name.split('_')[0]} | {r['docs_per_s']:,.0f} | {r['mb_per_s']:.2f} | "
                  f"{r['docs_per_cpu_s']:,.0f} | {r['mb_per_cpu_s']:.2f} | {r['kept']:,} |")  # fmt: skip
    print(f"ours removed by rule: {results['ours_full']['removed_by_rule']}")
    if "scaling" in results:
        print("\nwhole curation pass by engine (wall clock; the same output bytes in each)")
        print("| engine | docs/s | MB/s | Ray nodes that worked | same output as the first |")
        print("|---|---|---|---|---|")
        first = results["scaling"][0]["outputs"]
        for r in results["scaling"]:
            print(f"| {r['engine']} | {r['docs_per_s']:,.0f} | {r['mb_per_s']:.2f} | "
                  f"{r['nodes']} | {r['outputs'] == first} |")  # fmt: skip
    print("\nindex memory")
    print(
        "| documents indexed | LSH bytes/doc | exact keys bytes/doc | LSH per 1M docs | LSH for 1B docs |"
    )
    print("|---|---|---|---|---|")
    for m in results["memory"]:
        per = m["lsh_bytes"] / m["indexed"]
        print(f"| {m['indexed']:,} | {per:,.0f} | {m['exact_bytes'] / m['documents']:,.0f} | "
              f"{per * 1e6 / 2**30:.2f} GiB | {per * 1e9 / 2**40:.2f} TiB |")  # fmt: skip


if __name__ == "__main__":
    main()
