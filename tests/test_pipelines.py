"""The ``end-to-end`` flow (tokenize → pretrain → evaluate → register) through Prefect's
test harness, with a real MLflow SQLite store; then the registered model is loaded
back from the registry and generates text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalith.config import load_config
from pipelines.recipes import DEMO_RECIPE, sample_corpus
from preprocessing.tokenizer import load_tokenizer
from training.inference.decode import SamplingConfig, generate
from training.mlflow_store.registered import load_registered_model
from training.models.package import load_model_package

pytestmark = pytest.mark.slow

DOCUMENTS = 400
MODEL_NAME = "e2e-test-model"


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    from training.mlflow_store.runs import ensure_tracking_store

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    ensure_tracking_store(uri)
    return uri


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("e2e")
    lines = sample_corpus().read_text().splitlines()[:DOCUMENTS]
    (root / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    return root


# The demo recipe shrunk to a few seconds of training (also used by test_user_journey.py).
TINY_DEMO = [
    "tokenizer.vocab_size=512",
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "model.vocab_size=null",
    "model.max_position_embeddings=null",
    "data.seq_length=64",
    "data.workers=1",
    "training.train_iters=6",
    "training.eval_interval=3",
    "training.eval_iters=1",
    "training.log_interval=1",
    "checkpoint.interval=0",
]


@pytest.fixture(scope="module")
def config(workdir: Path):
    return load_config(
        DEMO_RECIPE,
        [
            *TINY_DEMO,
            f"logging.registered_model={MODEL_NAME}",
        ],
        {"data.inputs": [str(workdir / "corpus.jsonl")], "data.output": str(workdir / "shards")},
    )


# What a user types in the flow's form: the shipped lm-eval task (local data, no hub).
LM_EVAL_TASKS = ["sample_facts"]


@pytest.fixture(scope="module")
def first_run(prefect_api, tracking_uri: str, workdir: Path, config) -> dict:
    from pipelines.flows import end_to_end

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        return end_to_end(config, str(workdir), lm_eval_tasks=LM_EVAL_TASKS)


def test_every_stage_ran_and_reported(first_run: dict, workdir: Path) -> None:
    curation = first_run["curation"]  # on by default, before tokenizing
    assert curation["documents_in"] == DOCUMENTS
    assert first_run["shards"]["documents"] == curation["documents_out"]
    assert curation["documents_out"] == DOCUMENTS - curation["removed"]["total"]
    training = first_run["training"]
    assert training["steps"] == 6
    metrics = [
        json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    evaluation = first_run["evaluation"]["metrics"]
    assert evaluation["valid_perplexity"] > 1.0
    assert 0.0 <= evaluation["sample_facts_acc"] <= 1.0
    assert first_run["registration"]["version"] == 1


def test_mlflow_holds_the_run_and_the_candidate(first_run: dict, tracking_uri: str) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    run_id = first_run["training"]["mlflow_run_id"]
    run = client.get_run(run_id)
    assert run.data.params["training.train_iters"] == "6"
    assert len(client.get_metric_history(run_id, "loss")) == 6
    assert "eval.valid_perplexity" in run.data.metrics
    # The flow's lm_eval_tasks ran through lm-eval; its metrics reached the run.
    lm_acc = first_run["evaluation"]["metrics"]["lm_eval.sample_facts.acc"]
    assert run.data.metrics["eval.lm_eval.sample_facts.acc"] == pytest.approx(lm_acc)
    report = json.loads(Path(first_run["evaluation"]["report"]).read_text())
    assert report["lm_eval"]["samples"]["sample_facts"], "lm-eval scored no item"
    assert run.data.tags["megalith.tokenizer.id"] == first_run["shards"]["tokenizer_id"]
    # The curation is the dataset's lineage: counts by rule and its config.
    curation = first_run["curation"]
    assert run.data.tags["megalith.data.curation.documents_in"] == str(DOCUMENTS)
    for rule, count in curation["removed"]["counts"].items():
        assert run.data.tags[f"megalith.data.curation.removed.{rule}"] == str(count)
    curate_config = json.loads(run.data.tags["megalith.data.curation.config"])
    assert curate_config["near_dedup"]["num_perm"] == 128
    assert run.data.params["data.curate.quality.min_words"] == "50"
    version = client.get_model_version_by_alias(MODEL_NAME, "candidate")
    assert int(version.version) == 1
    assert float(version.tags["eval.valid_perplexity"]) == pytest.approx(
        first_run["evaluation"]["metrics"]["valid_perplexity"]
    )
    assert float(version.tags["eval.lm_eval.sample_facts.acc"]) == pytest.approx(lm_acc)


def test_the_flow_published_its_artifacts(first_run: dict) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    keys = ["curation", "shard-manifest", "training-summary", "evaluation", "registered-model"]
    with get_client(sync_client=True) as client:
        for key in keys:
            found = client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
            )
            assert found, f"artifact {key} missing"
    package = first_run["training"]["model_package"]
    summary = client_markdown(keys[2], containing=f"`{package}`")
    assert f"| steps | {first_run['training']['steps']} |" in summary


def client_markdown(key: str, containing: str) -> str:
    """The markdown of the artifact `key` that mentions `containing`.

    Other tests in the session publish artifacts under the same keys to the same
    Prefect API, so the newest one need not be this run's.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    matching = [a.data for a in artifacts if containing in (a.data or "")]
    assert matching, f"no {key} artifact mentions {containing}"
    return matching[-1]


def test_rerun_skips_evaluation_and_registration(
    first_run: dict, tracking_uri: str, workdir: Path, config
) -> None:
    from mlflow import MlflowClient

    from pipelines.flows import end_to_end

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", tracking_uri)
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("HF_HUB_OFFLINE", "1")
        again = end_to_end(config, str(workdir), lm_eval_tasks=LM_EVAL_TASKS)
    assert again["shards"]["skipped"], "the shards should have been reused"
    assert again["curation"]["reused"]
    assert again["training"]["package_id"] == first_run["training"]["package_id"]
    assert again["registration"]["version"] == 1
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    assert len(client.search_model_versions(f"name='{MODEL_NAME}'")) == 1


def test_registered_model_loads_back_and_generates(
    first_run: dict, tracking_uri: str, tmp_path: Path
) -> None:
    from preprocessing.tokenizer import load_tokenizer
    from training.inference.decode import SamplingConfig, generate
    from training.mlflow_store.registered import load_registered_model
    from training.models.package import load_model_package

    package = load_registered_model(
        f"models:/{MODEL_NAME}@candidate", tmp_path, tracking_uri=tracking_uri
    )
    model, _, tokenizer_path = load_model_package(package)
    tokenizer = load_tokenizer(str(tokenizer_path))
    result = generate(
        model, tokenizer, ["Once upon a time"], SamplingConfig(max_new_tokens=12, temperature=0.0)
    )
    generation = result.generations[0]
    assert generation.new_tokens > 0
    assert isinstance(generation.text, str) and generation.text


def test_serve_pipelines_offers_every_flow_with_form_defaults(tmp_path: Path) -> None:
    from pipelines.deployments import deployments

    served = {d.name: d for d in deployments(tmp_path)}
    assert set(served) == {
        "tokenize-corpus",
        "pretrain",
        "evaluate",
        "register-model",
        "promote-model",
        "end-to-end",
        "finetune",
        "cluster-train",
    }
    assert served["finetune"].schedules, "the finetune deployment runs on a schedule"
    end_to_end = served["end-to-end"]
    assert end_to_end.parameters["workdir"] == str(tmp_path)
    assert end_to_end.parameters["config"]["model"]["num_layers"] >= 1
    from prefect.utilities.callables import parameter_schema

    from pipelines.flows import end_to_end as flow

    schema = parameter_schema(flow).model_dump()
    assert schema["properties"]["config"]["$ref"].endswith("MegalithConfig")
    assert "ModelConfig" in schema["definitions"]  # the UI renders each section as a form
    from pipelines.flows import evaluate

    for with_lm_eval in (flow, evaluate):  # a list-of-strings field, empty by default
        field = parameter_schema(with_lm_eval).model_dump()["properties"]["lm_eval_tasks"]
        assert (field["type"], field["items"], field["default"]) == (
            "array",
            {"type": "string"},
            [],
        )


def test_the_first_demo_on_a_fresh_prefect_home_prints_no_error(tmp_path: Path) -> None:
    """`megalith demo` as a new user first runs it: no Prefect server, a new PREFECT_HOME
    (so Prefect's temporary server creates its database), no MLflow settings. The run
    must look as clean as it is: no traceback, no "database is locked", no ERROR line."""
    import os
    import sys

    from tests.servers import run_group

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update({"PREFECT_HOME": str(tmp_path / "prefect-home"), "OMP_NUM_THREADS": "1"})
    overrides = [arg for setting in TINY_DEMO for arg in ("--set", setting)]
    command = [sys.executable, "-m", "pipelines.cli", "demo", "--workdir", "work", *overrides]
    result = run_group(command, env, timeout_s=600, cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "registered  models:/megalith-demo@candidate (version 1)" in result.stdout
    for unwanted in ("Traceback", "database is locked", "| ERROR"):
        assert unwanted not in output, output[-6000:]
    assert (tmp_path / "work" / "mlflow.db").is_file() and not (tmp_path / "mlflow.db").exists()
    # The registered @candidate is a package that verifies, loads and generates.
    store = f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}"
    package = load_registered_model(
        "models:/megalith-demo@candidate", tmp_path / "download", tracking_uri=store
    )
    model, _, tokenizer_path = load_model_package(package)
    sampling = SamplingConfig(max_new_tokens=3, temperature=0)
    result = generate(model, load_tokenizer(tokenizer_path), ["Once upon a time"], sampling)
    assert result.generations[0].new_tokens >= 1
