"""The UIs as users see them, in headless Chromium driven by Playwright.

- Prefect: ``megalith serve-pipelines`` against a real ``prefect server``; the
  Deployments page lists every flow, the ``finetune`` deployment shows its cron
  schedule, and a run started from its form completes (no new data: it skips). That
  the scheduler itself creates the schedule's runs is tests/test_schedules_fire.py.
- MLflow: a real ``mlflow server``; the experiment page lists the run with its metrics,
  the registered model page shows the ``candidate`` and ``champion`` aliases.

Screenshots go to a temporary directory; ``python -m tests.browser --refresh-docs``
reruns these tests writing them into ``docs/screenshots/`` (the README shows them).
Needs Chromium
(Debian's ``chromium`` at /usr/bin/chromium, see tests/browser.py); skipped without it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import servers
from tests.browser import chromium_page, screenshot_dir
from tests.servers import running_process

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory for screenshots: a temporary one unless the docs are being refreshed."""
    return screenshot_dir(tmp_path_factory.mktemp("screenshots"))


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real ``prefect server start`` on 127.0.0.1 with its own database."""
    with servers.prefect_server(tmp_path_factory.mktemp("prefect-home")) as env:
        yield env


@pytest.fixture(scope="module")
def served_pipelines(
    prefect_server: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """``megalith serve-pipelines`` with every deployment, the finetune one scheduled."""
    workdir = tmp_path_factory.mktemp("served")
    store = f"sqlite:///{workdir / 'mlflow.db'}"
    env = {**prefect_server, "MLFLOW_TRACKING_URI": store, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pipelines.cli", "serve-pipelines", "--workdir", str(workdir),
               "--finetune-cron", "0 3 * * *"]  # fmt: skip
    with running_process(command, env, "serve-pipelines") as process:
        servers.wait_for_deployments(prefect_server["PREFECT_API_URL"], process, count=8)
        yield workdir


def flow_runs(api: str) -> list[dict]:
    return servers.prefect_post(api, "/flow_runs/filter")


def test_prefect_ui_shows_scheduled_deployments_and_starts_a_run(
    prefect_server: dict[str, str], served_pipelines: Path, screenshots: Path
) -> None:
    api = prefect_server["PREFECT_API_URL"]
    ui = api.removesuffix("/api")
    names = ["tokenize-corpus", "pretrain", "evaluate", "register-model", "promote-model",
             "end-to-end", "finetune"]  # fmt: skip
    with chromium_page() as page:
        page.goto(f"{ui}/deployments")
        for name in names:
            page.get_by_text(name, exact=True).first.wait_for(timeout=30_000)
        page.screenshot(path=str(screenshots / "prefect-deployments.png"))

        page.get_by_role("link", name="finetune", exact=True).first.click()
        page.wait_for_url("**/deployments/deployment/**")
        page.get_by_text("Schedules").first.wait_for(timeout=30_000)
        page.get_by_text("At 03:00 AM").first.wait_for(timeout=30_000)
        page.screenshot(path=str(screenshots / "prefect-finetune-deployment.png"))

        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_text("Custom run").click()
        page.get_by_text("data_location").first.wait_for(timeout=30_000)
        page.screenshot(path=str(screenshots / "prefect-finetune-form.png"), full_page=True)
        page.get_by_role("button", name="Submit").click()

        deadline = time.monotonic() + 180
        while True:  # the served process picks the run up and finds no new data
            runs = [r for r in flow_runs(api) if r.get("deployment_id")]
            states = [r["state"]["type"] for r in runs if r.get("state")]
            if "COMPLETED" in states:
                break
            assert not {"FAILED", "CRASHED"} & set(states), f"run from the form failed: {runs}"
            assert time.monotonic() < deadline, f"run from the form did not finish: {states}"
            time.sleep(1)
        run = next(r for r in runs if r["state"]["type"] == "COMPLETED")
        page.goto(f"{ui}/runs/flow-run/{run['id']}")
        page.get_by_text("Completed").first.wait_for(timeout=30_000)
        page.screenshot(path=str(screenshots / "prefect-finetune-run.png"))


@pytest.fixture(scope="module")
def tracked_model(mlflow_server: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run with metrics and a model with two versions: @champion and @candidate."""
    from registry.models import register_model, set_alias
    from tests.test_registry import make_package
    from training.mlflow_store.runs import MLflowRunLogger

    root = tmp_path_factory.mktemp("ui-model")
    name, versions = "megalith-ui-demo", []
    for index in (1, 2):
        logger = MLflowRunLogger.start(mlflow_server, experiment="megalith-ui", tags={})
        for step in range(1, 6):
            logger.log_metrics({"loss": 5.0 / (step * index), "lr": 1e-3}, step)
        logger.close()
        package = make_package(root / f"package-{index}", seed=index)
        metrics = {"valid_perplexity": 20.0 / index}
        versions.append(
            register_model(package, name, logger.run_id, metrics, tracking_uri=mlflow_server)
        )
    set_alias(name, "champion", versions[0], tracking_uri=mlflow_server)
    return {"name": name, "run_id": logger.run_id, "experiment": "megalith-ui"}


def test_mlflow_ui_shows_runs_metrics_and_aliases(
    mlflow_server: str, tracked_model: dict, screenshots: Path
) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name(tracked_model["experiment"])
    run = client.get_run(tracked_model["run_id"])
    with chromium_page() as page:
        page.goto(f"{mlflow_server}/#/experiments/{experiment.experiment_id}/runs")
        page.get_by_text(run.info.run_name, exact=True).first.wait_for(timeout=60_000)
        page.screenshot(path=str(screenshots / "mlflow-experiment.png"))

        page.goto(
            f"{mlflow_server}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}"
        )
        page.get_by_text("loss", exact=True).first.wait_for(timeout=60_000)
        page.screenshot(path=str(screenshots / "mlflow-run.png"))

        page.goto(f"{mlflow_server}/#/models/{tracked_model['name']}")
        page.get_by_text("champion").first.wait_for(timeout=60_000)
        page.get_by_text("candidate").first.wait_for(timeout=60_000)
        page.screenshot(path=str(screenshots / "mlflow-registered-model.png"))
