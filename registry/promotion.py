"""Promotion: when a ``candidate`` version becomes the ``champion``, and going back.

The gate compares the eval metrics a version carries as ``eval.<metric>`` tags (written
at registration) with the current champion's, rule by rule (``promotion.rules`` of the
recipe, :class:`megalith.config.MetricRule`):

- ``improvement`` = (champion − candidate) / |champion| for ``goal: min`` (perplexity,
  loss), (candidate − champion) / |champion| for ``goal: max`` (accuracy): positive is
  better, as a fraction of the champion's value.
- a rule with ``margin`` passes when ``improvement >= margin``; one with
  ``max_regression`` when ``improvement >= -max_regression``; both must hold when both
  are set.

With no champion yet the candidate is promoted (nothing to compare). A candidate or
champion without a rule's metric fails that rule: a gate that cannot compare must not
promote. The decision and every metric compared are written to the candidate's version
tags (``promotion.*``), so the MLflow UI shows why a version was or was not promoted.

Every change of the champion is recorded in the registered model's tag
``megalith.champion_history`` (a JSON list of versions, newest last), which
:func:`rollback` walks back.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from megalith.config import MetricRule
from training.mlflow_store.registered import (
    RegistryError,
    get_alias_version,
    mlflow_client,
    model_version_tags,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient

CHAMPION = "champion"
CANDIDATE = "candidate"
HISTORY_TAG = "megalith.champion_history"


@dataclass(frozen=True)
class RuleResult:
    metric: str
    goal: str
    candidate: float | None
    champion: float | None
    improvement: float | None
    passed: bool
    reason: str


@dataclass(frozen=True)
class GateDecision:
    name: str
    candidate_version: int
    champion_version: int | None
    promoted: bool
    reason: str
    rules: list[RuleResult] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)

    def markdown(self) -> str:
        """A table for a Prefect artifact or a terminal."""
        verdict = "promoted" if self.promoted else "not promoted"
        champion = f"v{self.champion_version}" if self.champion_version else "none"
        lines = [
            f"### {self.name} v{self.candidate_version}: {verdict}",
            "",
            f"Champion compared: {champion}. {self.reason}",
            "",
            "| metric | goal | candidate | champion | improvement | result |",
            "|---|---|---|---|---|---|",
        ]
        for rule in self.rules:
            lines.append(
                f"| {rule.metric} | {rule.goal} | {_fmt(rule.candidate)} | "
                f"{_fmt(rule.champion)} | {_pct(rule.improvement)} | "
                f"{'pass' if rule.passed else 'FAIL'}: {rule.reason} |"
            )
        return "\n".join(lines)


def evaluate_gate(
    candidate: dict[str, float], champion: dict[str, float], rules: list[MetricRule]
) -> list[RuleResult]:
    """Each rule's verdict for two ``{metric: value}`` mappings."""
    return [_judge(rule, candidate.get(rule.metric), champion.get(rule.metric)) for rule in rules]


def _judge(rule: MetricRule, candidate: float | None, champion: float | None) -> RuleResult:
    def result(improvement: float | None, passed: bool, reason: str) -> RuleResult:
        return RuleResult(rule.metric, rule.goal, candidate, champion, improvement, passed, reason)

    if candidate is None or not math.isfinite(candidate):
        return result(None, False, "the candidate has no finite value")
    if champion is None or not math.isfinite(champion):
        return result(None, False, "the champion has no finite value")
    change = (champion - candidate) if rule.goal == "min" else (candidate - champion)
    improvement = change / abs(champion) if champion else math.copysign(math.inf, change or 1)
    if rule.margin is not None and improvement < rule.margin:
        return result(improvement, False, f"needs an improvement of at least {_pct(rule.margin)}")
    if rule.max_regression is not None and improvement < -rule.max_regression:
        return result(improvement, False, f"regresses more than {_pct(rule.max_regression)}")
    limits = [f"margin {_pct(rule.margin)}"] if rule.margin is not None else []
    if rule.max_regression is not None:
        limits.append(f"max regression {_pct(rule.max_regression)}")
    return result(improvement, True, ", ".join(limits) or "reported only")


def gate(
    name: str,
    rules: list[MetricRule],
    *,
    version: int | None = None,
    tracking_uri: str | None = None,
    apply: bool = True,
    champion_metrics: dict[str, float] | None = None,
) -> GateDecision:
    """Compare ``version`` (default: the ``candidate`` alias) with the ``champion`` and,
    when every rule passes and ``apply``, make it the champion. The decision is written to
    the version's tags either way (when ``apply``).

    ``champion_metrics``: the champion measured now on the candidate's evaluation data
    (the recurring fine-tune does this); default: the champion's own ``eval.*`` tags."""
    if version is None:
        version = get_alias_version(name, CANDIDATE, tracking_uri=tracking_uri)
        if version is None:
            raise RegistryError(f"registered model {name!r} has no @{CANDIDATE} version to gate")
    else:
        _require_version(mlflow_client(tracking_uri), name, version)
    champion = get_alias_version(name, CHAMPION, tracking_uri=tracking_uri)
    if champion == version:
        decision = GateDecision(name, version, champion, False, f"v{version} is the champion")
    elif champion is None:
        decision = GateDecision(name, version, None, True, "no champion yet: promoted as the first")
    else:
        if champion_metrics is None:
            champion_metrics = eval_metrics(name, champion, tracking_uri)
        results = evaluate_gate(eval_metrics(name, version, tracking_uri), champion_metrics, rules)
        failed = [r.metric for r in results if not r.passed]
        reason = f"failed: {', '.join(failed)}" if failed else "every rule passed"
        decision = GateDecision(name, version, champion, not failed, reason, results)
    if apply:
        _record(decision, tracking_uri)
        if decision.promoted:
            promote(name, version, tracking_uri=tracking_uri, reason="gate")
    return decision


def eval_metrics(name: str, version: int, tracking_uri: str | None = None) -> dict[str, float]:
    """The ``eval.<metric>`` tags of a version as numbers (tags that are not numbers skipped)."""
    metrics = {}
    for key, value in model_version_tags(name, version, tracking_uri=tracking_uri).items():
        if key.startswith("eval."):
            try:
                metrics[key.removeprefix("eval.")] = float(value)
            except ValueError:
                continue
    return metrics


def promote(
    name: str, version: int, *, tracking_uri: str | None = None, reason: str = "manual"
) -> int | None:
    """Point ``champion`` at ``version``; returns the previous champion (or None)."""
    client = mlflow_client(tracking_uri)
    _require_version(client, name, version)
    previous = get_alias_version(name, CHAMPION, tracking_uri=tracking_uri)
    if previous == version:
        return previous
    history = champion_history(name, tracking_uri)
    client.set_registered_model_alias(name, CHAMPION, str(version))
    client.set_registered_model_tag(name, HISTORY_TAG, json.dumps([*history, version]))
    client.set_model_version_tag(name, str(version), "promotion.promoted_at", _now())
    client.set_model_version_tag(name, str(version), "promotion.promoted_by", reason)
    return previous


def _require_version(client: MlflowClient, name: str, version: int) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_model_version(name, str(version))
    except MlflowException as error:
        raise RegistryError(f"{name!r} has no version {version}: {error.message}") from None


def rollback(name: str, *, tracking_uri: str | None = None) -> int:
    """Make the champion before the current one the champion again; returns its version."""
    client = mlflow_client(tracking_uri)
    current = get_alias_version(name, CHAMPION, tracking_uri=tracking_uri)
    if current is None:
        raise RegistryError(f"registered model {name!r} has no @{CHAMPION} to roll back")
    history = champion_history(name, tracking_uri)
    while history and history[-1] == current:
        history.pop()
    if not history:
        raise RegistryError(
            f"{name!r}: no earlier champion than v{current} is recorded in {HISTORY_TAG}; "
            f"use `megalith registry promote {name} VERSION`"
        )
    previous = history[-1]
    client.set_registered_model_alias(name, CHAMPION, str(previous))
    client.set_registered_model_tag(name, HISTORY_TAG, json.dumps(history))
    client.set_model_version_tag(name, str(current), "promotion.rolled_back_at", _now())
    return previous


def champion_history(name: str, tracking_uri: str | None = None) -> list[int]:
    """The recorded champions, oldest first."""
    tags = mlflow_client(tracking_uri).get_registered_model(name).tags
    try:
        history = json.loads(tags.get(HISTORY_TAG, "[]"))
    except ValueError as error:
        raise RegistryError(f"{name!r}: tag {HISTORY_TAG} is not a JSON list: {error}") from None
    if not isinstance(history, list) or not all(isinstance(v, int) for v in history):
        raise RegistryError(f"{name!r}: tag {HISTORY_TAG} must be a JSON list of versions")
    return history


def _record(decision: GateDecision, tracking_uri: str | None) -> None:
    client = mlflow_client(tracking_uri)
    tags = {
        "promotion.decision": "promoted" if decision.promoted else "rejected",
        "promotion.reason": decision.reason,
        "promotion.compared_to": str(decision.champion_version or ""),
        "promotion.gated_at": _now(),
    }
    for rule in decision.rules:
        tags[f"promotion.{rule.metric}"] = json.dumps(
            {k: v for k, v in asdict(rule).items() if k != "metric"}
        )
    for key, value in tags.items():
        client.set_model_version_tag(decision.name, str(decision.candidate_version), key, value)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.2f}%"
