"""The whole loop as a user runs it, against a real ``mlflow server`` process and
Prefect's API: pretrain a tiny model (``end-to-end`` flow) → it is registered as
@candidate → promote it to @champion → new chat data arrives → the ``finetune`` flow
fine-tunes the champion with LoRA, evaluates both on the new data, registers @candidate
and gates it → a second run finds nothing new and skips → the champion is served over
HTTP and answers a request with text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megalith.config import load_config
from pipelines.recipes import DEMO_RECIPE, FINETUNE_RECIPE, sample_corpus
from tests.test_pipelines import TINY_DEMO

pytestmark = pytest.mark.slow

MODEL_NAME = "journey-model"
CHAT_SAMPLE = Path(__file__).resolve().parents[1] / "preprocessing/sample_corpus/chat.jsonl"


@pytest.fixture(scope="module")
def journey(prefect_api, mlflow_server: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from pipelines.finetune import finetune
    from pipelines.flows import end_to_end
    from registry.promotion import promote

    root = tmp_path_factory.mktemp("journey")
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(sample_corpus().read_text().splitlines()[:400]) + "\n")
    pretrain_config = load_config(
        DEMO_RECIPE,
        [*TINY_DEMO, f"logging.registered_model={MODEL_NAME}"],
        {"data.inputs": [str(corpus)], "data.output": str(root / "shards")},
    )
    finetune_config = load_config(
        FINETUNE_RECIPE,
        [
            "data.seq_length=64",
            "training.train_iters=6",
            "training.eval_interval=3",
            "training.eval_iters=1",
            "checkpoint.interval=0",
            f"logging.registered_model={MODEL_NAME}",
            f"finetune.base=models:/{MODEL_NAME}@champion",
        ],
    )
    incoming = root / "incoming"
    incoming.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
        patch.setenv("OMP_NUM_THREADS", "1")
        pretrained = end_to_end(pretrain_config, str(root / "pretrain"))
        first = pretrained["registration"]["version"]
        promote(MODEL_NAME, first)
        (incoming / "week-1.jsonl").write_text(
            "\n".join(CHAT_SAMPLE.read_text().splitlines()[:160]) + "\n"
        )
        workdir = str(root / "finetune")
        tuned = finetune(finetune_config, str(incoming), workdir)
        again = finetune(finetune_config, str(incoming), workdir)
    return {"first": first, "tuned": tuned, "again": again, "workdir": workdir}


def test_finetune_registers_a_gated_candidate(journey: dict, mlflow_server: str) -> None:
    from training.mlflow_store.registered import get_alias_version, model_version_tags

    tuned = journey["tuned"]
    assert not tuned["skipped"] and tuned["files"] == 1
    assert tuned["base"] == f"models:/{MODEL_NAME}/{journey['first']}"
    version = tuned["candidate_version"]
    assert get_alias_version(MODEL_NAME, "candidate", tracking_uri=mlflow_server) == version
    tags = model_version_tags(MODEL_NAME, version, tracking_uri=mlflow_server)
    assert tags["promotion.decision"] == ("promoted" if tuned["promoted"] else "rejected")
    assert tags["promotion.compared_to"] == str(journey["first"])
    compared = json.loads(tags["promotion.valid_perplexity"])
    # Both were evaluated on the new chat data's valid split, in this run.
    assert compared["candidate"] == float(tags["eval.valid_perplexity"])
    assert compared["champion"] > 0 and compared["candidate"] > 0
    champion = get_alias_version(MODEL_NAME, "champion", tracking_uri=mlflow_server)
    assert champion == (version if tuned["promoted"] else journey["first"])


def test_lineage_names_the_base_version(journey: dict, mlflow_server: str) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    version = client.get_model_version(MODEL_NAME, str(journey["tuned"]["candidate_version"]))
    run = client.get_run(version.run_id)
    lineage = " ".join(f"{k}={v}" for k, v in run.data.tags.items())
    assert f"models:/{MODEL_NAME}/{journey['first']}" in lineage, run.data.tags


def test_second_run_without_new_data_skips(journey: dict) -> None:
    assert journey["again"]["skipped"]
    state = json.loads((Path(journey["workdir"]) / "finetune-state.json").read_text())
    assert len(state["processed"]) == 1 and len(state["runs"]) == 1


def test_the_champion_is_served_over_http(journey: dict, mlflow_server: str) -> None:
    import httpx

    from deploy.server import ServeConfig
    from tests.test_serving import running

    config = ServeConfig(
        model=f"models:/{MODEL_NAME}@champion", tracking_uri=mlflow_server, max_tokens=16
    )
    with running(config) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        info = http.get("/v1/model").json()
        answer = http.post("/v1/generate", json={"prompt": "Once upon a time", "max_tokens": 8})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["completion_tokens"] >= 1 and isinstance(body["text"], str), body
    champion = (
        journey["tuned"]["candidate_version"] if journey["tuned"]["promoted"] else journey["first"]
    )
    assert str(info.get("version")) == str(champion), info


def test_the_champion_exports_to_hugging_face(
    journey: dict, mlflow_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    import transformers

    from pipelines.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    out = tmp_path / "hf-champion"
    assert main(["export", "hf", f"models:/{MODEL_NAME}@champion", str(out)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    tokens = torch.tensor([[1, 2, 3, 4]])
    logits = model(tokens).logits
    assert logits.shape[:2] == (1, 4) and torch.isfinite(logits).all()
