"""Small faults a new user meets, tried as the user meets them: ``megalith`` run as a
subprocess. A mistyped subcommand names the nearest valid one; ``serve`` and
``registry`` find the store ``megalith demo`` wrote (or say where they looked) and never
create an empty one; a store that is not one, a server that does not answer, a bad
number, a taken port, a bad cron or a file in the way of --workdir is one line naming
it; stopping ``megalith ui`` (SIGTERM, SIGINT, SIGHUP) stops every server it started."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.servers import answers, free_port, run_group, running_process

MEGALITH = [sys.executable, "-m", "pipelines.cli"]


def megalith(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
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
    root = tmp_path_factory.mktemp("user-dir")
    register_tiny_model(root / "work" / "demo", MODEL, shards / "tokenizer.model")
    return root


def register_tiny_model(workdir: Path, name: str, tokenizer_model: Path) -> None:
    """WORKDIR/mlflow.db (a real SQLite store, artifacts beside it) with a tiny random
    GPT registered as version 1 of ``name``, @candidate."""
    from mlflow import MlflowClient
    from test_evaluation import tiny_model

    from preprocessing.tokenizer import load_tokenizer
    from registry.models import register_model
    from training.mlflow_store.runs import ensure_tracking_store
    from training.models.package import save_model_package

    tokenizer = load_tokenizer(str(tokenizer_model))
    model = tiny_model(tokenizer)
    package = save_model_package(model, model.config, tokenizer.model_path, workdir / "package")
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as env:
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        ensure_tracking_store(uri)
        client = MlflowClient(tracking_uri=uri)
        experiment = client.create_experiment("tiny", (workdir / "artifacts").as_uri())
        run = client.create_run(experiment).info.run_id
        assert register_model(package, name, run, {}, "candidate", tracking_uri=uri) == 1
        client.set_terminated(run)


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


@pytest.mark.parametrize(
    "command",
    [["registry", "promote", MODEL, "9"], ["registry", "gate", MODEL, "--version", "9"]],
    ids=["promote", "gate"],
)
def test_a_version_the_model_lacks_is_named(command: list[str], demo_dir: Path) -> None:
    result = megalith(*command, cwd=demo_dir)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"error: {MODEL!r} has no version 9"), result.stderr
    assert "Traceback" not in result.stderr


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


@pytest.mark.parametrize("command", [PROMOTE, ["serve", "--model", f"models:/{MODEL}@champion"]])
def test_a_tracking_server_that_does_not_answer_fails_at_once(
    command: list[str], tmp_path: Path
) -> None:
    """MLflow's client alone would retry a refused connection for minutes."""
    server = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = megalith(*command, cwd=tmp_path, env={"MLFLOW_TRACKING_URI": server})
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"error: MLflow store {server} did not answer: ")
    assert "(from MLFLOW_TRACKING_URI)" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "launch",
    [[], ["--nproc-per-node", "2", "--set", "training.micro_batch_size=4"]],
    ids=["one process", "torchrun"],
)
def test_training_without_its_data_names_the_data_and_writes_nothing(
    launch: list[str], tmp_path: Path
) -> None:
    """The recipe's shards were never prepared here: one line naming them and what to run,
    before any run folder or MLflow run exists; with ``--nproc-per-node`` before torchrun
    starts a worker (a worker's failure printed a traceback, then waited 30 s for its
    peer to be stopped)."""
    recipe = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml"
    result = megalith("train", "--config", str(recipe), "--quiet", *launch, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr == (
        "error: work/demo/shards/manifest.json not found: the training data work/demo/shards "
        "is not a prepared shard set (run `megalith data prepare`, or `megalith demo` for the "
        "shipped corpus)\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_te_kernels_where_transformer_engine_is_missing_fail_before_any_run(
    tmp_path: Path,
) -> None:
    """``model.backend=te`` on a machine without Transformer Engine (CI's): refused before
    the data is read or an MLflow run is opened, naming the key and the way out."""
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    recipe = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.yaml"
    result = megalith(
        "train", "--config", str(recipe), "--set", "model.backend=te", "--quiet", cwd=tmp_path
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(
        "error: model.backend is 'te' but transformer_engine is not importable here"
    ), result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["demo"], ["ui"]])
@pytest.mark.parametrize("workdir", ["a-file", "a-file/below"])
def test_a_workdir_blocked_by_a_file_is_named(
    command: list[str], workdir: str, tmp_path: Path
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    if command == ["ui"]:  # ports nothing else holds: the folder is what must fail
        command = [*command, "--prefect-port", str(free_port()), "--mlflow-port", str(free_port())]
    result = megalith(*command, "--workdir", workdir, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    folder = tmp_path / workdir
    assert result.stderr == (
        f"error: --workdir {workdir}: cannot create the folder {folder}: a file is in the way\n"
    )


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--port", "99999", "a whole number from 1 to 65535"),
        ("--port", "0", "a whole number from 1 to 65535"),
        ("--max-tokens", "-1", "a whole number at least 1"),
        ("--max-batch-size", "0", "a whole number at least 1"),
        ("--max-queue", "0", "a whole number at least 1"),
        ("--timeout", "nan", "a number above 0"),
        ("--watch", "-1", "a number above 0"),
        ("--batch-window-ms", "inf", "a number at least 0"),
    ],
)
def test_serve_refuses_a_bad_number_naming_the_flag(
    flag: str, value: str, expected: str, tmp_path: Path
) -> None:
    result = megalith("serve", "--model", str(tmp_path), flag, value, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"argument {flag}: {value!r}: expected {expected}" in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_refuses_a_taken_port_before_loading(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = megalith("serve", "--model", "/no/such/package", "--port", str(port))
    assert result.returncode == 1, result.stderr
    assert result.stderr == (
        f"error: 127.0.0.1:{port} is taken: stop what listens there, or pick another port "
        "with --port\n"
    )


@pytest.mark.parametrize(
    ("store", "expected"),
    [
        ("PATH", "error: PATH is a file path; a SQLite store's URI is sqlite:///PATH (from"),
        ("sqlite:///PATH", "error: PATH is not an SQLite database (from"),
        ("nosuch://store", "error: MLflow store nosuch://store cannot be opened: "),
    ],
    ids=["path-without-scheme", "not-sqlite", "unknown-scheme"],
)
def test_a_store_that_is_not_one_is_named(store: str, expected: str, tmp_path: Path) -> None:
    not_a_store = tmp_path / "mlflow.db"
    not_a_store.write_text("these are my notes, not a database\n")
    store, expected = (text.replace("PATH", str(not_a_store)) for text in (store, expected))
    result = megalith(*PROMOTE, "--tracking-uri", store, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(expected), result.stderr
    assert "Traceback" not in result.stderr
    assert not_a_store.read_text() == "these are my notes, not a database\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


# --- serve-pipelines: a bad schedule or no Prefect server --------------------------


@pytest.mark.parametrize("cron", ["61 * * *", "0 3 32 * *", "daily"])
def test_serve_pipelines_refuses_a_bad_cron_naming_the_flag(cron: str, tmp_path: Path) -> None:
    api = f"http://127.0.0.1:{free_port()}/api"
    result = megalith(
        "serve-pipelines", "--finetune-cron", cron, cwd=tmp_path, env={"PREFECT_API_URL": api}
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"error: --finetune-cron {cron!r} is not a cron expression")
    assert "Traceback" not in result.stderr


def test_serve_pipelines_without_a_prefect_server_names_the_address(tmp_path: Path) -> None:
    api = f"http://127.0.0.1:{free_port()}/api"  # nothing listens there
    result = megalith("serve-pipelines", cwd=tmp_path, env={"PREFECT_API_URL": api})
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"error: no Prefect server answers at PREFECT_API_URL={api}")
    assert "Traceback" not in result.stderr


# --- stopping `megalith ui` stops every server it started ---------------------------


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def running(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
    return alive


@pytest.mark.parametrize("flag", ["--prefect-port", "--mlflow-port"])
def test_megalith_ui_refuses_a_taken_port_naming_the_flag(flag: str, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--prefect-port": str(free_port()), "--mlflow-port": str(free_port())}
        ports[flag] = str(port)
        arguments = [arg for pair in ports.items() for arg in pair]
        result = megalith("ui", "--workdir", str(tmp_path / "work"), *arguments, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"error: 127.0.0.1:{port} is taken"), result.stderr
    assert flag in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "work").exists()  # refused before anything was started or written


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "moment"),
    [
        (signal.SIGTERM, "serving"),
        (signal.SIGKILL, "serving"),
        (signal.SIGINT, "starting"),
        (signal.SIGHUP, "starting"),
    ],
    ids=["SIGTERM-serving", "SIGKILL-serving", "SIGINT-starting", "SIGHUP-starting"],
)
def test_a_signal_to_megalith_ui_stops_all_its_servers(
    signum: int, moment: str, tmp_path: Path
) -> None:
    """Caught signals: megalith ui stops its servers and exits 0. SIGKILL, which nobody
    catches: the watchdog it started (part of the tree checked) stops them. "serving":
    the signal comes once both servers answer; "starting": once both are started, while
    they still boot (Ctrl-C or a closed terminal right after launch)."""
    prefect_port, mlflow_port = free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_"))},
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONFAULTHANDLER": "1",  # SIGABRT dumps every thread's stack into the log
    }
    command = [*MEGALITH, "ui", "--workdir", str(tmp_path / "work"),
               "--prefect-port", str(prefect_port), "--mlflow-port", str(mlflow_port)]  # fmt: skip
    log = tmp_path / "ui.log"
    with log.open("w") as output:
        # A terminal's Ctrl-C reaches a process whose SIGINT is not ignored; pytest started
        # in the background (`cmd &` in a script) passes SIGINT ignored down to its children.
        ui = subprocess.Popen(
            command, env=env, stdout=output, stderr=output, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        urls = [
            f"http://127.0.0.1:{prefect_port}/api/health",
            f"http://127.0.0.1:{mlflow_port}/health",
        ]
        while not ready(moment, urls, log):
            assert ui.poll() is None, f"megalith ui exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"not {moment} after 180 s: {log.read_text()[-3000:]}"
            )
            time.sleep(0.5)
        tree = psutil.Process(ui.pid).children(recursive=True)
        assert len(tree) >= 3, tree  # the two servers and the watchdog, at least

        os.kill(ui.pid, signum)
        expected = -signal.SIGKILL if signum == signal.SIGKILL else 0
        assert exit_code(ui, log) == expected, log.read_text()[-3000:]
        deadline = time.monotonic() + 30
        while running(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [(p.pid, " ".join(p.cmdline())[:120]) for p in running(tree)]
        assert left == [], f"still running 30 s after megalith ui exited: {left}"
        assert not port_open(prefect_port) and not port_open(mlflow_port)
    finally:
        for process in running(tree):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        if ui.poll() is None:
            ui.kill()
        ui.wait()


def exit_code(ui: subprocess.Popen, log: Path, timeout_s: float = 60) -> int:
    """``ui``'s exit code; if it has not exited ``timeout_s`` after the signal, the stacks
    of its threads (faulthandler, on SIGABRT) in the failure, to show where it hangs."""
    try:
        return ui.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        ui.send_signal(signal.SIGABRT)
        ui.wait(timeout=30)
        pytest.fail(f"megalith ui still running {timeout_s:g} s after the signal:\n"
                    f"{log.read_text()[-6000:]}")  # fmt: skip


def ready(moment: str, urls: list[str], log: Path) -> bool:
    if moment == "starting":  # printed once both servers' processes are started
        return "Ctrl-C stops both." in log.read_text()
    return all(answers(url) for url in urls)
