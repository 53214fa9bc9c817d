"""The engine in a process of its own, so that the decode loop and the HTTP event loop no
longer share one GIL (``megalith serve --engine-process``).

In one process the engine's thread (a step's kernel launches, sampling, bookkeeping) and
the event loop (each token's text, its SSE chunk, the socket write) take turns on one
interpreter: on an H100 the server used 100-112% of one core at every load while the
engine alone, without HTTP, ran 1.8x faster (benchmarks/RESULTS.md). Here the parent keeps
the HTTP side and the request's callbacks; a child process (``spawn``) owns the model on
its device and runs the same engine (``make_engine``). They talk over one pipe:

- parent -> child: ``("submit", id, prompt_ids, sampling, deadline)``, ``("cancel", id)``
  (a stream whose client left, or a stop string: the parent watches each request's
  ``cancelled`` flag), ``("retire",)``;
- child -> parent: ``("events", [(id, SampledToken | Finished | error message), ...],
  stats)``: everything the engine produced since the last message, so one message (one
  wake-up of the parent) carries a whole step's tokens; ``stats`` is the engine's counters.

The parent's :class:`ProcessEngine` has the engines' interface (``submit``, ``retire``,
``join``, ``queued``, ``running``, ``stats``, ``kv_stats``, ``served``), so a
:class:`deploy.deployment.Deployment` swaps process engines on reload as it swaps threads.
Deadlines are ``time.monotonic()`` values, the same clock in both processes. If the child
dies, every request it held ends with an error and the engine counts as closed. The pipe
carries pickles between the server and the child it started, never bytes from outside.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the tensor reductions spawn pickles with)

from deploy.continuous import ContinuousEngine
from deploy.engine import BatchingEngine, EngineBusy, EngineClosed, Finished, PendingRequest
from training.inference.decode import SampledToken
from training.inference.loading import ServedModel

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.02  # how often the parent looks for cancelled requests
Engine = BatchingEngine | ContinuousEngine


@dataclass(frozen=True)
class EngineSpec:
    """Which engine to build and how: ``kind`` continuous or static, its ``options``
    (``megalith serve``'s flags, by the engines' argument names), its precision and device."""

    kind: str
    options: dict[str, Any]
    autocast_dtype: torch.dtype | None = None
    device: torch.device = torch.device("cpu")

    def continuous(self, served: ServedModel) -> bool:
        """Continuous batching for a GPT unless ``kind`` is static; a T5 is served statically."""
        return self.kind == "continuous" and not served.seq2seq


def make_engine(served: ServedModel, spec: EngineSpec) -> Engine:
    """The engine ``megalith serve`` runs, not started."""
    options = spec.options
    if spec.continuous(served):
        keys = (
            "block_size", "num_blocks", "max_running", "prefill_chunk", "cuda_graphs", "max_queue"
        )  # fmt: skip
        return ContinuousEngine(
            served, autocast_dtype=spec.autocast_dtype, **{k: options[k] for k in keys}
        )
    keys = ("max_batch_size", "batch_window_s", "max_queue")
    return BatchingEngine(
        served, autocast_dtype=spec.autocast_dtype, **{k: options[k] for k in keys}
    )


class ProcessEngine:
    """An engine running in a child process (see the module docstring)."""

    def __init__(self, served: ServedModel, spec: EngineSpec) -> None:
        self.served = served
        self.max_queue = spec.options["max_queue"]
        rows = spec.options["max_running" if spec.continuous(served) else "max_batch_size"]
        self.capacity = self.max_queue + rows
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_child_main,
            args=(child_conn, served, spec),
            name=f"megalith-engine-{served.info.content_id[:8]}",
            daemon=True,
        )
        self._pending: dict[int, PendingRequest] = {}
        self._cancel_sent: set[int] = set()
        self._lock = threading.Lock()  # _pending, _closed and the pipe's sending end
        self._next_id = 0
        self._closed = False
        self.ready = threading.Event()
        self._failure: str | None = None
        self.stats: Any = None
        self._kv_stats: dict[str, Any] | None = None
        self.running = 0
        self.queued = 0
        self._threads = [
            threading.Thread(target=self._read, name="megalith-engine-reader", daemon=True),
            threading.Thread(target=self._watch, name="megalith-engine-cancels", daemon=True),
        ]

    def start(self, timeout_s: float = 600.0) -> ProcessEngine:
        """Start the child and wait until its engine runs (it loads the model meanwhile)."""
        self._process.start()
        for thread in self._threads:
            thread.start()
        started = self.ready.wait(timeout_s)
        if not started or self._failure is not None or self._closed:
            self._process.join(5 if started else 0)  # a child that failed exits by itself
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
            reason = self._failure or (
                f"it exited with code {self._process.exitcode}" if started else "timeout"
            )
            raise RuntimeError(f"the engine process did not start: {reason}")
        return self

    def submit(self, request: PendingRequest) -> None:
        """Queue ``request`` in the child; ``EngineClosed`` or ``EngineBusy`` as an engine."""
        with self._lock:
            if self._closed:
                raise EngineClosed("this engine has stopped")
            if len(self._pending) >= self.capacity:
                raise EngineBusy(
                    f"{len(self._pending) - self.running} requests are already waiting"
                )
            request_id, self._next_id = self._next_id, self._next_id + 1
            self._pending[request_id] = request
            message = ("submit", request_id, request.prompt_ids, request.sampling, request.deadline)
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):
                del self._pending[request_id]
                raise EngineClosed("the engine process has ended") from None

    def retire(self) -> None:
        """Let the child finish what it holds, then exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._send(("retire",))

    def join(self, timeout: float | None = None) -> bool:
        self._process.join(timeout)
        return not self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def kv_stats(self) -> dict[str, Any] | None:
        """The child's KV-cache counters as of its last message (None for a static engine)."""
        return self._kv_stats

    # --- parent threads ------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):  # gone: the reader fails its requests
            self._conn.send(message)

    def _read(self) -> None:
        """Deliver the child's events to the requests' callbacks, until it exits."""
        try:
            while True:
                kind, payload, stats = self._conn.recv()
                if kind == "ready":
                    self.ready.set()
                elif kind == "failed":
                    self._failure = payload
                    self.ready.set()
                    return
                self._take_stats(stats)
                for request_id, item in payload:
                    self._deliver(request_id, item)
        except (EOFError, OSError):
            pass
        finally:
            self._fail_all()

    def _take_stats(self, stats: dict[str, Any] | None) -> None:
        if stats is None:
            return
        self.stats, self._kv_stats = stats["stats"], stats["kv"]
        self.running, self.queued = stats["running"], stats["queued"]

    def _deliver(self, request_id: int, item: SampledToken | Finished | str) -> None:
        with self._lock:
            request = self._pending.get(request_id)
            if request is not None and not isinstance(item, SampledToken):
                del self._pending[request_id]
                self._cancel_sent.discard(request_id)
        if request is None:
            return
        try:
            if isinstance(item, SampledToken):
                request.on_token(item)
            elif isinstance(item, Finished):
                request.on_done(item)
            else:
                request.on_done(RuntimeError(item))
        except Exception:  # as an engine: a failing callback does not stop the others
            log.exception("a request's callback failed")

    def _fail_all(self) -> None:
        """The child is gone: end every request it held with an error."""
        code = self._process.exitcode
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, {}
        error = RuntimeError(f"the engine process ended (exit code {code})")
        for request in pending.values():
            try:
                request.on_done(error)
            except Exception:
                log.exception("a request's callback failed")
        self.ready.set()

    def _watch(self) -> None:
        """Forward cancellations (the ``cancelled`` flags the server sets) to the child."""
        while self._process.is_alive() or not self.ready.is_set():
            with self._lock:
                ids = [
                    i for i, r in self._pending.items()
                    if r.cancelled.is_set() and i not in self._cancel_sent
                ]  # fmt: skip
                for request_id in ids:
                    self._cancel_sent.add(request_id)
                    self._send(("cancel", request_id))
            time.sleep(CANCEL_POLL_S)


# --- the child ------------------------------------------------------------------------------


class _Outbox:
    """Collects the engine thread's events and sends them in one message per burst."""

    def __init__(self, conn: Any, engine: Engine) -> None:
        self.conn = conn
        self.engine = engine
        self.items: list[tuple[int, Any]] = []
        self.cond = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._send_loop, name="megalith-outbox")
        self.thread.start()

    def post(self, request_id: int, item: Any) -> None:
        with self.cond:
            self.items.append((request_id, item))
            if len(self.items) == 1:
                self.cond.notify()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()

    def _send_loop(self) -> None:
        while True:
            with self.cond:
                while not self.items and not self.closed:
                    self.cond.wait()
                items, self.items = self.items, []
                closed = self.closed
            if items:
                self.conn.send(("events", items, engine_stats(self.engine)))
            if closed:
                return


def engine_stats(engine: Engine) -> dict[str, Any]:
    kv_stats = engine.kv_stats() if isinstance(engine, ContinuousEngine) else None
    return {
        "stats": engine.stats,
        "kv": kv_stats,
        "running": engine.running,
        "queued": engine.queued,
    }


def _child_main(conn: Any, served: ServedModel, spec: EngineSpec) -> None:
    # Ctrl-C reaches the whole process group: the server shuts down and retires this
    # engine (it finishes or cancels what it holds), rather than each dying on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        served = ServedModel(served.model.to(spec.device), served.tokenizer, served.info)
        engine = make_engine(served, spec).start()
        engine.ready.wait()  # the continuous engine's CUDA graphs are captured
    except Exception as error:  # the parent raises it from start()
        conn.send(("failed", f"{type(error).__name__}: {error}", None))
        return
    outbox = _Outbox(conn, engine)
    conn.send(("ready", [], engine_stats(engine)))
    requests: dict[int, PendingRequest] = {}
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent has gone: stop what is running
            for request in requests.values():
                request.cancelled.set()
            message = ("retire",)
        if message[0] == "submit":
            _, request_id, prompt_ids, sampling, deadline = message
            requests[request_id] = request = _child_request(
                outbox, requests, request_id, prompt_ids, sampling, deadline
            )
            try:
                engine.submit(request)
            except (EngineBusy, EngineClosed) as error:
                request.on_done(error)
        elif message[0] == "cancel" and (request := requests.get(message[1])) is not None:
            request.cancelled.set()
        elif message[0] == "retire":
            engine.retire()
            engine.join()
            outbox.close()
            return


def _child_request(
    outbox: _Outbox,
    requests: dict[int, PendingRequest],
    request_id: int,
    prompt_ids: list[int],
    sampling: Any,
    deadline: float,
) -> PendingRequest:
    def on_token(token: SampledToken) -> None:
        outbox.post(request_id, token)

    def on_done(result: Finished | BaseException) -> None:
        requests.pop(request_id, None)
        outbox.post(request_id, result if isinstance(result, Finished) else str(result))

    return PendingRequest(prompt_ids, sampling, deadline, on_token, on_done)
