"""Where the per-document work of ``data prepare`` and ``data curate`` runs: the engine.

Both stages cut the corpus into jobs (a batch of documents, in input order), send each
to a pure function ``task(context, job)`` (tokenize a batch; apply the curation rules
that need no other document), and consume the results **in submission order** on the
driver, which keeps everything whose result depends on order (shard files, duplicate
decisions, tallies). So the output depends only on the jobs, never on which worker ran
one or when: every engine and worker count writes the same bytes.

* ``local`` (default): ``data.workers`` processes on this machine (``OrderedPool``); one
  worker for curation runs in this process.
* ``ray``: Ray Data's ``map_batches`` over the nodes of a Ray cluster (``data.ray_address``
  or ``$RAY_ADDRESS``), with ``preserve_order``. The driver sends jobs a window at a time
  (``RayOrderedMap``), so memory stays bounded for any corpus; the context (a tokenizer,
  the rules and the evaluation n-grams) is put in the object store once and loaded once
  per worker process.

A worker that dies or raises fails the run with ``WorkerError`` naming the jobs it held;
the writers' temp-then-rename leaves nothing partial looking complete.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import re
import sys
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from megalith.config import DataConfig
from megalith.errors import MegalithError
from megalith.ray_cluster import connected, import_ray

Task = Callable[[Any, Any], Any]  # (context, job) -> result; a module-level function
Describe = Callable[[list[Any]], str]  # names the documents a list of jobs holds

_context: Any = None  # in a local worker process: the task's context
_cached: tuple[str, Any] | None = None  # in a Ray worker process: (object id, context)


class WorkerError(MegalithError):
    """A worker process died (killed by the OS, out of memory...) or a Ray task failed."""


class Engine(Protocol):
    nodes: set[str]  # Ray node ids that ran work (empty for the local engine)

    def submit(self, job: Any) -> Iterator[Any]: ...
    def drain(self) -> Iterator[Any]: ...


# --------------------------------------------------------------------------- local


def _init_worker(context: Any) -> None:
    global _context
    _context = context  # unpickled: rebuilt in this process


def _run_local(task: Task, job: Any) -> Any:
    return task(_context, job)


def _warm_up() -> None:
    pass


def _unguarded_script_hint() -> str:
    """Where the run was started from a plain Python script: the other way workers die at
    start. Spawned workers import the script again, and one that starts this work at
    import time fails in each of them."""
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script is None or getattr(main, "__spec__", None) is not None:  # python -m, REPL
        return ""
    try:  # a guarded script (console-script wrappers, `megalith` among them) is fine
        if "__main__" in Path(script).read_text(encoding="utf-8", errors="replace"):
            return ""
    except OSError:
        return ""
    return (
        f" Or {script} starts this work when imported, which each spawned worker repeats:"
        ' call it under `if __name__ == "__main__":` there.'
    )


class OrderedPool:
    """A process pool that returns results in submission order with bounded work in flight.

    ``Pool.imap`` would read the whole input ahead of the workers; bounding the queue
    keeps memory flat for any corpus size. A worker that dies (the OS kills it when
    memory runs out) fails the run with ``WorkerError``; ``multiprocessing.Pool``
    would wait forever for the lost batch instead.
    """

    def __init__(self, workers: int, task: Task, context: Any, what: str = "tokenizer"):
        if getattr(multiprocessing.current_process(), "_inheriting", False):
            # A spawned worker still importing the user's script (the check CPython's own
            # spawn makes, made before the pool's queues exist: a worker that dies holding
            # them leaves the resource tracker warning after the run's own error).
            raise WorkerError(
                f"a {what} worker, importing the script that started the run, was asked to "
                "start a pool of its own: put that script's work under `if __name__ == "
                '"__main__":`'
            )
        self.task = task
        self.what = what
        self.nodes: set[str] = set()
        self.pool = ProcessPoolExecutor(
            workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(context,),
        )
        self.pending: deque = deque()
        self.limit = 2 * workers + 2
        # The executor starts processes only when work arrives: send each a no-op now.
        for _ in range(workers):
            self.pool.submit(_warm_up)

    def submit(self, job: Any) -> Iterator[Any]:
        try:
            self.pending.append(self.pool.submit(_run_local, self.task, job))
        except BrokenProcessPool as exc:
            raise self._broken(exc) from None
        while len(self.pending) >= self.limit:
            yield self._next()

    def drain(self) -> Iterator[Any]:
        while self.pending:
            yield self._next()

    def _next(self) -> Any:
        try:
            return self.pending.popleft().result()
        except BrokenProcessPool as exc:
            raise self._broken(exc) from None

    def _broken(self, exc: BrokenProcessPool) -> WorkerError:
        return WorkerError(
            f"a {self.what} worker process died ({exc}); killed for lack of memory?"
            f"{_unguarded_script_hint()} Rerun the same command to resume: complete work "
            "is kept"
        )

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> OrderedPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class InProcess:
    """The jobs run here, one after another: no process to start for one worker."""

    def __init__(self, task: Task, context: Any):
        self.task = task
        self.context = context
        self.nodes: set[str] = set()

    def submit(self, job: Any) -> Iterator[Any]:
        yield self.task(self.context, job)

    def drain(self) -> Iterator[Any]:
        return iter(())


# --------------------------------------------------------------------------- ray


class _Boxed:
    """One job or result in a Ray Data row: an opaque Python object column (Ray Data
    pickles it), so jobs of any shape need no Arrow schema."""

    def __init__(self, value: Any):
        self.value = value


def _context_in_worker(key: str, holder: list[Any]) -> Any:
    global _cached
    if _cached is None or _cached[0] != key:
        _cached = (key, import_ray().get(holder[0]))  # once per worker process and run
    return _cached[1]


def _ray_batch(batch: dict[str, np.ndarray], task: Task, key: str, holder: list) -> dict:
    context = _context_in_worker(key, holder)
    node = import_ray().get_runtime_context().get_node_id()
    results = [_Boxed((node, task(context, boxed.value))) for boxed in batch["job"]]
    column = np.empty(len(results), dtype=object)
    column[:] = results
    return {"result": column}


class RayOrderedMap:
    """Ray Data ``map_batches`` over a window of jobs at a time, results in job order.

    Two windows run at once: while the driver waits for one window's results, the next
    one (already read) executes, so Ray Data's start-up per window overlaps work."""

    def __init__(self, task: Task, context: Any, describe: Describe, window: int = 0):
        ray = import_ray()
        self.ray = ray
        settings = ray.data.DataContext.get_current()
        settings.execution_options.preserve_order = True
        settings.enable_progress_bars = False
        settings.print_on_execution_start = False
        # One INFO line per window, and a warning that jobs are stored as Python objects.
        logging.getLogger("ray.data").setLevel(logging.ERROR)
        self.task = task
        self.describe = describe
        self.holder = [ray.put(context)]
        self.key = self.holder[0].hex()
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.window = window or max(16, 8 * cpus)
        self.jobs: list[Any] = []
        self.nodes: set[str] = set()
        self.running: deque[Future] = deque()
        self.threads = ThreadPoolExecutor(2, thread_name_prefix="ray-window")

    def submit(self, job: Any) -> Iterator[Any]:
        self.jobs.append(job)
        if len(self.jobs) >= self.window:
            self._launch()
            while len(self.running) > 1:  # keep the newest window running
                yield from self._collect()

    def drain(self) -> Iterator[Any]:
        if self.jobs:
            self._launch()
        while self.running:
            yield from self._collect()

    def close(self) -> None:
        self.threads.shutdown(wait=True, cancel_futures=True)

    def _launch(self) -> None:
        jobs, self.jobs = self.jobs, []
        self.running.append(self.threads.submit(self._execute, jobs))

    def _collect(self) -> Iterator[Any]:
        nodes, results = self.running.popleft().result()  # re-raises a window's WorkerError
        self.nodes |= nodes
        yield from results

    def _execute(self, jobs: list[Any]) -> tuple[set[str], list[Any]]:
        rows = self.ray.data.from_items(
            [{"job": _Boxed(job)} for job in jobs], override_num_blocks=len(jobs)
        ).map_batches(
            _ray_batch,
            fn_kwargs={"task": self.task, "key": self.key, "holder": self.holder},
            batch_size=1,
            batch_format="numpy",
            num_cpus=1,
        )
        nodes, results = set(), []
        try:
            for row in rows.iter_rows():
                node, result = row["result"].value
                nodes.add(node)
                results.append(result)
        except Exception as error:  # a task that raised, a lost worker or node
            raise WorkerError(
                f"Ray workers failed on {self.describe(jobs)}: {_first_line(error)}; "
                "nothing of it was published: rerun the same command"
            ) from None
        return nodes, results


_RAISED = re.compile(r"^(?!ray\.)[\w.]*(Error|Exception)\b[^:\n]*: .*$", re.MULTILINE)


def _first_line(error: BaseException) -> str:
    """The task's own exception: Ray wraps it (RayTaskError, UserCodeException) and keeps
    it only as text, the first ``SomethingError: message`` line of the traceback."""
    raised = _RAISED.search(str(error))
    if raised:
        return raised.group(0)
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


# --------------------------------------------------------------------------- choosing


def where(data: DataConfig, nodes: list[str]) -> str:
    """Where a run's per-document work ran, for the command line."""
    if data.engine == "ray":
        return f"Ray Data on {len(nodes)} node(s)"
    return f"{data.workers} worker process(es)"


@contextlib.contextmanager
def open_engine(
    data: DataConfig,
    task: Task,
    context: Any,
    describe: Describe,
    what: str,
    in_process_when_one: bool = False,
) -> Iterator[Engine]:
    """The engine ``data.engine`` names, ready for jobs; closed (and disconnected) after."""
    if data.engine == "ray":
        with connected(data.ray_address):
            engine = RayOrderedMap(task, context, describe)
            try:
                yield engine
            finally:
                engine.close()
    elif data.workers == 1 and in_process_when_one:
        yield InProcess(task, context)
    else:
        with OrderedPool(data.workers, task, context, what) as pool:
            yield pool
