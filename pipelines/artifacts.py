"""Markdown and table artifacts the flows publish to the Prefect UI."""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from training.mlflow_store.runs import resolve_tracking_uri


def mlflow_run_link(run_id: str | None) -> str:
    """Where to look at a run: the server's page, or how to open the local UI."""
    if not run_id:
        return "MLflow tracking was off for this run."

    uri = resolve_tracking_uri(None)
    if uri.startswith("http"):
        return f"[MLflow run `{run_id[:8]}`]({uri.rstrip('/')}/#/runs/{run_id})"
    return f"MLflow run `{run_id}` in `{uri}` (open it with `megalith ui`)"


def publish_training_summary(result: dict[str, Any]) -> None:
    val = result.get("val_loss")
    create_markdown_artifact(
        key="training-summary",
        markdown="\n".join(
            [
                "# Training run",
                "",
                "| | |",
                "|---|---|",
                f"| steps | {result['steps']} |",
                f"| final loss | {result['final_loss']:.4f} |",
                f"| validation loss | {val:.4f} |"
                if val is not None
                else "| validation loss | - |",
                f"| tokens/s | {result['tokens_per_s']:,.0f} |",
                f"| model package | `{result['model_package']}` |",
                f"| checkpoint | `{result['checkpoint']}` |",
                "",
                mlflow_run_link(result.get("mlflow_run_id")),
            ]
        ),
        description="Training summary",
    )


def publish_evaluation(evaluation: dict[str, Any]) -> None:
    rows = [{"metric": k, "value": round(v, 4)} for k, v in evaluation["metrics"].items()]
    create_table_artifact(key="evaluation", table=rows, description="Evaluation metrics")
    samples = evaluation.get("generations") or []
    if samples:
        lines = ["# Sample generations", ""]
        for sample in samples:
            lines += [f"**{sample['prompt']}** {sample['text']}", ""]
        create_markdown_artifact(key="generations", markdown="\n".join(lines))


def publish_registration(registration: dict[str, Any], run_id: str | None) -> None:
    create_markdown_artifact(
        key="registered-model",
        markdown=(
            f"# Registered `{registration['name']}` version {registration['version']}\n\n"
            f"Alias `@{registration['alias']}`: load it with `{registration['uri']}`.\n\n"
            f"{mlflow_run_link(run_id)}"
        ),
        description="Model registration",
    )


def publish_promotion(decision: dict[str, Any]) -> None:
    create_markdown_artifact(
        key="promotion-decision",
        markdown=decision["markdown"],
        description="Promotion gate: candidate against champion",
    )
