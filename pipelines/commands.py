"""``megalith demo``, ``megalith serve-pipelines``, ``megalith deploy-pipelines`` and
``megalith ui``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from deploy.cli import PORT, require_free_port
from megalith.errors import MegalithError
from pipelines import group_watchdog
from pipelines.recipes import (
    DEMO_RECIPE,
    FINETUNE_CRON,
    FINETUNE_RECIPE,
    check_finetune_cron,
    demo_config,
)
from training.mlflow_store.runs import DEMO_WORKDIR

PREFECT_PORT = 4200
PREFECT_URL = f"http://127.0.0.1:{PREFECT_PORT}"
MLFLOW_PORT = 5000
# Prefect 3.8.8's telemetry heartbeat reads, then inserts its session row in one DEFERRED
# SQLite transaction (prefect/server/services/telemetry.py). On a fresh database that
# insert races the first flow run's inserts and fails at once with "database is locked"
# (busy_timeout cannot help an upgrade from a stale read), printing a ~90-line traceback
# although nothing else fails. Servers we start run without it unless the user says so.
# The temporary server of a first run creates its database (every migration) before it
# answers: on a busy two-core machine that took longer than Prefect's 20 s limit, and the
# demo failed with "Timed out while attempting to connect to ephemeral Prefect API server".
QUIET_PREFECT_SERVER = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
}


# Handlers import the heavy stage modules (torch, mlflow, prefect) when they run, so that
# `megalith --help` and a bad flag answer at once.
def register(subcommands: argparse._SubParsersAction) -> None:
    demo = subcommands.add_parser(
        "demo",
        help="run the end-to-end pipeline on the shipped corpus (CPU, a few minutes)",
        description="Tokenize the shipped sample corpus, pretrain a tiny GPT (or the recipe's "
        "model), evaluate it and register it in MLflow as @candidate, all through the Prefect `end-to-end` flow. "
        "MLflow: MLFLOW_TRACKING_URI, else WORKDIR/mlflow.db. Prefect: PREFECT_API_URL, else "
        f"a server on {PREFECT_URL} if one runs, else a temporary local one.",
    )
    demo.add_argument(
        "--workdir", default=DEMO_WORKDIR, help=f"where everything goes (default {DEMO_WORKDIR})"
    )
    demo.add_argument(
        "--config", default=str(DEMO_RECIPE), metavar="YAML", help="recipe (default tiny-cpu)"
    )
    demo.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    demo.set_defaults(handler=_demo)

    serve = subcommands.add_parser(
        "serve-pipelines",
        help="serve the flows as Prefect deployments (trigger them from the UI)",
        description="Serve tokenize-corpus, pretrain, evaluate, register-model, promote-model, end-to-end, "
        "cluster-train and the scheduled finetune as "
        "deployments with forms in the Prefect UI. Needs a Prefect server: start one with "
        "`megalith ui` (or `prefect server start`).",
    )
    serve.add_argument(
        "--workdir",
        default=DEMO_WORKDIR,
        help="default work directory in the forms; the flows log to WORKDIR/mlflow.db (or "
        f"MLFLOW_TRACKING_URI), the store `megalith ui` shows (default {DEMO_WORKDIR})",
    )
    serve.add_argument(
        "--finetune-cron",
        default=FINETUNE_CRON,
        metavar="CRON",
        help=f"schedule of the recurring finetune deployment (default '{FINETUNE_CRON}': "
        "daily at 03:00; '' for none)",
    )
    serve.add_argument(
        "--finetune-data",
        metavar="DIR_OR_URL",
        help="where new chat .jsonl files arrive (default WORKDIR/incoming-chat; s3:// works)",
    )
    serve.add_argument(
        "--finetune-config",
        default=str(FINETUNE_RECIPE),
        metavar="YAML",
        help="the fine-tune recipe (default configs/finetune-chat-tiny.yaml)",
    )
    serve.set_defaults(handler=_serve)

    deploy = subcommands.add_parser(
        "deploy-pipelines",
        help="register the flows to a Prefect work pool (run by `prefect worker start`)",
        description="Create work pool POOL unless it exists (with megalith's job variables "
        "nodes, gpus_per_node, image, beside Prefect's env) and register the deployments of "
        "serve-pipelines to it (cluster-train offers the cluster target and its size); a "
        "worker runs them: `prefect worker start --pool POOL` (a kubernetes pool's worker "
        "needs prefect-kubernetes). The "
        "flows are named by module path (pipelines.flows.pretrain), so the worker's machine "
        "or image needs megalith installed, not this folder. Needs a Prefect server "
        "(`megalith ui`, or PREFECT_API_URL). Example: megalith deploy-pipelines --pool "
        "gpu-box; prefect worker start --pool gpu-box. See docs/multi-node.md.",
    )
    deploy.add_argument("--pool", required=True, metavar="NAME", help="the work pool")
    deploy.add_argument(
        "--pool-type",
        choices=["process", "kubernetes"],  # pipelines.work_pools.POOL_TYPES
        default="process",
        help="process: runs start as processes on the worker's machine (default); "
        "kubernetes: each run in a pod (the pool's template is in docs/multi-node.md)",
    )
    deploy.add_argument(
        "--workdir",
        default=DEMO_WORKDIR,
        help="default work directory in the forms; a process pool's runs log to "
        f"WORKDIR/mlflow.db (or MLFLOW_TRACKING_URI) (default {DEMO_WORKDIR})",
    )
    deploy.add_argument(
        "--image", metavar="IMAGE", help="job variable image of every deployment (kubernetes)"
    )
    deploy.set_defaults(handler=_deploy)

    ui = subcommands.add_parser(
        "ui",
        help="start the Prefect UI and the MLflow UI on localhost",
        description=f"Start `prefect server start` on {PREFECT_URL} and `mlflow ui` on "
        f"http://127.0.0.1:{MLFLOW_PORT} for WORKDIR/mlflow.db (or MLFLOW_TRACKING_URI). Ctrl-C "
        "or SIGTERM stops both, with every process they started; if `megalith ui` is killed "
        "outright (SIGKILL), a small watchdog it started stops them.",
    )
    ui.add_argument(
        "--workdir", default=DEMO_WORKDIR, help=f"whose mlflow.db to show (default {DEMO_WORKDIR})"
    )
    ui.add_argument("--prefect-port", type=PORT, default=PREFECT_PORT)
    ui.add_argument("--mlflow-port", type=PORT, default=MLFLOW_PORT)
    ui.set_defaults(handler=_ui)


def work_folder(value: str) -> Path:
    """--workdir as an absolute folder, created if missing."""
    workdir = Path(value).resolve()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise MegalithError(
            f"--workdir {value}: cannot create the folder {workdir}: a file is in the way"
        ) from None
    return workdir


def use_local_services(workdir: Path) -> None:
    """Point MLflow at WORKDIR/mlflow.db and Prefect at a local server when one runs."""
    from training.mlflow_store.runs import ensure_tracking_store, resolve_tracking_uri

    # Assigned, not defaulted: an empty MLFLOW_TRACKING_URI would send runs to ./mlflow.db.
    os.environ["MLFLOW_TRACKING_URI"] = resolve_tracking_uri(None, workdir)
    ensure_tracking_store(os.environ["MLFLOW_TRACKING_URI"])
    os.environ.update({k: v for k, v in QUIET_PREFECT_SERVER.items() if k not in os.environ})
    if "PREFECT_API_URL" not in os.environ and _healthy(f"{PREFECT_URL}/api/health"):
        os.environ["PREFECT_API_URL"] = f"{PREFECT_URL}/api"


def _demo(args: argparse.Namespace) -> int:
    workdir = work_folder(args.workdir)
    config = demo_config(args.config, workdir, args.set)
    use_local_services(workdir)
    from pipelines.flows import end_to_end

    started = time.perf_counter()
    result = end_to_end(config, str(workdir))
    _print_demo_summary(result, workdir, time.perf_counter() - started)
    return 0


def _print_demo_summary(result: dict, workdir: Path, seconds: float) -> None:
    training, evaluation = result["training"], result["evaluation"]
    metrics = evaluation["metrics"]
    print(f"\nend-to-end finished in {seconds:.0f} s (work directory {workdir})")
    print(
        f"  data        {result['shards']['documents']:,} documents, {result['shards']['tokens']:,} tokens"
    )
    print(
        f"  training    {training['steps']} steps, loss {training['final_loss']:.3f}, {training['tokens_per_s']:,.0f} tokens/s"
    )
    for key, value in metrics.items():
        print(f"  eval        {key} = {value:.4g}")
    for sample in evaluation.get("generations", [])[:3]:
        print(f"  sample      {sample['prompt']!r} → {sample['text'][:100]!r}")
    registration = result.get("registration")
    if registration:
        print(f"  registered  {registration['uri']} (version {registration['version']})")
    print(
        f"  MLflow      {os.environ['MLFLOW_TRACKING_URI']}   (browse: megalith ui --workdir {workdir})"
    )


def _require_prefect_server() -> None:
    """PREFECT_API_URL, else the local server of `megalith ui` if it answers."""
    if "PREFECT_API_URL" not in os.environ:
        if not _healthy(f"{PREFECT_URL}/api/health"):
            raise MegalithError(
                f"no Prefect server at {PREFECT_URL}: start one with `megalith ui` "
                "(or `prefect server start`), or set PREFECT_API_URL"
            )
        os.environ["PREFECT_API_URL"] = f"{PREFECT_URL}/api"


def _no_server(exc: Exception) -> MegalithError:
    return MegalithError(
        f"no Prefect server answers at PREFECT_API_URL={os.environ['PREFECT_API_URL']} "
        f"({exc}): start one with `megalith ui`, or correct PREFECT_API_URL"
    )


def _serve(args: argparse.Namespace) -> int:
    _require_prefect_server()
    check_finetune_cron(args.finetune_cron or None)
    import httpx

    from pipelines.deployments import FinetuneSchedule, serve_all
    from training.mlflow_store.runs import resolve_tracking_uri

    workdir = Path(args.workdir).resolve()  # the flows create it when they run
    # The flows (run in processes this one starts) log and look up models in the store
    # that `megalith ui`, `serve` and `registry` use, not in a ./mlflow.db of their own.
    os.environ["MLFLOW_TRACKING_URI"] = resolve_tracking_uri(None, workdir)
    schedule = FinetuneSchedule(
        cron=args.finetune_cron or None,
        data_location=args.finetune_data or str(workdir / "incoming-chat"),
        recipe=args.finetune_config,
    )
    print(f"MLflow: {os.environ['MLFLOW_TRACKING_URI']}", flush=True)
    try:
        serve_all(workdir, schedule)
    except httpx.ConnectError as exc:
        raise _no_server(exc) from None
    return 0


def _deploy(args: argparse.Namespace) -> int:
    _require_prefect_server()
    import httpx

    from pipelines.deployments import PoolPlacement, deploy_to_pool
    from pipelines.work_pools import ensure_pool
    from training.mlflow_store.runs import resolve_tracking_uri

    workdir = Path(args.workdir).resolve()
    job_variables: dict = {}
    if args.pool_type == "process":  # the runs share this machine's store
        job_variables["env"] = {"MLFLOW_TRACKING_URI": resolve_tracking_uri(None, workdir)}
    if args.image:
        job_variables["image"] = args.image
    try:
        created, missing = ensure_pool(args.pool, args.pool_type)
        ids = deploy_to_pool(workdir, PoolPlacement(args.pool, job_variables))
    except httpx.ConnectError as exc:
        raise _no_server(exc) from None
    print(f"work pool {args.pool} ({args.pool_type}): {'created' if created else 'exists, kept'}")
    if missing:
        print(
            f"warning: work pool {args.pool} has no job variable {', '.join(missing)}: its "
            "runs take the cluster size from the run form only (delete the pool and run "
            "this again for megalith's template)"
        )
    print(f"{len(ids)} deployments in it: {', '.join(ids)}")
    extra = " (pip install prefect-kubernetes first)" if args.pool_type == "kubernetes" else ""
    print(f"start a worker{extra}:  prefect worker start --pool {args.pool}", flush=True)
    return 0


def _ui(args: argparse.Namespace) -> int:
    from training.mlflow_store.runs import ensure_tracking_store, resolve_tracking_uri

    require_free_port("127.0.0.1", args.prefect_port, "--prefect-port")
    require_free_port("127.0.0.1", args.mlflow_port, "--mlflow-port")
    tracking = resolve_tracking_uri(None, work_folder(args.workdir))
    ensure_tracking_store(tracking)
    prefect_url = f"http://127.0.0.1:{args.prefect_port}"
    commands = _ui_servers(args.prefect_port, args.mlflow_port, tracking)
    # SIGTERM (`kill`, systemd, a container stop) and SIGHUP (its terminal closed) end the
    # UI as Ctrl-C does; the servers, in process groups of their own, get neither.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    servers: dict[str, subprocess.Popen] = {}
    watchdog = _start_watchdog()
    try:
        for name, (command, env) in commands.items():
            # Each server leads its own process group: stopping it stops its workers too.
            servers[name] = subprocess.Popen(command, env=env, process_group=0)
            _tell(watchdog, str(servers[name].pid))
        print(f"Prefect UI  {prefect_url}   (export PREFECT_API_URL={prefect_url}/api)")
        print(f"MLflow UI   http://127.0.0.1:{args.mlflow_port}   ({tracking})")
        print("Ctrl-C stops both.", flush=True)
        while all(server.poll() is None for server in servers.values()):
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # none may cut cleanup
            signal.signal(signum, signal.SIG_IGN)
        died = [(name, s.returncode) for name, s in servers.items() if s.poll() is not None]
        stop_process_groups(list(servers.values()))
        _dismiss(watchdog)
    if died:
        raise MegalithError(f"the {died[0][0]} server stopped by itself (exit code {died[0][1]})")
    return 0


def _ui_servers(
    prefect_port: int, mlflow_port: int, tracking: str
) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Name -> (command, environment) of the servers `megalith ui` runs."""
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        # the UI's pages call this address
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{prefect_port}/api",
    }
    env.update({k: v for k, v in QUIET_PREFECT_SERVER.items() if k not in os.environ})
    return {
        "Prefect": ([str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1",
                     "--port", str(prefect_port)], env),
        "MLflow": ([str(bin_dir / "mlflow"), "ui", "--backend-store-uri", tracking,
                    "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"],
                   {**env, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}),
    }  # fmt: skip


def _start_watchdog() -> subprocess.Popen:
    """The process that stops the servers' groups if this one dies without doing so
    (SIGKILL, the OOM killer): :mod:`pipelines.group_watchdog`. In a group of its own, so
    a terminal's Ctrl-C or hangup reaches only `megalith ui`."""
    command = [sys.executable, "-m", "pipelines.group_watchdog"]
    return subprocess.Popen(command, stdin=subprocess.PIPE, text=True, process_group=0)


def _tell(watchdog: subprocess.Popen, line: str) -> None:
    with contextlib.suppress(OSError):  # it died: nothing to tell, nothing it can do
        watchdog.stdin.write(f"{line}\n")
        watchdog.stdin.flush()


def _dismiss(watchdog: subprocess.Popen) -> None:
    """The servers are stopped: the watchdog ends without touching their groups."""
    _tell(watchdog, group_watchdog.DONE)
    with contextlib.suppress(OSError):
        watchdog.stdin.close()
    watchdog.wait()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_process_groups(leaders: list[subprocess.Popen], grace_s: float = 15) -> None:
    """SIGTERM to each leader's process group; SIGKILL to whatever of a group is left
    ``grace_s`` later (or once its leader has exited: its workers would be orphans)."""
    for leader in leaders:
        group_watchdog.signal_group(leader.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for leader in leaders:
        with contextlib.suppress(subprocess.TimeoutExpired):
            leader.wait(timeout=max(0.1, deadline - time.monotonic()))
    for leader in leaders:
        group_watchdog.signal_group(leader.pid, signal.SIGKILL)
        leader.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:  # noqa: S310 - loopback URL
            return response.status == 200
    except OSError:
        return False
