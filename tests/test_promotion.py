"""The promotion gate, manual promotion and rollback, on a real SQLite MLflow store.

Versions are real model packages registered from real runs; their eval metrics are the
inputs the gate compares (the end-to-end fine-tune test feeds it real evaluations).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megalith.config import MetricRule, PromotionConfig
from megalith.errors import MegalithError
from pipelines.cli import main
from registry.models import register_model
from registry.promotion import (
    CHAMPION,
    champion_history,
    evaluate_gate,
    gate,
    promote,
    rollback,
)
from tests.test_registry import make_package, store  # noqa: F401  (fixture)
from training.mlflow_store.registered import get_alias_version, model_version_tags
from training.mlflow_store.runs import MLflowRunLogger

NAME = "megalith-promotion-test"
PPL = MetricRule(metric="valid_perplexity", goal="min", margin=0.01)
ACC = MetricRule(metric="facts_acc", goal="max", max_regression=0.05)


def register(store: str, root: Path, index: int, metrics: dict[str, Any]) -> int:  # noqa: F811
    logger = MLflowRunLogger.start(store, experiment="promotion", tags={})
    logger.close()
    package = make_package(root / f"package-{index}", seed=index)
    return register_model(package, NAME, logger.run_id, metrics, tracking_uri=store)


def test_rules_compare_in_the_metric_direction() -> None:
    champion = {"valid_perplexity": 10.0, "facts_acc": 0.50}
    better = evaluate_gate({"valid_perplexity": 9.8, "facts_acc": 0.49}, champion, [PPL, ACC])
    assert [r.passed for r in better] == [True, True], better
    assert better[0].improvement == pytest.approx(0.02)
    assert better[1].improvement == pytest.approx(-0.02)
    # 0.5% better perplexity is short of the 1% margin; 10% worse accuracy is past 5%.
    worse = evaluate_gate({"valid_perplexity": 9.95, "facts_acc": 0.45}, champion, [PPL, ACC])
    assert [r.passed for r in worse] == [False, False], worse
    assert "at least +1.00%" in worse[0].reason and "more than +5.00%" in worse[1].reason
    missing = evaluate_gate({"facts_acc": float("nan")}, champion, [PPL, ACC])
    assert [r.reason for r in missing] == ["the candidate has no finite value"] * 2


def test_gate_promotes_rejects_and_records(store: str, tmp_path: Path) -> None:  # noqa: F811
    first = register(store, tmp_path, 1, {"valid_perplexity": 10.0, "facts_acc": 0.50})
    decision = gate(NAME, [PPL, ACC], tracking_uri=store)
    assert decision.promoted and decision.champion_version is None
    assert get_alias_version(NAME, CHAMPION, tracking_uri=store) == first

    second = register(store, tmp_path, 2, {"valid_perplexity": 9.0, "facts_acc": 0.49})
    decision = gate(NAME, [PPL, ACC], tracking_uri=store)
    assert decision.promoted, decision.markdown()
    assert get_alias_version(NAME, CHAMPION, tracking_uri=store) == second

    third = register(store, tmp_path, 3, {"valid_perplexity": 8.0, "facts_acc": 0.30})
    decision = gate(NAME, [PPL, ACC], tracking_uri=store)
    assert not decision.promoted and decision.reason == "failed: facts_acc"
    assert get_alias_version(NAME, CHAMPION, tracking_uri=store) == second
    tags = model_version_tags(NAME, third, tracking_uri=store)
    assert tags["promotion.decision"] == "rejected"
    assert tags["promotion.compared_to"] == str(second)
    recorded = json.loads(tags["promotion.facts_acc"])
    assert recorded["candidate"] == 0.30 and recorded["champion"] == 0.49
    assert not recorded["passed"]
    assert "| facts_acc | max | 0.3 | 0.49 | -38.78% | FAIL" in decision.markdown()

    # People decide themselves: promote the rejected version, then roll back twice.
    assert promote(NAME, third, tracking_uri=store) == second
    assert champion_history(NAME, store) == [first, second, third]
    assert rollback(NAME, tracking_uri=store) == second
    assert rollback(NAME, tracking_uri=store) == first
    with pytest.raises(MegalithError, match="no earlier champion than v1"):
        rollback(NAME, tracking_uri=store)
    with pytest.raises(MegalithError, match="has no version 99"):
        promote(NAME, 99, tracking_uri=store)


def test_cli_gate_exit_status_and_json(
    store: str,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    recipe = tmp_path / "recipe.yaml"
    rules = PromotionConfig(rules=[PPL]).model_dump(mode="json")
    recipe.write_text(json.dumps({"promotion": rules}))  # JSON is YAML
    champion = register(store, tmp_path, 4, {"valid_perplexity": 5.0})
    promote(NAME, champion, tracking_uri=store)
    version = register(store, tmp_path, 5, {"valid_perplexity": 50.0})
    args = ["registry", "gate", NAME, "--config", str(recipe), "--tracking-uri", store]
    assert main([*args, "--version", str(version), "--json"]) == 3
    decision = json.loads(capsys.readouterr().out)
    assert decision["candidate_version"] == version and not decision["promoted"]
    assert main(["registry", "promote", NAME, str(version), "--tracking-uri", store]) == 0
    assert get_alias_version(NAME, CHAMPION, tracking_uri=store) == version
    assert main(["registry", "rollback", NAME, "--tracking-uri", store]) == 0
    assert get_alias_version(NAME, CHAMPION, tracking_uri=store) == champion
    assert main(["registry", "promote", NAME, "77", "--tracking-uri", store]) == 1
    assert "has no version 77" in capsys.readouterr().err


def test_promote_model_flow_publishes_its_decision(
    prefect_api,
    store: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from pipelines.flows import promote_model_flow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    name = f"{NAME}-flow"
    logger = MLflowRunLogger.start(store, experiment="promotion", tags={})
    logger.close()
    package = make_package(tmp_path / "package", seed=5)
    version = register_model(package, name, logger.run_id, {"valid_perplexity": 7.0})
    decision = promote_model_flow(name, PromotionConfig(rules=[PPL]))
    assert decision["promoted"] and decision["candidate_version"] == version
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["promotion-decision"]))
        )
    assert any(f"### {name} v{version}: promoted" in (a.data or "") for a in artifacts)
