"""The ``tokenize-corpus`` flow: corpus → tokenizer (trained or given) → shards + manifest."""

from __future__ import annotations

import contextlib
import hashlib
import json

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from evaluation.task_files import TaskFileError, resolve_task_file
from megalith.config import DataConfig, MegalithConfig, TokenizerConfig
from megalith.errors import MegalithError
from preprocessing.curate import CurateReport, curate_corpus, curated_data, describe
from preprocessing.prepare import PrepareReport, prepare_dataset
from preprocessing.stage import ensure_tokenizer
from preprocessing.tokenizer import load_tokenizer

# No Prefect cache on these two tasks: the stage is its own cache, and it looks at the data.
# ensure_tokenizer reuses a model whose record matches the inputs and settings, and
# prepare_dataset skips shards whose markers and sha256 still verify. A cache keyed on the
# parameters alone would report success after the shards were deleted or an input changed.


SAMPLE_TASKS = ["sample_facts"]  # the shipped evaluation task the end-to-end flow scores


def evaluation_task_files(tasks: list[str]) -> list[str]:
    """The files of evaluation tasks (shipped names such as ``sample_facts``, or paths) that
    curation decontaminates against; an lm-eval task of the hub has no file here, skipped."""
    files = []
    for name in tasks:
        with contextlib.suppress(TaskFileError):
            files.append(str(resolve_task_file(name)))
    return files


def retry_transient(task, task_run, state) -> bool:
    """Retry storage and network hiccups, never problems with the user's input."""
    error = state.result(raise_on_failure=False)
    return isinstance(error, OSError | ConnectionError) and not isinstance(error, MegalithError)


@task(
    name="curate-corpus",
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=retry_transient,
    cache_policy=NO_CACHE,
)
def curate_task(data: DataConfig, task_files: list[str]) -> dict:
    """Deduplicate, filter, decontaminate (against ``task_files`` too) and redact the corpus;
    reuses a finished curation of the same inputs and settings."""
    report = curate_corpus(data, task_files, show_progress=False)
    get_run_logger().info(describe(report))
    return curation_summary(report)


def curation_summary(report: CurateReport) -> dict:
    record = report.record
    return {
        "output": report.output,
        "reused": report.reused,
        "documents_in": record.documents_in,
        "documents_out": record.documents_out,
        "removed": record.removed.model_dump(),
        "changed": record.changed.model_dump(),
        "flagged": record.flagged.model_dump(),
        "rejected": record.rejected.total,
        "seconds": round(report.seconds, 2),
        **{key: round(value, 1) for key, value in report.rates().items()},
    }


def curate_before_tokenizing(
    data: DataConfig, task_files: list[str]
) -> tuple[DataConfig, dict | None]:
    """The data to tokenize and the curation's summary: the curated corpus when
    ``data.curate.enabled`` (text corpora; chat data is not curated), with its artifact
    published; else ``data`` unchanged and None."""
    if not data.curate.enabled or data.format != "pretrain":
        return data, None
    summary = curate_task(data, task_files)
    create_markdown_artifact(
        key="curation",
        markdown=curation_markdown(summary),
        description=f"Curated corpus at {summary['output']}",
    )
    return curated_data(data, summary["output"]), summary


def curation_markdown(summary: dict, sample: int = 3) -> str:
    """Counts by rule and, for each rule, a sample of the documents it removed or changed."""
    lines = [
        f"# Curated corpus at `{summary['output']}`",
        "",
        f"Kept **{summary['documents_out']:,}** of {summary['documents_in']:,} documents"
        + (" (reused: inputs and settings unchanged)." if summary["reused"] else "."),
        "",
        "| | rule | documents |",
        "|---|---|---|",
    ]
    for title in ("removed", "changed", "flagged"):
        for rule, count in summary[title]["counts"].items():
            lines.append(f"| {title} | {rule} | {count:,} |")
    for title in ("removed", "changed", "flagged"):
        examples = summary[title]["examples"]
        for rule in summary[title]["counts"]:
            shown = [e for e in examples if e["rule"] == rule][:sample]
            if not shown:
                continue
            lines += ["", f"## {title}: {rule}", "", "| document | why | text |", "|---|---|---|"]
            lines += [
                f"| `{e['location']}` | {_cell(e['detail'])} | {_cell(e['text'][:160])} |"
                for e in shown
            ]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ⏎ ")


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
    decontaminate: list[str] = SAMPLE_TASKS,  # noqa: B006 - a read-only form default
) -> dict:
    """Curate the corpus (``data.curate``; decontaminated against ``decontaminate``, the
    shipped evaluation task by default), train or load a tokenizer (SentencePiece or
    Hugging Face), then write Megatron shards and a manifest."""
    data, curation = curate_before_tokenizing(data, evaluation_task_files(decontaminate))
    model_path = train_tokenizer_task(data, tokenizer)
    summary = write_shards_task(data, tokenizer, model_path)
    create_markdown_artifact(
        key="shard-manifest",
        markdown=manifest_markdown(summary),
        description=f"Shard set written to {summary['output']}",
    )
    return {**summary, "curation": curation}
