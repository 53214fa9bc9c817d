"""MLflow tracking for training jobs: one run per job, logged from rank 0 only.

``open_run_logger`` is what the trainer calls. It returns a ``NullLogger`` on ranks
other than 0 and when tracking is off, and an ``MLflowRunLogger`` otherwise.

Tracking must never stop training. The logger hands every MLflow call to one
background thread, so a slow or dead tracking server cannot stall a step. A store that
cannot be reached at the start is reported once and the run trains untracked; one that
goes away mid-run is reported once, its records are kept (bounded) and sent when it
answers again, and the run is still ended FINISHED or FAILED (``MLflowRunLogger``).
Metrics are batched: one ``log_batch`` request per flush interval, not one per step.

MLflow is imported lazily: ranks that never log should not pay its ~2 s import.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import queue
import re
import subprocess
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from megalith import CODE_ROOT, __version__, safe_read
from megalith.config import LoggingConfig
from megalith.errors import MegalithError
from megalith.storage import atomic_write_json, sha256_of_file
from training.metrics.run_logger import NullLogger, RunLogger, read_metrics

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

log = logging.getLogger(__name__)

DB_FILE_NAME = "mlflow.db"
DEMO_WORKDIR = "work/demo"  # where `megalith demo` writes and `megalith ui` looks by default
ARTIFACTS_DIR_NAME = "mlartifacts"
PROBE_TIMEOUT_S = 5
FLUSH_INTERVAL_S = 1.0
CLOSE_TIMEOUT_S = 60.0
OPEN_RUN_FILE = ".mlflow-open-run.json"  # in a run folder: its MLflow run, until ended
RETRY_INTERVAL_S = 5.0  # between attempts while the store does not answer
REQUEST_RETRIES = 2  # MLflow's own retries of one request (its default is minutes of them)
REQUEST_TIMEOUT_S = 30
MAX_BACKLOG_METRICS = 200_000  # about 40 MB of metrics kept while the store is down
MAX_BACKLOG_CALLS = 1_000
SYSTEM_METRICS_INTERVAL_S = 10.0

# MLflow's limits (mlflow.utils.validation).
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100

# MLflow refuses keys with other characters; one bad key would fail a whole batch.
_UNSAFE_KEY_CHARS = re.compile(r"[^\w\-. /:]")

_created_stores: set[str] = set()
_said_no_system_metrics = False


# --- Where runs go ------------------------------------------------------------------


def resolve_tracking_uri(configured: str | None, workdir: str | Path | None = None) -> str:
    """``MLFLOW_TRACKING_URI`` wins, then the config's URI, then ``<workdir>/mlflow.db``."""
    from_env = os.environ.get("MLFLOW_TRACKING_URI")
    if from_env:
        return from_env
    if configured:
        return configured
    base = Path(workdir) if workdir is not None else Path.cwd()
    return f"sqlite:///{(base / DB_FILE_NAME).resolve()}"


def existing_store_uri(given: str | None, workdir: str | Path = DEMO_WORKDIR) -> str:
    """The store a command that reads the registry uses: ``given`` (its --tracking-uri),
    else as :func:`resolve_tracking_uri`. It must exist and answer now: a read that
    created an empty SQLite store would only report that the model does not exist, and
    MLflow's client would retry an absent server for minutes."""
    uri = given or resolve_tracking_uri(None, workdir)
    problem = _store_problem(uri)
    if problem is None:
        return uri
    if given or os.environ.get("MLFLOW_TRACKING_URI"):
        source = "--tracking-uri" if given else "MLFLOW_TRACKING_URI"
    else:
        source = f"WORKDIR/{DB_FILE_NAME}, where `megalith demo` writes; WORKDIR {workdir}"
    raise MegalithError(
        f"{problem} (from {source}); point to yours with --workdir DIR, --tracking-uri URI "
        "or MLFLOW_TRACKING_URI=URI"
    )


def _store_problem(uri: str) -> str | None:
    """Why ``uri`` is not an MLflow store that answers now; None when it is."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    db = sqlite_path(uri)
    if db is not None and not (db.is_file() and db.stat().st_size > 0):
        return f"no MLflow store at {db.resolve()}"
    if db is not None and not _is_sqlite(db):
        return f"{db.resolve()} is not an SQLite database"
    if "://" not in uri and uri.endswith(".db"):
        return f"{uri} is a file path; a SQLite store's URI is sqlite:///{Path(uri).resolve()}"
    server = uri.startswith(("http://", "https://"))
    try:
        if server:
            check_reachable(uri)  # one request, no retries
        else:
            MlflowClient(tracking_uri=uri, registry_uri=uri).search_registered_models(max_results=1)
    except (MlflowException, OSError, ImportError) as exc:  # ImportError: a missing DB driver
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return f"MLflow store {uri} {'did not answer' if server else 'cannot be opened'}: {cause}"
    return None


def _is_sqlite(path: Path) -> bool:
    with path.open("rb") as handle:
        return handle.read(16) == b"SQLite format 3\x00"


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, or None for other stores."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri.removeprefix("sqlite:///"))


def ensure_tracking_store(uri: str) -> None:
    """Create a SQLite store once, before any run is logged to it.

    Several processes creating the same fresh database race on its schema
    migrations, so creation happens under a file lock. Other stores need nothing.
    """
    db = sqlite_path(uri)
    if db is None or uri in _created_stores:
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    from mlflow import MlflowClient

    with _file_lock(db.with_name(f".{db.name}.lock")):
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        client.search_experiments(max_results=1)  # creates and migrates the tracking tables
        client.search_registered_models(max_results=1)
    _created_stores.add(uri)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    import fcntl

    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_reachable(uri: str) -> None:
    """Fail fast (one request, no retries) when an HTTP tracking server does not answer.

    MLflow's own client retries for minutes; this is what keeps an unreachable
    server from holding up the start of training.
    """
    if not uri.startswith(("http://", "https://")):
        return
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    response = http_request(
        get_default_host_creds(uri),
        "/api/2.0/mlflow/experiments/get-by-name",
        "GET",
        params={"experiment_name": "Default"},
        max_retries=0,
        timeout=PROBE_TIMEOUT_S,
    )
    if response.status_code >= 500:
        raise ConnectionError(f"{uri} answered HTTP {response.status_code}")


def get_or_create_experiment(client: MlflowClient, name: str, tracking_uri: str) -> str:
    """The experiment's id; new experiments on a SQLite store keep artifacts beside the db."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    db = sqlite_path(tracking_uri)
    location = (db.parent / ARTIFACTS_DIR_NAME).resolve().as_uri() if db is not None else None
    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:  # created meanwhile by another process
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


# --- Params, tags and lineage -------------------------------------------------------


def flatten_params(tree: Mapping[str, Any] | BaseModel, prefix: str = "") -> dict[str, str]:
    """Nested config → ``{"model.hidden_size": "512", ...}`` with MLflow-sized values.

    Lists of mappings get index keys (``data.blend.0.path``); other lists and all
    non-string scalars are written as JSON.
    """
    if isinstance(tree, BaseModel):
        tree = tree.model_dump(mode="json")
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json")
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, f"{name}."))
        elif _is_list_of_mappings(value):
            for index, item in enumerate(value):
                flat.update(flatten_params(item, f"{name}.{index}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            flat[name] = text[:MAX_PARAM_VALUE_LENGTH]
    return flat


def _is_list_of_mappings(value: Any) -> bool:
    return (
        isinstance(value, list | tuple)
        and bool(value)
        and all(isinstance(item, Mapping | BaseModel) for item in value)
    )


def _source_digest(url: str, storage_options: dict[str, Any] | None) -> str:
    """sha256 of a data source's manifest (or Megatron-LM ``.idx``); a missing one is named
    as the data it should be, before any run or output exists."""
    try:
        return sha256_of_file(url, storage_options)
    except FileNotFoundError:
        if url.endswith(".idx"):
            raise FileNotFoundError(
                f"{url} not found: no Megatron-LM indexed dataset at {url.removesuffix('.idx')}"
            ) from None
        root = url.rsplit("/", 1)[0]
        raise FileNotFoundError(
            f"{url} not found: the training data {root} is not a prepared shard set (run "
            "`megalith data prepare`, or `megalith demo` for the shipped corpus)"
        ) from None


def lineage_tags(
    manifests: Sequence[str] = (),
    tokenizer_id: str | None = None,
    code_version: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, str]:
    """Tags that say what a run was made from.

    ``manifests`` are dataset roots or ``manifest.json`` URLs (several for a blend,
    in blend order), or the ``.idx`` of a Megatron-LM prefix; the tokenizer id defaults to
    the first manifest's.
    """
    tags: dict[str, str] = {}
    urls = [
        m if m.endswith((".json", ".idx")) else m.rstrip("/") + "/manifest.json" for m in manifests
    ]
    if urls:
        tags["megalith.data.manifests"] = ",".join(urls)
        tags["megalith.data.manifest_sha256"] = ",".join(
            _source_digest(url, storage_options) for url in urls
        )
        if urls[0].endswith(".json"):
            tokenizer_id = tokenizer_id or _manifest_tokenizer_id(urls[0], storage_options)
        tags.update(curation_tags(urls, storage_options))
    if tokenizer_id:
        tags["megalith.tokenizer.id"] = tokenizer_id
    commit, dirty = git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
        commit = f"{commit}-dirty" if dirty else commit
    tags["megalith.code.version"] = code_version or commit or __version__
    return tags


def curation_tags(
    urls: Sequence[str], storage_options: dict[str, Any] | None = None
) -> dict[str, str]:
    """What curation did to each dataset whose manifest records it: documents in and out,
    documents per rule (``megalith.data.curation.removed.near_duplicate``, ...) and the
    curation config as JSON. With several datasets (a blend) the keys hold its place:
    ``megalith.data.1.curation...``."""
    tags: dict[str, str] = {}
    for index, url in enumerate(urls):
        if not url.endswith(".json"):
            continue
        manifest = safe_read.read_json(url, storage_options=storage_options, expect=dict)
        curation = safe_read.field(manifest, "curation", (dict, type(None)), url, default=None)
        if curation is None:
            continue
        prefix = "megalith.data.curation." if len(urls) == 1 else f"megalith.data.{index}.curation."
        for key in ("documents_in", "documents_out"):
            tags[prefix + key] = str(curation.get(key))
        for bucket in ("removed", "changed", "flagged"):
            counts = (curation.get(bucket) or {}).get("counts") or {}
            for rule, count in counts.items():
                tags[f"{prefix}{bucket}.{rule}"] = str(count)
        tags[prefix + "config"] = json.dumps(curation.get("config"), sort_keys=True)
    return tags


def _manifest_tokenizer_id(url: str, storage_options: dict[str, Any] | None) -> str | None:
    manifest = safe_read.read_json(url, storage_options=storage_options, expect=dict)
    tokenizer = safe_read.field(manifest, "tokenizer", dict, url, default={})
    return safe_read.field(tokenizer, "id", str, f"{url} (tokenizer)", default=None)


def git_commit() -> tuple[str | None, bool]:
    """``(commit, has uncommitted edits)`` of the checkout this code runs from, if it is one.

    An installed copy (site-packages) may sit inside some unrelated repository, so the
    repository must be the one whose top level holds this package.
    """
    repo = CODE_ROOT
    try:
        if Path(_git(repo, "rev-parse", "--show-toplevel")).resolve() != repo:
            return None, False
        commit = _git(repo, "rev-parse", "HEAD")
        dirty = bool(_git(repo, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None, False
    return commit, dirty


def _git(repo: Path, *args: str) -> str:
    result = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10, check=True
    )
    return result.stdout.strip()


def _safe_key(key: str) -> str:
    return _UNSAFE_KEY_CHARS.sub("_", key)[:250]


# --- The logger ---------------------------------------------------------------------


def open_run_logger(
    config: LoggingConfig,
    run_name: str | None,
    rank: int,
    *,
    workdir: str | Path | None = None,
    run_id: str | None = None,
    tags: Mapping[str, str] | None = None,
    system_metrics: bool = True,
    run_folder: str | Path | None = None,
) -> RunLogger:
    """The logger for one training job.

    ``run_id`` (or ``MLFLOW_RUN_ID``) hands over an existing run, e.g. one a parent
    flow created; such a run is left open on ``close``. Otherwise a new run starts in
    ``config.experiment``. Any failure to reach the store warns once and returns a
    ``NullLogger``: training goes on without tracking. With ``run_folder`` (held by
    this job, ``training.runtime.run_lock``) a run that an earlier job there left RUNNING (it
    was killed, or the store was down when it ended) is ended first (``OPEN_RUN_FILE``).
    """
    if rank != 0 or not config.mlflow:
        return NullLogger()
    uri = resolve_tracking_uri(config.tracking_uri, workdir)
    run_id = run_id or os.environ.get("MLFLOW_RUN_ID") or None
    try:
        logger = MLflowRunLogger.start(
            uri,
            experiment=config.experiment,
            run_name=run_name or config.run_name,
            run_id=run_id,
            tags=tags,
            system_metrics=system_metrics,
        )
    except Exception as error:  # noqa: BLE001 - tracking must never stop training
        log.warning(
            "MLflow tracking at %s is unavailable (%s); training continues without it", uri, error
        )
        return NullLogger()
    if run_folder is not None and logger.owns_run:
        logger.record_open_run(Path(run_folder) / OPEN_RUN_FILE)
    return logger


def end_run_left_open(record: Path, client: MlflowClient, tracking_uri: str) -> None:
    """End the run an earlier job recorded in ``record`` if it is still RUNNING: with the
    status it recorded when the store was down at its end, else KILLED (it never ended)."""
    source = str(record)
    try:
        left = safe_read.read_json(record, max_bytes=4096, allow_symlink=False, expect=dict)
        run_id = safe_read.field(left, "run_id", str, source)
        status = safe_read.field(left, "status", str, source, default="KILLED")
        uri = safe_read.field(left, "tracking_uri", str, source)
    except FileNotFoundError:
        return
    except MegalithError as error:
        log.warning("%s is unreadable (%s); ignored", record, error)
        return
    if uri != tracking_uri:
        log.warning("MLflow run %s at %s may still be RUNNING: this run tracks to %s",
                    run_id, uri, tracking_uri)  # fmt: skip
        return
    try:
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_terminated(run_id, status)
            log.warning("MLflow run %s of an earlier job in %s was left RUNNING; ended %s",
                        run_id, record.parent, status)  # fmt: skip
    except Exception as error:  # noqa: BLE001 - tracking must never stop training
        log.warning("MLflow run %s of an earlier job could not be ended (%s)", run_id, error)


_STOP = object()
_THREAD_NAME = "megalith-mlflow-logger"
_QUIET_THREADS = {_THREAD_NAME, "SystemMetricsMonitor"}


class _QuietThreads(logging.Filter):
    """Drops urllib3's per-retry warnings, and the system-metrics monitor's own warning
    when the store goes away, from the logging threads: the logger warns once itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName not in _QUIET_THREADS


logging.getLogger("urllib3.connectionpool").addFilter(_QuietThreads())
logging.getLogger("mlflow.system_metrics.system_metrics_monitor").addFilter(_QuietThreads())


def _bound_client_retries() -> None:
    """MLflow's client retries one request for minutes; the logger keeps a backlog and
    retries by itself, so each request gives up in seconds (unless the user set these)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(REQUEST_RETRIES))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(REQUEST_TIMEOUT_S))


def _shortened(text: str, limit: int = 200) -> str:
    """MLflow's connection errors repeat the URL and urllib3's whole retry story."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class _Backlog:
    """What the store has not taken yet, in order: metric lists and calls; bounded."""

    def __init__(self) -> None:
        self.items: deque[Any] = deque()
        self.metrics = 0
        self.calls = 0
        self.dropped = 0

    def __bool__(self) -> bool:
        return bool(self.items)

    def add(self, item: Any) -> bool:
        """Keep ``item``; False (and counted as dropped) when the backlog is full."""
        if isinstance(item, list):
            if self.metrics + len(item) > MAX_BACKLOG_METRICS:
                self.dropped += len(item)
                return False
            self.metrics += len(item)
            if self.items and isinstance(self.items[-1], list):
                self.items[-1].extend(item)  # one log_batch for consecutive steps
                return True
        else:
            if self.calls >= MAX_BACKLOG_CALLS:
                self.dropped += 1
                return False
            self.calls += 1
        self.items.append(item)
        return True

    def done(self, item: Any) -> None:
        self.items.popleft()
        if not isinstance(item, list):
            self.calls -= 1


class MLflowRunLogger:
    """A ``RunLogger`` that writes to one MLflow run through a background thread.

    When the store stops answering, the first failed call warns once and work is kept
    in order (``_Backlog``, bounded: metrics beyond ``MAX_BACKLOG_METRICS`` are dropped,
    metrics.jsonl has them all); every ``RETRY_INTERVAL_S`` the thread asks the server
    again and, once it answers, sends the backlog. ``close`` ends the run FINISHED or
    FAILED; a server still down then gets one warning naming the run, which stays
    RUNNING in MLflow.
    """

    def __init__(self, client: MlflowClient, run_id: str, tracking_uri: str, owns_run: bool):
        self.client = client
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.owns_run = owns_run
        self._queue: queue.Queue[Any] = queue.Queue()
        self._hurry = threading.Event()
        self._backlog = _Backlog()
        self._offline_since: float | None = None
        self._warned_full = False
        self._gave_up = False
        self._closed = False
        self._open_record: Path | None = None  # OPEN_RUN_FILE in the run folder
        self._system_monitor: Any = None
        self._thread = threading.Thread(target=self._work, name=_THREAD_NAME, daemon=True)
        self._thread.start()

    @classmethod
    def start(
        cls,
        tracking_uri: str,
        experiment: str = "megalith",
        run_name: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        system_metrics: bool = True,
    ) -> MLflowRunLogger:
        """Create a run (or take over ``run_id``); raises if the store cannot be reached."""
        from mlflow import MlflowClient

        _bound_client_retries()
        check_reachable(tracking_uri)
        ensure_tracking_store(tracking_uri)
        client = MlflowClient(tracking_uri=tracking_uri)
        owns_run = run_id is None
        if run_id is None:
            experiment_id = get_or_create_experiment(client, experiment, tracking_uri)
            run_id = client.create_run(experiment_id, run_name=run_name).info.run_id
        else:
            client.get_run(run_id)  # fails here, at start, if the run does not exist
        logger = cls(client, run_id, tracking_uri, owns_run=owns_run)
        if tags:
            logger.set_tags(dict(tags))
        if system_metrics:
            logger._start_system_metrics()
        return logger

    # RunLogger -------------------------------------------------------------------

    def log_params(self, params: Mapping[str, Any]) -> None:
        if not self._closed:
            flat = flatten_params(params)
            self._queue.put(lambda: self._send_params(flat))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self._closed:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(_safe_key(key), float(value), now, int(step))
            for key, value in metrics.items()
            if isinstance(value, numbers.Real)
        ]
        if batch:
            self._queue.put(batch)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self._closed:
            return
        local = str(path)
        if Path(local).is_dir():
            self._queue.put(lambda: self.client.log_artifacts(self.run_id, local, artifact_path))
        else:
            self._queue.put(lambda: self.client.log_artifact(self.run_id, local, artifact_path))

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if not self._closed:
            copied = dict(tags)
            self._queue.put(lambda: self._send_tags(copied))

    def close(self, status: str = "FINISHED") -> None:
        """Send what is left, end the run (only a run we started) and stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._stop_system_metrics()
        if self.owns_run:
            self._queue.put(lambda: self.client.set_terminated(self.run_id, status))
        self._queue.put(_STOP)
        self._hurry.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            self._give_up(f"still sending after {CLOSE_TIMEOUT_S:.0f} s")
        self._settle_open_record(status)

    def record_open_run(self, record: Path) -> None:
        """End a run an earlier job in this folder left RUNNING, then record this one
        until ``close`` has ended it."""
        end_run_left_open(record, self.client, self.tracking_uri)
        atomic_write_json(str(record), {"run_id": self.run_id, "tracking_uri": self.tracking_uri})
        self._open_record = record

    def _settle_open_record(self, status: str) -> None:
        """Ended: no record. Not ended (store down): the status the next job sets."""
        record, self._open_record = self._open_record, None
        if record is None:
            return
        try:
            if self._gave_up:
                left = {"run_id": self.run_id, "tracking_uri": self.tracking_uri, "status": status}
                atomic_write_json(str(record), left)
            else:
                record.unlink(missing_ok=True)
        except OSError as error:
            log.warning("%s: %s", record, error)

    def flush(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until everything logged so far is sent; False if it is not (yet)."""
        if self._closed:
            return not (self._gave_up or self._backlog)
        sent = threading.Event()
        self._queue.put(sent)
        self._hurry.set()
        done = sent.wait(timeout)
        if not self._closed:
            self._hurry.clear()
        return done and self._offline_since is None and not self._backlog

    def __enter__(self) -> MLflowRunLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self.close("FINISHED" if exc_type is None else "FAILED")

    # Extras ----------------------------------------------------------------------

    def log_loss_curve(self, metrics_jsonl_path: str | Path) -> Path | None:
        """Render ``loss_curve.png`` beside ``metrics.jsonl`` and log it under ``plots/``."""
        if self._closed:
            return None
        source = Path(metrics_jsonl_path)
        png = render_loss_curve(source, source.with_name("loss_curve.png"))
        self.log_artifact(png, "plots")
        return png

    @property
    def failed(self) -> bool:
        """Whether some of the run's records never reached the store."""
        return self._gave_up

    # The background thread -------------------------------------------------------

    def _work(self) -> None:
        while True:
            wait = RETRY_INTERVAL_S if self._offline_since is not None else None
            try:
                items = [self._queue.get(timeout=wait)]
            except queue.Empty:
                items = []
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            events = [item for item in items if isinstance(item, threading.Event)]
            for item in items:
                if not (isinstance(item, threading.Event) or item is _STOP):
                    self._keep(item)
            self._drain()
            for event in events:
                event.set()
            if _STOP in items:
                if self._backlog:
                    self._give_up("the server does not answer")
                return
            # At most one flush per interval, unless flush() or close() hurries it.
            self._hurry.wait(FLUSH_INTERVAL_S)

    def _keep(self, item: Any) -> None:
        if self._backlog.add(item) or self._warned_full:
            return
        self._warned_full = True
        log.warning(
            "MLflow run %s: %d metrics are waiting for %s; later ones are not kept "
            "(metrics.jsonl has every metric)",
            self.run_id,
            MAX_BACKLOG_METRICS,
            self.tracking_uri,
        )

    def _drain(self) -> None:
        """Send the backlog in order; at the first failure keep the rest and go offline."""
        if self._offline_since is not None and not self._answers():
            return
        while self._backlog:
            item = self._backlog.items[0]
            try:
                if isinstance(item, list):
                    self._send_metrics(item)
                else:
                    item()
            except Exception as error:  # noqa: BLE001 - tracking must never stop training
                self._go_offline(error)
                return
            self._backlog.done(item)
        if self._offline_since is not None:
            log.warning(
                "MLflow tracking to %s answers again after %.0f s; the kept records are sent",
                self.tracking_uri,
                time.monotonic() - self._offline_since,
            )
            self._offline_since = None

    def _answers(self) -> bool:
        """One quick request to an HTTP server; other stores are simply tried again."""
        try:
            check_reachable(self.tracking_uri)
        except Exception:  # noqa: BLE001 - still down
            return False
        return True

    def _go_offline(self, error: BaseException) -> None:
        if self._offline_since is not None:
            return
        self._offline_since = time.monotonic()
        log.warning(
            "MLflow tracking to %s failed (%s: %s); training continues, keeping up to %d "
            "metrics to send when it answers again",
            self.tracking_uri,
            type(error).__name__,
            _shortened(str(error)),
            MAX_BACKLOG_METRICS,
        )

    def _give_up(self, why: str) -> None:
        self._gave_up = True
        until = " until the next run in its folder ends it" if self._open_record else ""
        log.warning(
            "MLflow run %s at %s was not ended (%s): it stays RUNNING there%s, without %d "
            "metrics and %d other records; metrics.jsonl has every metric",
            self.run_id,
            self.tracking_uri,
            why,
            until,
            self._backlog.metrics,
            self._backlog.calls,
        )

    def _send_metrics(self, metrics: list[Metric]) -> None:
        """Send in chunks, removing each sent chunk, so a failure resends none of them."""
        while metrics:
            chunk = metrics[:MAX_METRICS_PER_BATCH]
            self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)
            del metrics[: len(chunk)]
            self._backlog.metrics -= len(chunk)

    def _send_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        # A param cannot change once logged; a handed-over run may already hold some.
        existing = self.client.get_run(self.run_id).data.params
        new = {_safe_key(k): v for k, v in params.items()}
        changed = sorted(k for k, v in new.items() if k in existing and existing[k] != v)
        if changed:
            log.warning("MLflow run %s keeps its earlier values of %s", self.run_id, changed)
        items = [Param(k, v) for k, v in new.items() if k not in existing]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            chunk = items[start : start + MAX_PARAMS_TAGS_PER_BATCH]
            self.client.log_batch(self.run_id, params=chunk, synchronous=True)

    def _send_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(_safe_key(k), str(v)[:MAX_TAG_VALUE_LENGTH]) for k, v in tags.items()]
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            chunk = items[start : start + MAX_PARAMS_TAGS_PER_BATCH]
            self.client.log_batch(self.run_id, tags=chunk, synchronous=True)

    def _start_system_metrics(self) -> None:
        global _said_no_system_metrics
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        except ImportError as error:  # psutil is not a dependency of mlflow
            if not _said_no_system_metrics:
                log.warning("System metrics are off: %s (pip install psutil)", error)
                _said_no_system_metrics = True
            return
        self._system_monitor = SystemMetricsMonitor(
            self.run_id,
            sampling_interval=SYSTEM_METRICS_INTERVAL_S,
            tracking_uri=self.tracking_uri,
        )
        self._system_monitor.start()

    def _stop_system_metrics(self) -> None:
        monitor, self._system_monitor = self._system_monitor, None
        # Its finish() waits without a limit; with the store gone its thread ends by itself.
        if monitor is not None and self._offline_since is None:
            monitor.finish()


# --- Loss curve ---------------------------------------------------------------------


def render_loss_curve(metrics_jsonl_path: str | Path, png_path: str | Path) -> Path:
    """Plot training loss (and validation loss, if logged) against step into a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_jsonl_path)
    figure = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for key, label in (("loss", "train loss"), ("val_loss", "validation loss")):
        points = [(r["step"], r[key]) for r in records if "step" in r and r.get(key) is not None]
        if points:
            steps, values = zip(*points, strict=True)
            axes.plot(steps, values, label=label, marker="o" if key == "val_loss" else None)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.grid(alpha=0.3)
    if axes.lines:
        axes.legend()
    out = Path(png_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    return out


def log_evaluation(
    run_id: str,
    metrics: Mapping[str, float],
    report_path: str | Path,
    tracking_uri: str | None = None,
) -> None:
    """Attach an evaluation to a finished training run: ``eval.*`` metrics and the report."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    uri = resolve_tracking_uri(tracking_uri)
    client = MlflowClient(tracking_uri=uri)
    timestamp = int(time.time() * 1000)
    client.log_batch(
        run_id,
        metrics=[
            Metric(f"eval.{_safe_key(k)}", float(v), timestamp, 0) for k, v in metrics.items()
        ],
    )
    client.log_artifact(run_id, str(report_path), artifact_path="evaluation")
