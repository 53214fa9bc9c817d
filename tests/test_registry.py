"""MLflow tracking and registry against a real SQLite store (one per module: MLflow is slow to start)."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from mlflow import MlflowClient

from megalith.config import LoggingConfig, MegalithConfig, ModelConfig
from registry.models import register_model, set_alias
from tests.servers import free_port
from training.inference.loading import load_served_model
from training.metrics.run_logger import NullLogger
from training.mlflow_store import runs as tracking
from training.mlflow_store.registered import (
    MLFLOW_FILES,
    MLFLOW_FILES_TAG,
    RegistryError,
    get_alias_version,
    load_registered_model,
    model_version_tags,
    verify_package,
)
from training.mlflow_store.runs import (
    MAX_PARAM_VALUE_LENGTH,
    MLflowRunLogger,
    ensure_tracking_store,
    flatten_params,
    lineage_tags,
    open_run_logger,
    resolve_tracking_uri,
)
from training.models.gpt import GPTModel
from training.models.package import load_model_package, save_model_package

MODEL_NAME = "megalith-test"
PACKAGE_FILES = ("model.safetensors", "config.json", "tokenizer.model")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as env:
        for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI", "MLFLOW_RUN_ID"):
            env.delenv(name, raising=False)
        ensure_tracking_store(uri)
        yield uri


@pytest.fixture
def client(store: str) -> MlflowClient:
    return MlflowClient(tracking_uri=store)


def make_package(directory: Path, seed: int) -> Path:
    """A real model package of a tiny GPT (the tokenizer file is stand-in bytes)."""
    config = ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=64,
        max_position_embeddings=16,
    )
    torch.manual_seed(seed)
    model = GPTModel(config)
    tokenizer = directory.with_name(f"{directory.name}.tokenizer.model")
    tokenizer.write_bytes(bytes([seed]) * 64)
    return save_model_package(model, model.config, tokenizer, directory)


def flip_last_byte(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(directory: Path) -> Path:
    directory.mkdir(parents=True)
    path = directory / "manifest.json"
    path.write_text(json.dumps({"tokenizer": {"id": "ab" * 32}, "shards": []}))
    return path


def our_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "training.mlflow_store.runs" and r.levelno == logging.WARNING
    ]


# --- Tracking ------------------------------------------------------------------------


def test_run_holds_params_metrics_tags_and_artifacts(
    store: str, client: MlflowClient, tmp_path: Path
) -> None:
    config = MegalithConfig(logging=LoggingConfig(tracking_uri=store, experiment="tracking"))
    logger = open_run_logger(config.logging, "job-1", rank=0)
    assert isinstance(logger, MLflowRunLogger)
    manifest = write_manifest(tmp_path / "data")
    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"perplexity": 9.5}))

    params = config.model_dump(mode="json")
    params["note"] = "x" * (MAX_PARAM_VALUE_LENGTH + 100)
    logger.log_params(params)
    logger.set_tags(lineage_tags([str(tmp_path / "data")]))
    for step in range(1, 11):
        logger.log_metrics({"loss": 10.0 / step, "lr": 1e-3, "phase": "train"}, step)  # type: ignore[dict-item]
    logger.log_artifact(str(report), "eval")
    logger.close()

    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "job-1"
    assert run.data.params["model.hidden_size"] == str(config.model.hidden_size)
    assert run.data.params["logging.experiment"] == "tracking"
    assert len(run.data.params["note"]) == MAX_PARAM_VALUE_LENGTH
    assert run.data.tags["megalith.data.manifest_sha256"] == sha256(manifest)
    assert run.data.tags["megalith.tokenizer.id"] == "ab" * 32
    assert run.data.tags["megalith.code.version"]
    history = client.get_metric_history(logger.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, 10.0 / s) for s in range(1, 11)]
    assert "phase" not in run.data.metrics
    assert [a.path for a in client.list_artifacts(logger.run_id, "eval")] == ["eval/eval.json"]
    # Artifacts of a SQLite store live beside the database, not in the working directory.
    db_dir = Path(store.removeprefix("sqlite:///")).parent
    assert run.info.artifact_uri.startswith((db_dir / "mlartifacts").as_uri())


def test_handed_over_run_is_shared_and_left_open(
    store: str, client: MlflowClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = MLflowRunLogger.start(store, experiment="tracking", run_name="flow")
    parent.log_params({"flow": {"stage": "pretrain"}})
    assert parent.flush()
    monkeypatch.setenv("MLFLOW_RUN_ID", parent.run_id)

    child = open_run_logger(LoggingConfig(tracking_uri=store), "ignored", rank=0)
    assert isinstance(child, MLflowRunLogger) and child.run_id == parent.run_id
    child.log_params({"flow": {"stage": "changed"}, "train": {"steps": 3}})
    child.log_metrics({"loss": 1.0}, step=1)
    child.close()
    assert client.get_run(parent.run_id).info.status == "RUNNING"

    parent.close()
    run = client.get_run(parent.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"flow.stage": "pretrain", "train.steps": "3"}
    assert run.data.metrics == {"loss": 1.0}


def test_only_rank_zero_logs_and_only_when_enabled(store: str) -> None:
    assert isinstance(open_run_logger(LoggingConfig(tracking_uri=store), "r", rank=1), NullLogger)
    disabled = LoggingConfig(mlflow=False, tracking_uri=store)
    assert isinstance(open_run_logger(disabled, "r", rank=0), NullLogger)


def test_unreachable_server_warns_once_and_training_goes_on(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = LoggingConfig(tracking_uri=f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        logger = open_run_logger(config, "offline", rank=0)
        logger.log_params({"a": 1})
        for step in range(100):
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step)
        logger.set_tags({"k": "v"})
        logger.close()
    assert time.monotonic() - started < 15
    assert len(our_warnings(caplog)) == 1
    assert "unavailable" in our_warnings(caplog)[0].getMessage()


def test_a_store_failing_mid_run_warns_once_keeps_the_records_and_sends_them_later(
    store: str, client: MlflowClient, caplog: pytest.LogCaptureFixture
) -> None:
    logger = open_run_logger(LoggingConfig(tracking_uri=store), "flaky", rank=0)
    assert isinstance(logger, MLflowRunLogger)
    log_batch, calls, down = logger.client.log_batch, [], [True]

    def flaky_log_batch(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        if down[0]:
            raise ConnectionError("tracking server went away")
        log_batch(*args, **kwargs)

    logger.client.log_batch = flaky_log_batch  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        for step in range(50):
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step)
            time.sleep(0.001)
        logger.log_params({"late": 1})
        assert not logger.flush(timeout=10)  # kept, not sent
        down[0] = False
        logger.close()
    assert not logger.failed
    warnings = [w.getMessage() for w in our_warnings(caplog)]
    assert len(warnings) == 2, warnings
    assert "went away" in warnings[0] and "answers again" in warnings[1]
    history = client.get_metric_history(logger.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(50))
    run = client.get_run(logger.run_id)
    assert run.data.params["late"] == "1"
    assert run.info.status == "FINISHED"


def test_the_kept_records_are_bounded_and_the_overflow_is_said_once(
    store: str,
    client: MlflowClient,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracking, "MAX_BACKLOG_METRICS", 10)
    logger = open_run_logger(LoggingConfig(tracking_uri=store), "bounded", rank=0)
    assert isinstance(logger, MLflowRunLogger)
    log_batch, down = logger.client.log_batch, [True]

    def flaky_log_batch(*args: Any, **kwargs: Any) -> None:
        if down[0]:
            raise ConnectionError("tracking server went away")
        log_batch(*args, **kwargs)

    logger.client.log_batch = flaky_log_batch  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        logger.log_metrics({"loss": 1.0}, step=0)
        assert not logger.flush(timeout=10)  # down: kept
        for step in range(1, 30):
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step)
        logger.flush(timeout=10)
        down[0] = False
        logger.close()
    warnings = [w.getMessage() for w in our_warnings(caplog)]
    assert sum("later ones are not kept" in w for w in warnings) == 1, warnings
    steps = sorted(m.step for m in client.get_metric_history(logger.run_id, "loss"))
    assert steps == list(range(10))  # the first ten kept, in order; the rest dropped
    assert client.get_run(logger.run_id).info.status == "FINISHED"


def test_loss_curve_is_logged_as_png(store: str, client: MlflowClient, tmp_path: Path) -> None:
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    records = [{"step": s, "loss": 5.0 / s, "lr": 1e-3} for s in range(1, 21)]
    records[9]["val_loss"] = 0.9
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))

    logger = MLflowRunLogger.start(store, experiment="tracking", system_metrics=False)
    png = logger.log_loss_curve(metrics)
    logger.close()

    assert png == metrics.with_name("loss_curve.png")
    assert [a.path for a in client.list_artifacts(logger.run_id, "plots")] == [
        "plots/loss_curve.png"
    ]
    stored = Path(client.download_artifacts(logger.run_id, "plots/loss_curve.png", str(tmp_path)))
    assert stored.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_flatten_params_dotted_keys_and_json_values() -> None:
    flat = flatten_params(
        {
            "model": {"hidden": 8, "bias": None},
            "blend": [{"path": "a", "weight": 1.0}],
            "ids": [1, 2],
        }
    )
    assert flat == {
        "model.hidden": "8",
        "model.bias": "null",
        "blend.0.path": "a",
        "blend.0.weight": "1.0",
        "ids": "[1, 2]",
    }


def test_tracking_uri_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_tracking_uri(None, tmp_path) == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert resolve_tracking_uri("http://server:5000", tmp_path) == "http://server:5000"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert resolve_tracking_uri("http://server:5000", tmp_path) == "http://env:5000"


# --- Registry ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registered(store: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two training runs, each registering its package: versions 1 and 2."""
    root = tmp_path_factory.mktemp("packages")
    packages, runs, aliases_after_first = [], [], None
    for index in (1, 2):
        logger = MLflowRunLogger.start(
            store, experiment="registry", tags={"megalith.data.manifest_sha256": f"data{index}"}
        )
        logger.close()
        package = make_package(root / f"package-{index}", seed=index)
        version = register_model(
            package,
            MODEL_NAME,
            logger.run_id,
            {"perplexity": 10.0 / index, "tasks": {"facts": {"accuracy": 0.25 * index}}},
            tracking_uri=store,
        )
        assert version == index
        if index == 1:
            aliases_after_first = get_alias_version(MODEL_NAME, "candidate", tracking_uri=store)
        packages.append(package)
        runs.append(logger.run_id)
    return {"packages": packages, "runs": runs, "candidate_after_first": aliases_after_first}


def test_registration_versions_alias_and_tags(
    store: str, client: MlflowClient, registered: dict[str, Any]
) -> None:
    assert registered["candidate_after_first"] == 1
    assert get_alias_version(MODEL_NAME, "candidate", tracking_uri=store) == 2
    assert get_alias_version(MODEL_NAME, "champion", tracking_uri=store) is None
    assert get_alias_version("no-such-model", "candidate", tracking_uri=store) is None

    tags = model_version_tags(MODEL_NAME, 1, tracking_uri=store)
    assert tags["eval.perplexity"] == "10.0"
    assert tags["eval.tasks.facts.accuracy"] == "0.25"
    assert tags["megalith.data.manifest_sha256"] == "data1"
    package = registered["packages"][0]
    assert tags["megalith.tokenizer.id"] == sha256(package / "tokenizer.model")
    assert tags["megalith.package.checksums_sha256"] == sha256(package / "checksums.json")

    version = client.get_model_version(MODEL_NAME, "2")
    assert version.run_id == registered["runs"][1]
    assert version.source == client.get_run(version.run_id).info.artifact_uri + "/model"

    set_alias(MODEL_NAME, "champion", 1, tracking_uri=store)
    assert get_alias_version(MODEL_NAME, "champion", tracking_uri=store) == 1
    assert get_alias_version(MODEL_NAME, "candidate", tracking_uri=store) == 2


@pytest.mark.parametrize(
    ("uri", "index"), [(f"models:/{MODEL_NAME}@candidate", 1), (f"models:/{MODEL_NAME}/1", 0)]
)
def test_load_back_gives_identical_files(
    store: str, registered: dict[str, Any], tmp_path: Path, uri: str, index: int
) -> None:
    local = load_registered_model(uri, tmp_path / "download", tracking_uri=store)
    original = registered["packages"][index]
    for name in (*PACKAGE_FILES, "checksums.json"):
        assert sha256(local / name) == sha256(original / name)
    # MLflow's metadata: a pyfunc served by our own loader module, nothing pickled.
    mlmodel = yaml.safe_load((local / "MLmodel").read_text())
    assert mlmodel["flavors"]["python_function"]["loader_module"] == "registry.mlflow_pyfunc"
    assert mlmodel["run_id"] == registered["runs"][index]
    assert not [p for p in local.iterdir() if p.suffix in {".pkl", ".pickle", ".pt", ".bin"}]
    # The model loader reads the download as it reads the original.
    model, _, tokenizer = load_model_package(local)
    reference, _, _ = load_model_package(original)
    tokens = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        assert torch.equal(model(tokens), reference(tokens))
    assert tokenizer == local / "tokenizer.model"


def test_tampered_files_are_refused(
    store: str, client: MlflowClient, registered: dict[str, Any], tmp_path: Path
) -> None:
    local = load_registered_model(f"models:/{MODEL_NAME}/2", tmp_path / "copy", tracking_uri=store)
    flip_last_byte(local / "config.json")
    with pytest.raises(RegistryError, match="config.json: sha256 does not match"):
        verify_package(local, allowed_extra=MLFLOW_FILES)
    (local / "config.json").unlink()
    with pytest.raises(RegistryError, match="config.json: listed in checksums.json but missing"):
        verify_package(local, allowed_extra=MLFLOW_FILES)
    with pytest.raises(RegistryError, match=r"not listed in checksums.json: \['MLmodel'"):
        verify_package(local)

    # A file altered in the artifact store itself is refused on download.
    source = client.get_model_version(MODEL_NAME, "2").source
    stored = Path(source.removeprefix("file://")) / "model.safetensors"
    original = stored.read_bytes()
    try:
        flip_last_byte(stored)
        with pytest.raises(RegistryError, match="model.safetensors: sha256 does not match"):
            load_registered_model(
                f"models:/{MODEL_NAME}@candidate", tmp_path / "bad", tracking_uri=store
            )
        (stored.parent / "extra.pkl").write_bytes(b"not ours")
        stored.write_bytes(original)
        with pytest.raises(RegistryError, match="not listed in checksums.json"):
            load_registered_model(f"models:/{MODEL_NAME}/2", tmp_path / "extra", tracking_uri=store)
    finally:
        stored.write_bytes(original)
        (stored.parent / "extra.pkl").unlink(missing_ok=True)


@pytest.mark.parametrize(
    ("name", "old", "new"),
    [
        ("MLmodel", "loader_module: registry.mlflow_pyfunc", "loader_module: os"),
        ("requirements.txt", "mlflow==", "evil-mlflow=="),
        ("checksums.json", "{", "{ "),
    ],
)
def test_files_outside_the_package_checksums_changed_after_registration_are_refused(
    store: str, client: MlflowClient, registered: dict[str, Any], tmp_path: Path,
    name: str, old: str, new: str,
) -> None:  # fmt: skip
    """MLflow's own files (the MLmodel naming the loader module MLflow imports) and
    checksums.json itself are pinned by the version's tags: rewriting one in the
    artifact store is refused by loading and by serving, naming the file."""
    recorded = json.loads(model_version_tags(MODEL_NAME, 1, tracking_uri=store)[MLFLOW_FILES_TAG])
    assert set(recorded) == MLFLOW_FILES
    source = client.get_model_version(MODEL_NAME, "1").source
    stored = Path(source.removeprefix("file://")) / name
    original = stored.read_text()
    assert old in original
    try:
        stored.write_text(original.replace(old, new, 1))
        with pytest.raises(RegistryError, match=rf"{name}: sha256 differs from the one recorded"):
            load_registered_model(f"models:/{MODEL_NAME}/1", tmp_path / "a", tracking_uri=store)
        with pytest.raises(RegistryError, match=rf"{name}: sha256 differs"):
            load_served_model(f"models:/{MODEL_NAME}/1", tracking_uri=store)
    finally:
        stored.write_text(original)
    load_registered_model(f"models:/{MODEL_NAME}/1", tmp_path / "b", tracking_uri=store)


def test_run_with_a_different_model_is_not_overwritten(
    store: str, registered: dict[str, Any], tmp_path: Path
) -> None:
    other = make_package(tmp_path / "other", seed=99)
    with pytest.raises(RegistryError, match="already holds a different model"):
        register_model(other, MODEL_NAME, registered["runs"][0], {}, tracking_uri=store)


def test_bad_model_uris_are_refused(store: str) -> None:
    with pytest.raises(RegistryError, match="expected models:/NAME@ALIAS"):
        load_registered_model("runs:/abc/model", tracking_uri=store)
    with pytest.raises(RegistryError, match="has no alias 'gone'"):
        load_registered_model(f"models:/{MODEL_NAME}@gone", tracking_uri=store)
    with pytest.raises(RegistryError, match="no such model version"):
        load_registered_model(f"models:/{MODEL_NAME}/99", tracking_uri=store)
