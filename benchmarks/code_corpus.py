"""A corpus that does not repeat, from what any machine has: its installed Python sources.

The shipped sample corpus is small; models of 350M parameters and up memorise it within
a few hundred steps, so comparisons of loss curves on it (fp8 against bf16) measure
memorisation as much as numerics. The GPU machines reach no network, but their
site-packages hold hundreds of megabytes of real, varied text (code, docstrings,
comments). This writes the first ``--megabytes`` of it, one document per file in a fixed
order, trains a SentencePiece tokenizer on a sample and prepares shards:

    python benchmarks/code_corpus.py --megabytes 200 --out $OUT/code   # then:
    python benchmarks/fp8_convergence.py --shape 350m --shards $OUT/code/shards ...
"""

from __future__ import annotations

import argparse
import json
import site
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megalith.config import DataConfig, TokenizerConfig  # noqa: E402
from preprocessing.prepare import prepare_dataset  # noqa: E402
from preprocessing.tokenizer import train_tokenizer  # noqa: E402

MAX_FILE_BYTES = 200_000  # generated tables and vendored blobs are not text worth learning


def source_files() -> list[Path]:
    """Every .py file under the interpreter's site-packages, in a fixed order."""
    roots = sorted({Path(p) for p in site.getsitepackages() if Path(p).is_dir()})
    return [path for root in roots for path in sorted(root.rglob("*.py"))]


def write_corpus(path: Path, megabytes: int) -> tuple[int, int]:
    """Documents and bytes written to ``path`` (JSON lines with a ``text`` field)."""
    budget, written, documents = megabytes << 20, 0, 0
    seen: set[int] = set()  # the same file vendored twice is one document
    with path.open("w") as out:
        for source in source_files():
            try:
                text = source.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not 200 <= len(text) <= MAX_FILE_BYTES or hash(text) in seen:
                continue
            seen.add(hash(text))
            line = json.dumps({"text": text}) + "\n"
            out.write(line)
            written, documents = written + len(line), documents + 1
            if written >= budget:
                break
    return documents, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = args.out / "corpus.jsonl"
    documents, written = write_corpus(corpus, args.megabytes)
    print(f"corpus: {documents} files, {written / 2**20:.0f} MB -> {corpus}", flush=True)
    sample = []
    with corpus.open() as lines:
        for index, line in enumerate(lines):
            if index % 20 == 0:  # a spread-out sample is enough to learn the pieces
                sample.append(json.loads(line)["text"])
    tokenizer = train_tokenizer(
        sample, TokenizerConfig(vocab_size=args.vocab_size), str(args.out / "tokenizer")
    )
    data = DataConfig(inputs=[str(corpus)], output=str(args.out / "shards"), workers=args.workers)
    prepare_dataset(data, tokenizer, show_progress=False)
    print(f"shards: {args.out / 'shards'}", flush=True)


if __name__ == "__main__":
    main()
