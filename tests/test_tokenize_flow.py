"""The ``tokenize-corpus`` Prefect flow against a real (temporary) Prefect API."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from uuid import UUID

import pytest

from megalith.config import DataConfig, TokenizerConfig
from preprocessing import corpus_generator
from preprocessing.manifest import read_manifest
from preprocessing.readers import InputError
from preprocessing.verify import verify_shard_set

prefect = pytest.importorskip("prefect")

from prefect.client.orchestration import get_client  # noqa: E402
from prefect.client.schemas.filters import (  # noqa: E402
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    ArtifactFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
)

from pipelines.tokenize import tokenize_corpus  # noqa: E402

CORPUS = Path(corpus_generator.__file__).parent / "sample_corpus" / "stories.jsonl"
DOCUMENTS = 300


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """Sample documents plus one record whose text is not a string (line 5)."""
    lines = CORPUS.read_text(encoding="utf-8").splitlines()[:DOCUMENTS]
    texts = [json.loads(line)["text"] for line in lines]
    lines.insert(4, '{"text": ["a", "list"]}')
    path = tmp_path_factory.mktemp("flow") / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path, texts


def run_flow(data: DataConfig, tokenizer: TokenizerConfig):
    """Run the flow; return its final state (the summary is the state's result)."""
    return tokenize_corpus(data=data, tokenizer=tokenizer, return_state=True)


def shard_manifest_artifacts(flow_run_id: UUID) -> list:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["shard-manifest"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
            )
        )


def task_runs_of(flow_run_id: UUID) -> dict[str, object]:
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return {run.name.rsplit("-", 1)[0]: run for run in runs}


@pytest.fixture(scope="module")
def flow_settings(corpus, tmp_path_factory) -> tuple[DataConfig, TokenizerConfig]:
    path, _ = corpus
    data = DataConfig(
        inputs=[str(path)],
        output=str(tmp_path_factory.mktemp("flow-out") / "shards"),
        shards=2,
        workers=1,
        on_bad_record="skip",
    )
    return data, TokenizerConfig(vocab_size=512)


@pytest.fixture(scope="module")
def first_run(prefect_api, flow_settings):
    state = run_flow(*flow_settings)
    assert state.is_completed(), state.message
    return state


def test_flow_returns_the_manifest_summary(first_run, flow_settings, corpus) -> None:
    data, _ = flow_settings
    summary = first_run.result()
    manifest = read_manifest(data.output)
    model = Path(data.output) / "tokenizer.model"
    assert summary["output"] == data.output
    assert summary["tokenizer_id"] == manifest.tokenizer.id
    assert summary["tokenizer_id"] == hashlib.sha256(model.read_bytes()).hexdigest()
    # Curated first (on by default): what it removed is counted, the rest tokenized.
    curation = summary["curation"]
    assert curation["documents_in"] == DOCUMENTS == manifest.curation.documents_in
    assert curation["removed"]["total"] > 0
    kept = DOCUMENTS - curation["removed"]["total"]
    assert summary["documents"] == manifest.documents == curation["documents_out"] == kept
    assert summary["tokens"] == manifest.tokens > DOCUMENTS
    assert summary["shards"] == 2
    assert summary["written"] == ["shard-00000", "shard-00001"]
    assert summary["skipped"] == []
    assert summary["rejected"]["counts"] == {"not_a_string": 1}
    assert summary["rejected"]["examples"][0]["location"] == f"{corpus[0]}:5"
    assert summary["documents_per_s"] > 0 and summary["tokens_per_s"] > 0
    assert manifest.tokenizer.vocab_size == 512


def test_flow_publishes_the_manifest_artifact(first_run) -> None:
    flow_run_id = first_run.state_details.flow_run_id
    artifacts = shard_manifest_artifacts(flow_run_id)
    assert len(artifacts) == 1
    artifact = artifacts[0]
    assert artifact.type == "markdown"
    summary = first_run.result()
    markdown = artifact.data
    assert f"# Shards at `{summary['output']}`" in markdown
    assert f"| tokenizer id | `{summary['tokenizer_id'][:16]}…` |" in markdown
    assert f"| documents | {summary['documents']:,} |" in markdown
    assert f"| tokens | {summary['tokens']:,} |" in markdown
    assert "| shards | 2 (2 written, 0 reused) |" in markdown
    assert "| rejected records | 1 |" in markdown
    assert "| not_a_string | 1 |" in markdown


def test_flow_publishes_the_curation_artifact(first_run) -> None:
    with get_client(sync_client=True) as client:
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=["curation"]),
                flow_run_id=ArtifactFilterFlowRunId(any_=[first_run.state_details.flow_run_id]),
            )
        )
    curation = first_run.result()["curation"]
    for rule, count in curation["removed"]["counts"].items():
        assert f"| removed | {rule} | {count:,} |" in artifact.data
        assert f"## removed: {rule}" in artifact.data  # a sample of what it removed


def test_flow_runs_every_stage_as_a_task(first_run) -> None:
    runs = task_runs_of(first_run.state_details.flow_run_id)
    assert set(runs) == {"curate-corpus", "train-tokenizer", "write-shards"}
    assert all(run.state.is_completed() for run in runs.values())


def test_second_run_reuses_tokenizer_and_shards(first_run, flow_settings) -> None:
    data, _ = flow_settings
    model = Path(data.output) / "tokenizer.model"
    trained_at = model.stat().st_mtime_ns
    state = run_flow(*flow_settings)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["skipped"] == ["shard-00000", "shard-00001"]
    assert summary["written"] == []
    assert summary["tokenizer_id"] == first_run.result()["tokenizer_id"]
    assert summary["documents"] == first_run.result()["documents"]
    assert summary["curation"]["reused"]
    assert model.stat().st_mtime_ns == trained_at  # not trained again
    (artifact,) = shard_manifest_artifacts(state.state_details.flow_run_id)
    assert "| shards | 2 (0 written, 2 reused) |" in artifact.data


def test_rerun_after_the_shards_were_deleted_writes_them_again(
    prefect_api, corpus, tmp_path: Path
) -> None:
    """The flow must look at the data, not only at its parameters: gone shards come back."""
    path, texts = corpus
    data = DataConfig(
        inputs=[str(path)], output=str(tmp_path / "shards"), workers=1, on_bad_record="skip"
    )
    settings = TokenizerConfig(vocab_size=512)
    first = run_flow(data, settings)
    assert first.is_completed(), first.message
    shutil.rmtree(tmp_path / "shards")
    second = run_flow(data, settings)
    assert second.is_completed(), second.message
    summary = second.result()
    assert summary["written"] == ["shard-00000"] and summary["skipped"] == []
    assert read_manifest(data.output).documents == summary["curation"]["documents_out"]
    assert summary["curation"]["documents_in"] == len(texts)
    assert verify_shard_set(data.output) == []


def test_bad_input_fails_the_flow_without_retries(prefect_api, tmp_path: Path) -> None:
    missing = tmp_path / "absent.jsonl"
    data = DataConfig(inputs=[str(missing)], output=str(tmp_path / "out"), workers=1)
    state = run_flow(data, TokenizerConfig(vocab_size=512))
    assert state.is_failed()
    with pytest.raises(InputError, match=f"{missing}: no such file or directory"):
        state.result()
    runs = task_runs_of(state.state_details.flow_run_id)
    # A user's mistake is not retried (the task allows 2 retries for storage hiccups).
    assert runs["curate-corpus"].run_count == 1
    assert runs["curate-corpus"].state.is_failed()
    assert "train-tokenizer" not in runs and "write-shards" not in runs
    assert not (tmp_path / "out").exists()


def test_flow_parameters_are_the_typed_config() -> None:
    """The Prefect UI renders the parameters as a form built from the config classes."""
    schema = tokenize_corpus.parameters.model_dump()
    assert schema["required"] == ["data"]
    definitions = schema["definitions"]
    data_fields = definitions["DataConfig"]["properties"]
    assert {"inputs", "output", "shards", "workers", "on_bad_record", "json_key"} <= set(
        data_fields
    )
    assert definitions["TokenizerConfig"]["properties"]["model_type"]["enum"] == [
        "bpe",
        "unigram",
        "byte_bpe",
    ]
    assert definitions["DataConfig"]["additionalProperties"] is False
