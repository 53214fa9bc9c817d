"""Prefect tasks wrapping each stage, shared by the stage flows and ``end-to-end``.

Tasks return small JSON (paths, ids, metrics), never tensors. Stages that write files
(tokenize, pretrain) skip completed work themselves by verifying their outputs, so a
deleted output is rebuilt rather than reported from a stale cache. Evaluation and
registration are cached by Prefect, keyed on their inputs including the model
package's content id; results are persisted with Prefect's JSON serializer, so the
cache never unpickles anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import INPUTS, TASK_SOURCE

from megalith.config import MegalithConfig, MetricRule, dump_config
from megalith.storage import sha256_of_file
from registry.models import register_model
from registry.promotion import gate
from training.mlflow_store.runs import log_evaluation
from training.runtime.launch import PARENT_PID_ENV
from training.runtime.run_lock import hold_run_folder

# Under the 30 s after which Prefect's runner SIGKILLs a cancelled flow run's process.
STOP_GRACE_S = 20.0

CACHED = {
    "cache_policy": INPUTS + TASK_SOURCE,
    "persist_result": True,
    "result_serializer": "json",
}


class TrainingProcessError(RuntimeError):
    """The training process exited with an error; the message holds its last lines."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def retry_if_killed(task, task_run, state) -> bool:
    """Retry a training process killed by a signal (preemption, OOM killer): it resumes
    from its last checkpoint. Errors in the user's config or data are not retried."""
    error = state.result(raise_on_failure=False)
    return isinstance(error, TrainingProcessError) and error.returncode < 0


def train_command(recipe: Path, output: Path, nproc_per_node: int = 1) -> list[str]:
    """``megalith train``; with several processes it relaunches itself through torchrun,
    which stops every rank and exits non-zero as soon as one fails."""
    command = [
        sys.executable, "-m", "pipelines.cli", "train",
        "--config", str(recipe), "--output", str(output), "--quiet", "--resume",
    ]  # fmt: skip
    if nproc_per_node > 1:
        command += ["--nproc-per-node", str(nproc_per_node)]
    return command


def stream_process(command: list[str], logger, extra_env: dict[str, str] | None = None) -> int:
    """Run a command, sending each line of its output to the Prefect run logger.

    Cancelling the flow run stops the command the orderly way: Prefect's runner sends the
    flow's process SIGTERM (to its pid alone), raised here as ``TerminationSignal``, and
    this passes the SIGTERM on (``stop_child``), so that a training unwinds and its ranks
    stop on every node. Without that, the command trained on until the runner's SIGKILL
    30 s later. The command also dies with this process however this one ends
    (``training.runtime.launch.die_with_parent``), so a retry never trains beside an
    orphan. Only rank 0 logs progress; the other ranks print warnings and errors only.
    """
    tail: deque[str] = deque(maxlen=40)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",  # lines as they happen, not per 8 KB
        PARENT_PID_ENV: str(os.getpid()),  # waited for in this thread, as the kernel requires
        **(extra_env or {}),
    }
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
    ) as process:
        try:
            log_lines(process, logger, tail)
        except BaseException:  # TerminationSignal (a cancel, a timeout), Ctrl-C, an error
            stop_child(process, logger)
            raise
        returncode = process.wait()
    if returncode:
        raise TrainingProcessError(
            f"training exited with code {returncode}; last output:\n" + "\n".join(tail), returncode
        )
    return returncode


def log_lines(process: subprocess.Popen, logger, tail: deque[str] | None = None) -> None:
    """Each line of the process's output to ``logger`` (and ``tail``), until it closes."""
    for line in process.stdout:
        line = line.rstrip()
        if tail is not None:
            tail.append(line)
        logger.info(line)


def stop_child(process: subprocess.Popen, logger, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, which ``megalith train`` passes to every rank, its last lines logged;
    SIGKILL if it still runs ``grace_s`` later (a rank stuck in a collective cannot
    unwind), which takes its workers with it (``die_with_parent``) and closes the output."""
    process.terminate()
    deadline = threading.Timer(grace_s, process.kill)
    deadline.start()
    try:
        log_lines(process, logger)
        process.wait()
    finally:
        deadline.cancel()


@task(
    name="pretrain", retries=1, retry_delay_seconds=2, retry_condition_fn=retry_if_killed, **CACHED
)
def pretrain_task(
    config: MegalithConfig, output: str, shards_id: str = "", nproc_per_node: int = 1
) -> dict[str, Any]:
    """Train in a child process (logs streamed here); ``shards_id`` ties the cache to the data.

    ``nproc_per_node`` > 1 runs that many ranks through torchrun (data parallelism fills
    what the ``parallel`` sizes leave); rank 0 records the layout in MLflow. The child
    resumes from the latest checkpoint in ``output``, so a retry continues.
    """
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node must be at least 1, got {nproc_per_node}")
    output_dir = Path(output)
    output_dir.mkdir(parents=True, exist_ok=True)
    # Held here, before the recipe is written: a run already training into the folder
    # keeps its recipe, and the child trains under this lock.
    with hold_run_folder(output_dir) as lock:
        recipe = output_dir / "recipe.yaml"
        recipe.write_text(dump_config(config))
        command = train_command(recipe, output_dir, nproc_per_node)
        stream_process(command, get_run_logger(), lock.child_env() if lock else None)
    result = json.loads((output_dir / "result.json").read_text())
    return {**result, "package_id": package_id(result["model_package"])}


def package_id(package_dir: str) -> str:
    """A model package's content id: the sha256 of its checksums.json."""
    return sha256_of_file(str(Path(package_dir) / "checksums.json"))


@task(name="evaluate", **CACHED)
def evaluate_task(
    model_package: str,
    config: MegalithConfig,
    report_path: str,
    task_files: list[str],
    prompts: list[str] | None = None,
    run_id: str | None = None,
    package_id: str = "",
    lm_eval_tasks: list[str] | None = None,
) -> dict[str, Any]:
    """Perplexity, zero-shot tasks, lm-eval tasks (names or YAML files, as ``megalith eval
    --lm-eval-tasks`` takes) and sample generations; returns the headline metrics.

    ``package_id`` keys the cache to the model's content, not just its path."""
    # torch comes with evaluation: the flow process imports it only when a model is evaluated.
    from evaluation.report import evaluate_model, headline_metrics
    from training.inference.decode import SamplingConfig

    # Leave at least half the context for the prompt.
    sampling = SamplingConfig(max_new_tokens=min(64, config.data.seq_length // 2))
    report = evaluate_model(
        model_package,
        config.data,
        task_files,
        prompts,
        sampling=sampling,
        output=report_path,
        lm_eval_tasks=lm_eval_tasks or (),
    )
    metrics = headline_metrics(report)
    if run_id:
        log_evaluation(run_id, metrics, report_path)
    get_run_logger().info("evaluation: %s", json.dumps(metrics))
    return {"report": report_path, "metrics": metrics, "generations": _generations(report)}


def _generations(report: dict[str, Any]) -> list[dict[str, str]]:
    generation = report.get("generation") or {}
    return [
        {"prompt": sample.get("prompt", ""), "text": sample.get("text", "")}
        for sample in generation.get("samples", [])
    ]


@task(name="register-model", **CACHED)
def register_task(
    model_package: str,
    name: str,
    run_id: str | None,
    metrics: dict[str, float],
    package_id: str = "",
) -> dict[str, Any]:
    """Register the package as a new version of ``name`` with alias ``candidate``."""
    version = register_model(model_package, name, run_id, metrics, alias="candidate")
    get_run_logger().info("registered %s version %s as @candidate", name, version)
    return {
        "name": name,
        "version": version,
        "alias": "candidate",
        "uri": f"models:/{name}@candidate",
    }


@task(name="promotion-gate")
def gate_task(
    name: str,
    rules: list[dict[str, Any]],
    version: int | None = None,
    champion_metrics: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Gate ``version`` (default @candidate) against @champion; promote it if it passes.
    Not cached: the champion it compares with changes. ``champion_metrics``: the champion
    evaluated on the candidate's data (default: its own eval tags)."""

    decision = gate(
        name,
        [MetricRule(**rule) for rule in rules],
        version=version,
        champion_metrics=champion_metrics,
    )
    get_run_logger().info(
        "%s v%s: %s (%s)",
        name,
        decision.candidate_version,
        "promoted" if decision.promoted else "not promoted",
        decision.reason,
    )
    return {**decision.as_dict(), "markdown": decision.markdown()}
