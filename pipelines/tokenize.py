"""The ``tokenize-corpus`` flow: corpus → tokenizer (trained or given) → shards + manifest."""

from __future__ import annotations

import hashlib
import json

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from megalith.config import DataConfig, MegalithConfig, TokenizerConfig
from megalith.errors import MegalithError
from preprocessing.prepare import PrepareReport, prepare_dataset
from preprocessing.stage import ensure_tokenizer
from preprocessing.tokenizer import load_tokenizer

# No Prefect cache on these two tasks: the stage is its own cache, and it looks at the data.
# ensure_tokenizer reuses a model whose record matches the inputs and settings, and
# prepare_dataset skips shards whose markers and sha256 still verify. A cache keyed on the
# parameters alone would report success after the shards were deleted or an input changed.


def retry_transient(task, task_run, state) -> bool:
    """Retry storage and network hiccups, never problems with the user's input."""
    error = state.result(raise_on_failure=False)
    return isinstance(error, OSError | ConnectionError) and not isinstance(error, MegalithError)


@task(
    name="train-tokenizer",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_transient,
    cache_policy=NO_CACHE,
)
def train_tokenizer_task(data: DataConfig, tokenizer: TokenizerConfig) -> str:
    """Train (or load, or reuse) the tokenizer; returns its path."""
    trained = ensure_tokenizer(MegalithConfig(data=data, tokenizer=tokenizer))
    get_run_logger().info(
        "tokenizer %s (id %s, vocab %d)", trained.model_path, trained.id[:16], trained.vocab_size
    )
    return trained.model_path


@task(
    name="write-shards",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_transient,
    cache_policy=NO_CACHE,
)
def write_shards_task(data: DataConfig, tokenizer: TokenizerConfig, model_path: str) -> dict:
    """Tokenize into shards; returns a small JSON summary (never tensors: Prefect pickles results)."""
    loaded = load_tokenizer(model_path, tokenizer.pad_vocab_multiple, data.storage_options)
    report = prepare_dataset(data, loaded, tokenizer, show_progress=False)
    logger = get_run_logger()
    logger.info(
        "wrote %d shard(s), skipped %d complete: %s documents, %s tokens",
        len(report.written),
        len(report.skipped),
        f"{report.manifest.documents:,}",
        f"{report.manifest.tokens:,}",
    )
    return summarise(report)


def summarise(report: PrepareReport) -> dict:
    manifest = report.manifest
    return {
        "output": report.output,
        "tokenizer_id": manifest.tokenizer.id,
        "documents": manifest.documents,
        "tokens": manifest.tokens,
        "shards": len(manifest.shards),
        "written": report.written,
        "skipped": report.skipped,
        "rejected": manifest.rejected.model_dump(),
        "shards_id": shards_id(report),
        **{key: round(value, 1) for key, value in report.rates().items()},
    }


def shards_id(report: PrepareReport) -> str:
    """Identify the data by content (tokenizer and every file hash), not by write time."""
    manifest = report.manifest
    hashes = [info.sha256 for shard in manifest.shards for info in shard.files.values()]
    return hashlib.sha256(json.dumps([manifest.tokenizer.id, hashes]).encode()).hexdigest()


def manifest_markdown(summary: dict) -> str:
    rejected = summary["rejected"]
    lines = [
        f"# Shards at `{summary['output']}`",
        "",
        "| | |",
        "|---|---|",
        f"| tokenizer id | `{summary['tokenizer_id'][:16]}…` |",
        f"| documents | {summary['documents']:,} |",
        f"| tokens | {summary['tokens']:,} |",
        f"| shards | {summary['shards']} ({len(summary['written'])} written, {len(summary['skipped'])} reused) |",
        f"| throughput | {summary['documents_per_s']:,} docs/s, {summary['tokens_per_s']:,} tokens/s, {summary['mb_per_s']} MB/s |",
        f"| rejected records | {rejected['total']} |",
    ]
    if rejected["total"]:
        lines += ["", "| reason | count |", "|---|---|"]
        lines += [f"| {reason} | {count} |" for reason, count in rejected["counts"].items()]
        lines += ["", "Examples:", ""]
        lines += [
            f"- `{e['location']}`: {e['reason']} {e.get('detail', '')}"
            for e in rejected["examples"]
        ]
    return "\n".join(lines)


@flow(name="tokenize-corpus", log_prints=True)
def tokenize_corpus(
    data: DataConfig,
    tokenizer: TokenizerConfig = TokenizerConfig(),  # noqa: B008 - rendered as the form's default
) -> dict:
    """Train or load a tokenizer (SentencePiece or Hugging Face), then write Megatron shards
    and a manifest."""
    model_path = train_tokenizer_task(data, tokenizer)
    summary = write_shards_task(data, tokenizer, model_path)
    create_markdown_artifact(
        key="shard-manifest",
        markdown=manifest_markdown(summary),
        description=f"Shard set written to {summary['output']}",
    )
    return summary
