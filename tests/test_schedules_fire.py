"""The recurring fine-tune fires: a real ``prefect server start`` and ``megalith
serve-pipelines`` as a user starts them, then Prefect's own scheduler service (nothing
in the test asks for runs) must have created the ``finetune`` deployment's upcoming
runs, in state Scheduled at the cron's times. A schedule object alone proves nothing:
with SQLAlchemy 2.1 the UI showed "At 03:00 AM every day" while the scheduler failed
every loop with "Can't evaluate bulk DML statement" and never created a run."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest

from tests.servers import prefect_post, prefect_server, running_process, wait_for_deployments
from tests.test_cli_user_faults import register_tiny_model

pytestmark = pytest.mark.slow

CRON = "0 3 * * *"  # the default: daily at 03:00
FIRST_RUNS = 3  # Prefect's scheduler keeps at least this many runs ahead (min_runs)


@pytest.fixture(scope="module")
def served(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A Prefect server and ``megalith serve-pipelines --workdir WORK`` as a user runs
    them (no MLFLOW_TRACKING_URI); WORK/mlflow.db holds megalith-demo v1 @candidate, as
    after `megalith demo`."""
    root = tmp_path_factory.mktemp("schedules")
    work = root / "work"
    register_tiny_model(work, "megalith-demo", shards / "tokenizer.model")
    log = root / "prefect-server.log"
    # The scheduler's main loop every 2 s instead of 60 s: seconds, not minutes, to wait.
    settings = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"}
    with prefect_server(root / "prefect-home", log, settings) as env:
        command = [sys.executable, "-m", "pipelines.cli", "serve-pipelines",
                   "--workdir", str(work), "--finetune-cron", CRON]  # fmt: skip
        serve_env = {k: v for k, v in env.items() if not k.startswith("MLFLOW_")}
        serve_env["PREFECT_RUNNER_POLL_FREQUENCY"] = "1"  # pick runs up within a second
        with running_process(command, serve_env, "serve-pipelines", cwd=root) as serving:
            api = env["PREFECT_API_URL"]
            deployments = {d["name"]: d for d in wait_for_deployments(api, serving, count=8)}
            runs = scheduled(api, deployments["finetune"], log)
            yield {"api": api, "deployments": deployments, "log": log, "runs": runs, "root": root}


def scheduled(api: str, deployment: dict, log: Path, timeout_s: float = 90) -> list[dict]:
    """The deployment's scheduled runs, once the scheduler has created them."""
    body = {
        "deployments": {"id": {"any_": [deployment["id"]]}},
        "flow_runs": {"state": {"type": {"any_": ["SCHEDULED"]}}},
        "sort": "EXPECTED_START_TIME_ASC",
    }
    deadline = time.monotonic() + timeout_s
    while len(runs := prefect_post(api, "/flow_runs/filter", body)) < FIRST_RUNS:
        assert time.monotonic() < deadline, (
            f"the scheduler created {len(runs)} run(s) of the finetune deployment in "
            f"{timeout_s} s (schedules: {deployment['schedules']}); the server said:\n"
            + log.read_text(errors="replace")[-3000:]
        )
        time.sleep(1)
    return runs


def next_times(cron_hour: int, timezone: str, count: int, after: datetime) -> list[datetime]:
    """The next ``count`` daily times at ``cron_hour``:00 in ``timezone`` after ``after``."""
    zone = ZoneInfo(timezone)
    local = after.astimezone(zone)
    first = local.replace(hour=cron_hour, minute=0, second=0, microsecond=0)
    if first <= local:
        first += timedelta(days=1)
    return [(first + timedelta(days=day)).astimezone(ZoneInfo("UTC")) for day in range(count)]


def test_the_deployment_carries_the_cron_schedule(served: dict) -> None:
    schedules = served["deployments"]["finetune"]["schedules"]
    assert [s["schedule"]["cron"] for s in schedules if s["active"]] == [CRON], schedules


def test_the_scheduler_created_the_runs_at_the_crons_times(served: dict) -> None:
    runs = served["runs"]
    assert all(run["auto_scheduled"] for run in runs), "runs the scheduler made are auto_scheduled"
    assert {run["state"]["name"] for run in runs} == {"Scheduled"}
    timezone = (
        served["deployments"]["finetune"]["schedules"][0]["schedule"].get("timezone") or "UTC"
    )
    created = min(datetime.fromisoformat(run["created"]) for run in runs)
    expected = next_times(3, timezone, len(runs), after=created)
    starts = [datetime.fromisoformat(run["expected_start_time"]) for run in runs]
    assert starts == expected


def test_the_server_logged_no_scheduler_error(served: dict) -> None:
    log = served["log"].read_text(errors="replace")
    assert "Can't evaluate bulk DML statement" not in log
    assert "Traceback" not in log, log[-3000:]


def test_a_served_flow_uses_the_store_of_its_workdir(served: dict) -> None:
    """The promote-model deployment, run from the API as from the UI's Run button, gates
    the demo's candidate in WORK/mlflow.db (where `megalith ui`, `serve` and `registry`
    look), not in a ./mlflow.db of the served process."""
    from training.mlflow_store.registered import get_alias_version

    api, root = served["api"], served["root"]
    deployment = served["deployments"]["promote-model"]
    run = prefect_post(api, f"/deployments/{deployment['id']}/create_flow_run", {})
    deadline = time.monotonic() + 120
    while (state := flow_run_state(api, run["id"]))["type"] != "COMPLETED":
        assert state["type"] not in {"FAILED", "CRASHED"}, state["message"]
        assert time.monotonic() < deadline, f"promote-model still {state['name']} after 120 s"
        time.sleep(1)
    store = f"sqlite:///{root / 'work' / 'mlflow.db'}"
    assert get_alias_version("megalith-demo", "champion", tracking_uri=store) == 1
    assert not (root / "mlflow.db").exists()


def flow_run_state(api: str, run_id: str) -> dict:
    body = {"flow_runs": {"id": {"any_": [run_id]}}}
    return prefect_post(api, "/flow_runs/filter", body)[0]["state"]
