"""Evaluation that cannot read training data, and per-item results users can compare.

A real tiny training run (``training.trainer.train``) writes a model package that
records its shard set (manifest sha256) and split; ``megalith eval`` runs as a
subprocess, as a user runs it, on the same shard set:

- no split given: the run's split is used; the documents scored are exactly the
  held-out (valid) documents of that split, none of the training ones;
- a different split given: refused, naming both splits, no report written;
- ``--allow-split-mismatch``: scored on the split asked for, with a warning;
- a package that records nothing (written before this): works, with a warning.

Per-item results: each document's tokens and nll add up to the perplexity's totals, and
each multiple-choice item's choice log-likelihoods and picks reproduce the accuracies.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evaluation.perplexity import held_out_data
from evaluation.report import evaluate_model
from evaluation.tasks import SAMPLE_TASK
from megalith.config import load_config
from megalith.errors import MegalithError
from preprocessing.tokenizer import load_tokenizer
from tests.parallel_helpers import RECIPE, tiny_settings, tiny_shard_set
from training.data import open_shard_set
from training.data.gpt_dataset import split_document_ranges
from training.models.package import (
    TrainingData,
    load_model_package,
    read_training_data,
    save_model_package,
)
from training.trainer import train

TRAIN_SPLIT = (0.99, 0.005, 0.005)  # its train split holds the default valid split
OTHER_SPLIT = (0.98, 0.01, 0.01)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_shard_set(tmp_path_factory)


@pytest.fixture(scope="module")
def package(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    settings = tiny_settings(shards, {"data.split": list(TRAIN_SPLIT), "training.train_iters": 2})
    config = load_config(RECIPE, [f"{key}={value}" for key, value in settings.items()])
    result = train(config, tmp_path_factory.mktemp("eval-split-run"), show_progress=False)
    assert result.model_package is not None
    return result.model_package


def megalith_eval(
    package: Path, shards: Path, report: Path, *extra: str
) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "pipelines.cli", "eval", "--model", str(package),
        "--data", str(shards), "--max-samples", "100000", "--batch-size", "64",
        "--max-new-tokens", "0", "--device", "cpu", "--output", str(report), *extra,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def held_out(shards: Path, split: tuple[float, float, float], name: str = "valid") -> range:
    documents = open_shard_set(str(shards)).num_documents
    return split_document_ranges(documents, split)[["train", "valid", "test"].index(name)]


def scored_documents(report: dict[str, Any]) -> set[int]:
    return {entry["document"] for entry in report["perplexity"]["documents"]}


def test_package_records_the_shard_set_and_split_it_trained_on(package: Path, shards: Path) -> None:
    record = read_training_data(package)
    manifest = (shards / "manifest.json").read_bytes()
    assert record is not None
    assert record.manifest_sha256 == (hashlib.sha256(manifest).hexdigest(),)
    assert record.split == TRAIN_SPLIT


def test_eval_scores_exactly_the_held_out_documents_of_the_training_split(
    package: Path, shards: Path, tmp_path: Path
) -> None:
    done = megalith_eval(package, shards, tmp_path / "report.json")
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert scored_documents(report) == set(held_out(shards, TRAIN_SPLIT))
    assert not scored_documents(report) & set(held_out(shards, TRAIN_SPLIT, "train"))
    # The default split (0.98/0.01/0.01) would have scored training documents.
    assert set(held_out(shards, OTHER_SPLIT)) & set(held_out(shards, TRAIN_SPLIT, "train"))


def test_eval_refuses_another_split_of_the_training_shard_set(
    package: Path, shards: Path, tmp_path: Path
) -> None:
    split = "data.split=[0.98,0.01,0.01]"
    done = megalith_eval(package, shards, tmp_path / "report.json", "--set", split)
    assert done.returncode == 1
    assert "[0.98, 0.01, 0.01]" in done.stderr and "[0.99, 0.005, 0.005]" in done.stderr
    assert "--allow-split-mismatch" in done.stderr
    assert not (tmp_path / "report.json").exists()


def test_allow_split_mismatch_scores_the_split_asked_for_with_a_warning(
    package: Path, shards: Path, tmp_path: Path
) -> None:
    split = "data.split=[0.98,0.01,0.01]"
    report_path = tmp_path / "report.json"
    done = megalith_eval(package, shards, report_path, "--set", split, "--allow-split-mismatch")
    assert done.returncode == 0, done.stderr
    assert "differs from the training split" in done.stderr
    report = json.loads(report_path.read_text())
    assert scored_documents(report) == set(held_out(shards, OTHER_SPLIT))


def test_package_without_a_record_is_evaluated_with_a_warning(
    package: Path, shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model, config, tokenizer = load_model_package(package)
    old = save_model_package(model, config, tokenizer, tmp_path / "old")
    assert read_training_data(old) is None
    data = load_config(None, ["data.seq_length=32"], {"data.output": str(shards)}).data
    report = evaluate_model(old, data, prompts=[], max_samples=4, device="cpu")
    assert "records no training data" in caplog.text
    assert scored_documents(report) <= set(held_out(shards, data.split))


def test_another_shard_set_keeps_its_split_with_a_warning(
    shards: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = load_config(None, ["data.seq_length=32"], {"data.output": str(shards)}).data
    elsewhere = TrainingData(("other/manifest.json",), ("0" * 64,), TRAIN_SPLIT, 1)
    assert held_out_data(data, elsewhere).split == data.split
    assert "not a shard set the model trained on" in caplog.text


def test_per_document_results_add_up_to_the_perplexity(
    package: Path, shards: Path, tmp_path: Path
) -> None:
    data = load_config(None, ["data.seq_length=32"], {"data.output": str(shards)}).data
    report = evaluate_model(package, data, prompts=[], max_samples=40, device="cpu")
    ppl = report["perplexity"]
    documents = ppl["documents"]
    assert all(entry["shard_set"] == str(shards) and entry["tokens"] > 0 for entry in documents)
    assert sum(entry["tokens"] for entry in documents) == ppl["tokens"] == 40 * 32
    nll = sum(entry["nll"] for entry in documents)
    assert nll / ppl["tokens"] == pytest.approx(ppl["loss"], rel=1e-9)


def test_per_item_choice_scores_reproduce_the_task_accuracies(package: Path) -> None:
    report = evaluate_model(package, None, [str(SAMPLE_TASK)], prompts=[], device="cpu")
    task = report["tasks"]["sample_facts"]
    items = task["per_item"]
    assert len(items) == task["items"]
    for item in items:
        logliks = [choice["loglik"] for choice in item["choices"]]
        assert item["pick"]["acc"] == logliks.index(max(logliks))
        per_char = [choice["loglik"] / choice["chars"] for choice in item["choices"]]
        assert item["pick"]["acc_norm"] == per_char.index(max(per_char))
    for key in ("acc", "acc_norm", "acc_per_token"):
        correct = sum(item["pick"][key] == item["answer"] for item in items)
        assert task[key] == pytest.approx(correct / len(items))
    # Each choice's loglik is the model's: the first item's first choice, rescored by hand.
    tokenizer = load_tokenizer(str(package / "tokenizer.model"))
    model, _, _ = load_model_package(package)
    first = json.loads(SAMPLE_TASK.read_text().splitlines()[0])
    context = [tokenizer.eod_id, *tokenizer.encode(first["context"])]
    whole = [tokenizer.eod_id, *tokenizer.encode(first["context"] + first["choices"][0])]
    assert whole[: len(context)] == context, "the choice starts at a token boundary"
    tokens = torch.tensor([whole])
    with torch.no_grad():
        logprobs = model(tokens[:, :-1]).double().log_softmax(-1)[0]
    n = len(whole) - len(context)
    expected = sum(logprobs[len(context) - 1 + i, whole[len(context) + i]] for i in range(n))
    assert items[0]["choices"][0]["loglik"] == pytest.approx(float(expected), abs=1e-4)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
RECORDS = st.fixed_dictionaries(
    {},
    optional={
        "manifests": JSON_VALUES,
        "manifest_sha256": JSON_VALUES,
        "split": JSON_VALUES | st.lists(st.floats(), min_size=3, max_size=3),
        "seed": JSON_VALUES,
    },
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(record=RECORDS | JSON_VALUES)
def test_a_damaged_training_data_record_is_refused_in_one_line(
    package: Path, tmp_path: Path, record: Any
) -> None:
    copy = tmp_path / "pkg"
    if not copy.exists():
        copy.mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.model", "checksums.json"):
            (copy / name).write_bytes((package / name).read_bytes())
    meta = json.loads((package / "config.json").read_text())
    meta["training_data"] = record
    (copy / "config.json").write_text(json.dumps(meta))
    try:
        result = read_training_data(copy)
    except MegalithError as exc:
        assert "training_data" in str(exc)
        return
    assert isinstance(result, TrainingData) or (result is None and record is None)
