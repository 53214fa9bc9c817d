"""The Prefect flows: ``pretrain``, ``evaluate``, ``register-model``, ``promote-model`` and
``end-to-end``.

Each takes the typed config (the Prefect UI renders it as a form) and adds only
orchestration around the stage functions: retries, caching, artifacts, logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from megalith.config import MegalithConfig, PromotionConfig
from pipelines.artifacts import (
    publish_evaluation,
    publish_promotion,
    publish_registration,
    publish_training_summary,
)
from pipelines.tasks import evaluate_task, gate_task, pretrain_task, register_task
from pipelines.tokenize import (
    SAMPLE_TASKS,
    curate_before_tokenizing,
    evaluation_task_files,
    manifest_markdown,
    train_tokenizer_task,
    write_shards_task,
)

NO_LM_EVAL_TASKS: list[str] = []


@flow(name="pretrain", log_prints=True)
def pretrain(config: MegalithConfig, output: str, nproc_per_node: int = 1) -> dict[str, Any]:
    """Train a GPT or a T5 (by model.family) on prepared shards; the run's logs stream here,
    metrics go to MLflow.

    ``nproc_per_node`` > 1 launches that many ranks on this machine through torchrun.
    """
    result = pretrain_task(config, output, nproc_per_node=nproc_per_node)
    publish_training_summary(result)
    return result


@flow(name="evaluate", log_prints=True)
def evaluate(
    model_package: str,
    config: MegalithConfig,
    report_path: str,
    task_files: list[str] = SAMPLE_TASKS,  # noqa: B006 - a read-only form default
    run_id: str | None = None,
    lm_eval_tasks: list[str] = NO_LM_EVAL_TASKS,  # noqa: B006 - a read-only form default
) -> dict[str, Any]:
    """Perplexity on the valid split, zero-shot tasks, sample generations and the
    ``lm_eval_tasks`` (lm-evaluation-harness task names, e.g. ``sample_facts``; empty: none),
    all logged to MLflow run ``run_id`` when given."""
    evaluation = evaluate_task(
        model_package, config, report_path, task_files, None, run_id, lm_eval_tasks=lm_eval_tasks
    )
    publish_evaluation(evaluation)
    return evaluation


@flow(name="register-model", log_prints=True)
def register_model_flow(
    model_package: str, name: str, run_id: str, metrics: dict[str, float]
) -> dict[str, Any]:
    """Register a model package as a new version with alias ``candidate``."""
    registration = register_task(model_package, name, run_id, metrics)
    publish_registration(registration, run_id)
    return registration


@flow(name="promote-model", log_prints=True)
def promote_model_flow(
    name: str, promotion: PromotionConfig | None = None, version: int | None = None
) -> dict[str, Any]:
    """Make @candidate (or ``version``) the @champion if its eval metrics beat the
    champion's by the rules; the decision goes to the version's tags and an artifact."""
    rules = (promotion or PromotionConfig()).rules
    decision = gate_task(name, [rule.model_dump() for rule in rules], version)
    publish_promotion(decision)
    return decision


@flow(name="end-to-end", log_prints=True)
def end_to_end(
    config: MegalithConfig,
    workdir: str,
    nproc_per_node: int = 1,
    lm_eval_tasks: list[str] = NO_LM_EVAL_TASKS,  # noqa: B006 - a read-only form default
) -> dict[str, Any]:
    """Curate → tokenize → pretrain → evaluate → register. A rerun skips unchanged stages.

    Curation (``config.data.curate``) decontaminates against the evaluation tasks this flow
    scores.

    ``nproc_per_node`` > 1 pretrains on that many ranks of this machine (torchrun);
    ``lm_eval_tasks``: lm-evaluation-harness tasks the evaluation runs too (their metrics
    reach MLflow and the registered version, as ``lm_eval.TASK.METRIC``)."""
    logger = get_run_logger()
    root = Path(workdir)
    data, curation = curate_before_tokenizing(
        config.data, evaluation_task_files([*SAMPLE_TASKS, *lm_eval_tasks])
    )
    model_path = train_tokenizer_task(data, config.tokenizer)
    shards = write_shards_task(data, config.tokenizer, model_path)
    create_markdown_artifact(key="shard-manifest", markdown=manifest_markdown(shards))

    trained = pretrain_task(config, str(root / "run"), nproc_per_node=nproc_per_node)
    publish_training_summary(trained)
    run_id = trained.get("mlflow_run_id")

    package = trained["model_package"]
    evaluation = evaluate_task(
        package,
        config,
        str(root / "run" / "eval.json"),
        SAMPLE_TASKS,
        run_id=run_id,
        package_id=trained["package_id"],
        lm_eval_tasks=lm_eval_tasks,
    )
    publish_evaluation(evaluation)

    registration = None
    if run_id:
        registration = register_task(
            package,
            config.logging.registered_model,
            run_id,
            evaluation["metrics"],
            trained["package_id"],
        )
        publish_registration(registration, run_id)
    else:
        logger.warning(
            "MLflow tracking is off (logging.mlflow=false): the model was not registered"
        )
    return {
        "curation": curation,
        "shards": shards,
        "training": trained,
        "evaluation": evaluation,
        "registration": registration,
    }
