"""Small faults a new user meets, tried as the user meets them: ``megalith`` run as a
subprocess. A mistyped subcommand names the nearest valid one; ``serve`` and
``registry`` find the store ``megalith demo`` wrote (or say where they looked) and never
create an empty one; stopping ``megalith ui`` stops every server it started."""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.servers import free_port, run_group, running_process

MEGALITH = [sys.executable, "-m", "pipelines.cli"]


def megalith(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None):
    """``megalith ARGS`` with no MLFLOW_TRACKING_URI unless ``env`` sets one."""
    environment = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    environment.update(env or {})
    return run_group([*MEGALITH, *args], environment, timeout_s=120, cwd=cwd)


@pytest.mark.parametrize(
    ("typed", "suggested"),
    [
        (["trian"], "train"),
        (["data", "prepair"], "prepare"),
        (["registry", "promot", "m", "1"], "promote"),
        (["serve", "--model", "m", "--precision", "fp23"], "fp32"),
    ],
)
def test_a_mistyped_choice_suggests_the_nearest_one(typed: list[str], suggested: str) -> None:
    result = megalith(*typed)
    assert result.returncode == 2, result.stderr
    assert f"did you mean '{suggested}'?" in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()[-1]) < 200  # one short line, not a list


def test_a_choice_nothing_resembles_lists_the_choices() -> None:
    result = megalith("xyzzy")
    assert result.returncode == 2
    assert "did you mean" not in result.stderr and "'train'" in result.stderr


# --- serve and registry find the demo's store, and never create one -------------------

MODEL = "faults-model"


@pytest.fixture(scope="module")
def demo_dir(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder as `megalith demo` leaves it: work/demo/mlflow.db holding a tiny model
    registered as version 1 (@candidate)."""
    from mlflow import MlflowClient
    from test_evaluation import tiny_model

    from preprocessing.tokenizer import load_tokenizer
    from registry.models import register_model
    from registry.tracking import ensure_tracking_store
    from training.models.package import save_model_package

    root = tmp_path_factory.mktemp("user-dir")
    tokenizer = load_tokenizer(str(shards / "tokenizer.model"))
    model = tiny_model(tokenizer)
    package = save_model_package(model, model.config, tokenizer.model_path, root / "package")
    uri = f"sqlite:///{root / 'work' / 'demo' / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        ensure_tracking_store(uri)
        client = MlflowClient(tracking_uri=uri)
        run = client.create_run(client.create_experiment("faults")).info.run_id
        assert register_model(package, MODEL, run, {}, "candidate", tracking_uri=uri) == 1
        client.set_terminated(run)
    return root


def sqlite_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.db"))


def test_registry_finds_the_store_the_demo_wrote(demo_dir: Path) -> None:
    result = megalith("registry", "promote", MODEL, "1", cwd=demo_dir)
    assert result.returncode == 0, result.stderr
    assert f"{MODEL}@champion → v1" in result.stdout


def test_serve_finds_the_store_the_demo_wrote(demo_dir: Path) -> None:
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    command = [*MEGALITH, "serve", "--model", f"models:/{MODEL}/1", "--port", str(port)]
    health = f"http://127.0.0.1:{port}/health"
    info_url = f"http://127.0.0.1:{port}/v1/model"
    with (
        running_process(command, environment, "megalith serve", health, cwd=demo_dir),
        urllib.request.urlopen(info_url, timeout=10) as answer,
    ):
        info = json.loads(answer.read())
    assert info["name"] == MODEL and str(info["version"]) == "1", info


PROMOTE = ["registry", "promote", MODEL, "1"]


@pytest.mark.parametrize(
    ("command", "pointed_by"),
    [
        *((PROMOTE, way) for way in ("default", "--workdir", "--tracking-uri", "env")),
        (["registry", "rollback", MODEL], "default"),
        (["registry", "gate", MODEL, "--dry-run"], "default"),
        (["serve", "--model", f"models:/{MODEL}@champion"], "default"),
        (["serve", "--model", f"models:/{MODEL}@champion"], "env"),
    ],
)
def test_a_missing_store_is_named_and_never_created(
    command: list[str], pointed_by: str, tmp_path: Path
) -> None:
    missing = tmp_path / "elsewhere" / "mlflow.db"
    arguments, env = {
        "default": ([], {}),
        "--workdir": (["--workdir", str(missing.parent)], {}),
        "--tracking-uri": (["--tracking-uri", f"sqlite:///{missing}"], {}),
        "env": ([], {"MLFLOW_TRACKING_URI": f"sqlite:///{missing}"}),
    }[pointed_by]
    result = megalith(*command, *arguments, cwd=tmp_path, env=env)
    assert result.returncode == 1, result.stderr
    expected = tmp_path / "work" / "demo" / "mlflow.db" if pointed_by == "default" else missing
    assert result.stderr.startswith(f"error: no MLflow store at {expected} "), result.stderr
    assert "--tracking-uri" in result.stderr and "MLFLOW_TRACKING_URI" in result.stderr
    assert "Traceback" not in result.stderr
    assert sqlite_files(tmp_path) == []
