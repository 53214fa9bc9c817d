"""What a server serves: its settings, the engine of the current model, the swap to a new
one (hot reload), and the stream that carries a request's tokens to the event loop.

A request is one or more rows of the engine (``n`` choices, several prompts): they are
queued together on one engine, and their tokens come back, tagged with the row's index,
through one :class:`TokenStream`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from deploy.continuous import ContinuousEngine
from deploy.engine import BatchingEngine, EngineBusy, EngineClosed, Finished, PendingRequest
from deploy.engine_process import EngineSpec, ProcessEngine, make_engine
from deploy.metrics import ServingMetrics
from deploy.request_body import DEFAULT_MAX_BODY_BYTES
from training.inference.decode import SampledToken, SamplingConfig, continuation_text
from training.inference.loading import ServedModel, load_served_model, source_version
from training.inference.runtime import AUTOCAST_DTYPES, resolve_precision
from training.runtime.device import resolve_device

log = logging.getLogger(__name__)

STUCK_GRACE_S = 5.0
RETRY_AFTER_S = 1  # what a 429 (the queue is full) tells a client to wait
Planned = TypeVar("Planned")
Row = tuple[list[int], SamplingConfig]  # a prompt's tokens and how to continue it
# Prompt tokens decoded with a streamed answer to find the text it adds (its leading space,
# a character split across the boundary): decoding the whole prompt at every token cost
# ~250 us a token with a 1000-token prompt, on the event loop; 8 tokens give the same text.
TEXT_CONTEXT = 8


@dataclass(frozen=True)
class ServeConfig:
    """``megalith serve``'s settings (its flags have the same names)."""

    model: str  # models:/NAME@ALIAS, models:/NAME/VERSION or a package directory
    tracking_uri: str | None = None
    device: str = "cpu"
    precision: str = "fp32"  # fp32, bf16 or fp16 autocast
    max_tokens: int = 256  # the most tokens one request may ask for
    timeout_s: float = 60.0  # the longest a request may run
    engine: str = "continuous"  # continuous (GPT; a T5 is served statically) or static
    max_batch_size: int = 8  # static
    batch_window_ms: float = 5.0  # static
    max_running: int = 64  # continuous: sequences decoding at once
    block_size: int = 16  # continuous: positions per KV block
    kv_blocks: int | None = None  # continuous: KV blocks; None: max_running full contexts
    prefill_chunk: int = 2048  # continuous: most prompt tokens read in one step
    # The engine in a child process (no GIL shared with HTTP); None: on CUDA devices only.
    engine_process: bool | None = None
    cuda_graphs: bool = True  # continuous on CUDA: decode steps replayed as CUDA graphs
    max_queue: int = 256
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies answer 413
    watch_s: float | None = None  # reload when the alias moves, checked this often
    # /admin/reload wants "Authorization: Bearer TOKEN" when set (MEGALITH_ADMIN_TOKEN).
    admin_token: str | None = field(default=None, repr=False)


Engine = BatchingEngine | ContinuousEngine | ProcessEngine
ENGINES = ("continuous", "static")


class Deployment:
    """The engine serving the current model, and the swap to a new one."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.autocast_dtype = AUTOCAST_DTYPES[resolve_precision(config.precision, self.device)]
        self.engine_process = config.engine_process
        if self.engine_process is None:  # measured faster on GPUs (docs/serving.md)
            self.engine_process = self.device.type == "cuda"
        self.engine = self._start(self._load())
        self.engine.ready.wait()  # answer the first request at full speed
        self.reloads = 0
        self.metrics = ServingMetrics(lambda: self.engine)
        self._reload_lock = asyncio.Lock()

    def _load(self) -> ServedModel:
        # A process engine's child moves the model to the device; here it stays in host
        # memory, which the child maps rather than copies.
        device = torch.device("cpu") if self.engine_process else self.device
        return load_served_model(
            self.config.model, tracking_uri=self.config.tracking_uri, device=device
        )

    def _start(self, served: ServedModel) -> Engine:
        config = self.config
        if config.engine not in ENGINES:
            raise ValueError(f"engine {config.engine!r} is not one of {', '.join(ENGINES)}")
        options = {
            "block_size": config.block_size,
            "num_blocks": config.kv_blocks,
            "max_running": config.max_running,
            "prefill_chunk": config.prefill_chunk,
            "cuda_graphs": config.cuda_graphs,
            "max_queue": config.max_queue,
            "max_batch_size": config.max_batch_size,
            "batch_window_s": config.batch_window_ms / 1000,
        }
        spec = EngineSpec(config.engine, options, self.autocast_dtype, self.device)
        if self.engine_process:
            return ProcessEngine(served, spec).start()
        return make_engine(served, spec).start()

    async def reload(self) -> dict[str, Any]:
        """Serve what the source names now; a no-op when that is the version served."""
        async with self._reload_lock:
            old = self.engine
            version = await asyncio.to_thread(
                source_version, self.config.model, tracking_uri=self.config.tracking_uri
            )
            if version is not None and version == old.served.info.version:
                return {"reloaded": False, "model": public_info(old.served)}
            served = await asyncio.to_thread(self._load)
            if served.info.content_id == old.served.info.content_id:
                return {"reloaded": False, "model": public_info(old.served)}
            # The old engine serves while the new one starts and warms up.
            new = await asyncio.to_thread(self._start, served)
            await asyncio.to_thread(new.ready.wait)
            self.engine = new  # new requests go to the new model from here
            old.retire()  # the old one finishes what it holds, then its thread ends
            self.reloads += 1
            log.info("now serving %s (was %s)", served.info, old.served.info)
            return {
                "reloaded": True,
                "model": public_info(served),
                "previous": public_info(old.served),
            }

    async def watch(self) -> None:
        """Reload every ``watch_s`` seconds when the source points elsewhere."""
        while True:
            await asyncio.sleep(self.config.watch_s or 0)
            try:
                await self.reload()
            except Exception:  # keep serving the current model; try again next time
                log.exception("reload of %s failed", self.config.model)

    def submit(
        self,
        plan: Callable[[ServedModel], tuple[Planned, list[Row], float]],
        stream: TokenStream,
    ) -> tuple[ServedModel, Planned]:
        """Queue the rows ``plan`` makes for the current model (with their time limit),
        all on one engine; ``plan`` raises for a request the model cannot take, and this
        raises ``EngineBusy`` when the queue is full."""
        stream.metrics = self.metrics
        while True:
            engine = self.engine
            planned, rows, timeout_s = plan(engine.served)
            deadline = time.monotonic() + timeout_s
            try:
                for prompt_ids, sampling in rows:
                    engine.submit(stream.add(prompt_ids, sampling, deadline))
            except EngineClosed:
                stream.abandon()
                continue  # swapped meanwhile: go to the new engine
            except EngineBusy:
                stream.abandon()
                raise
            self.metrics.prompt_tokens.inc(sum(len(ids) for ids, _ in rows))
            return engine.served, planned

    def close(self) -> None:
        self.engine.retire()
        self.engine.join(timeout=STUCK_GRACE_S)


def text_context(prompt_ids: list[int]) -> list[int]:
    """The end of a prompt that ``ServedModel.text`` needs to decode what an answer adds."""
    return prompt_ids[-TEXT_CONTEXT:]


class AnswerText:
    """An answer's text as its tokens arrive, decoding a bounded tail per token.

    ``ServedModel.text(prompt, ids)`` over all the answer's ids at every token costs
    O(length) a token, O(length²) an answer. Instead the text of the first ``settled``
    tokens is kept once it is final (it does not end inside a character: no ``U+FFFD``
    that the next byte token could complete), and only the tokens after them are decoded,
    with the ``TEXT_CONTEXT`` tokens before them as context for the leading space and
    merges across the boundary (as the prompt's end is for the first tokens).
    """

    SETTLE_AFTER = 16  # tokens decoded again at most, beyond the context

    def __init__(self, served: ServedModel, prompt_ids: list[int]) -> None:
        self.served = served
        self.context = text_context(prompt_ids)
        self.ids: list[int] = []
        self.settled = 0  # tokens whose text is final
        self.settled_text = ""
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add a token; the whole answer's text so far."""
        self.ids.append(token_id)
        if self.settled == 0:
            tail = self.served.text(self.context, self.ids)
        else:
            before = self.ids[max(0, self.settled - TEXT_CONTEXT) : self.settled]
            tail = continuation_text(self.served.tokenizer, before, self.ids[self.settled :])
        self.text = self.settled_text + tail
        if len(self.ids) - self.settled >= self.SETTLE_AFTER and not tail.endswith("\ufffd"):
            self.settled, self.settled_text = len(self.ids), self.text
        return self.text


def public_info(served: ServedModel) -> dict[str, Any]:
    """``ModelInfo`` as clients see it: a package directory's path is shown as its name."""
    info = served.info.to_dict()
    if not info["source"].startswith("models:/"):
        info["source"] = served.info.name
    return info


class LoopMailbox:
    """Hands items from the engine's thread to the event loop's queues with one wake-up
    per burst: every row's token of a decode step is posted, the loop is woken once
    (``call_soon_threadsafe`` writes to its self-pipe) and puts them all in their queues,
    instead of one wake-up, and one GIL hand-over, per token."""

    _of_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox]
    _of_loop = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the loop keys the cache: no strong reference back
        self._items: list[tuple[asyncio.Queue, Any]] = []
        self._lock = threading.Lock()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopMailbox:
        """The loop's one mailbox (call on the loop's thread)."""
        if loop not in cls._of_loop:
            cls._of_loop[loop] = cls(loop)
        return cls._of_loop[loop]

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        """``queue.put_nowait(item)`` on the loop, soon; callable from any thread."""
        with self._lock:
            self._items.append((queue, item))
            if len(self._items) > 1:  # a delivery is already scheduled
                return
        loop = self._loop()
        if loop is not None:  # else nobody waits for the items any more
            loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:
            queue.put_nowait(item)


class TokenStream:
    """Carries the tokens of a request's rows from the engine's thread to the event loop,
    and times them for the metrics."""

    def __init__(self) -> None:
        self._mailbox = LoopMailbox.of(asyncio.get_running_loop())
        self._queue: asyncio.Queue[tuple[int, SampledToken | Finished | BaseException]]
        self._queue = asyncio.Queue()
        self.requests: list[PendingRequest] = []
        self._open: set[int] = set()
        self._last: dict[int, float] = {}
        self._start = time.monotonic()
        self.metrics: ServingMetrics | None = None

    def add(
        self, prompt_ids: list[int], sampling: SamplingConfig, deadline: float
    ) -> PendingRequest:
        """A new row of this request, its callbacks tagged with its index."""
        index = len(self.requests)
        put = functools.partial(self._put, self._queue, index)
        request = PendingRequest(prompt_ids, sampling, deadline, put, put)
        self.requests.append(request)
        self._open.add(index)
        return request

    def abandon(self) -> None:
        """Cancel the rows added so far (their engine was closed or full) and start over."""
        for request in self.requests:
            request.cancelled.set()
        self.requests, self._open, self._queue = [], set(), asyncio.Queue()

    def cancel(self, index: int) -> None:
        """Stop row ``index`` early (say, at a stop string); its end still arrives."""
        self.requests[index].cancelled.set()

    def _put(
        self,
        queue: asyncio.Queue[tuple[int, SampledToken | Finished | BaseException]],
        index: int,
        item: SampledToken | Finished | BaseException,
    ) -> None:
        if isinstance(item, SampledToken) and self.metrics is not None:
            now = time.monotonic()
            self.metrics.token(now - self._last.get(index, self._start), index in self._last)
            self._last[index] = now
        self._mailbox.post(queue, (index, item))

    async def events(self, timeout_s: float) -> AsyncIterator[tuple[int, SampledToken | Finished]]:
        """``(row, token)`` pairs, and ``(row, Finished)`` once per row; ``TimeoutError`` if
        the engine is stuck, a row's exception if generation failed."""
        async for batch in self.batches(timeout_s):
            for event in batch:
                yield event

    async def batches(
        self, timeout_s: float
    ) -> AsyncIterator[list[tuple[int, SampledToken | Finished]]]:
        """The events of :meth:`events`, as lists of all that have arrived when the caller
        asks: one event a list while the loop keeps up; under load, when each request's
        tokens pile up between visits, several, which a streamer can send as one chunk."""
        deadline = time.monotonic() + timeout_s + STUCK_GRACE_S
        queue = self._queue
        try:
            while self._open:
                arrived = []
                if queue.empty():
                    arrived.append(await asyncio.wait_for(queue.get(), deadline - time.monotonic()))
                while not queue.empty():
                    arrived.append(queue.get_nowait())
                batch: list[tuple[int, SampledToken | Finished]] = []
                for index, item in arrived:
                    if isinstance(item, BaseException):
                        if batch:
                            yield batch  # what came before the failure still goes out
                        raise item
                    if isinstance(item, Finished):
                        self._open.discard(index)  # before the yield: the caller may stop there
                    batch.append((index, item))
                yield batch
        finally:
            for index in self._open:  # the client left, or we gave up: stop those rows
                self.requests[index].cancelled.set()


def engine_summary(engine: Engine, max_running: int) -> str:
    """The startup line on the engine: where it runs, its batching, KV memory and graphs."""
    where = f"in process {engine.pid}" if isinstance(engine, ProcessEngine) else "in a thread"
    stats = None if isinstance(engine, BatchingEngine) else engine.kv_stats()
    if not stats:
        return f"engine {where}: static batches"
    blocks = stats["blocks_used"] + stats["blocks_free"]
    line = (
        f"engine {where}: continuous batching, {blocks} KV blocks of {stats['block_size']} "
        f"positions, up to {max_running} sequences at once"
    )
    if isinstance(engine, ContinuousEngine):
        mib = blocks * engine.cache.bytes_per_block / 2**20
        line += f" ({mib:.0f} MiB of KV)"
        if engine.graphs is not None:
            line += f", decode steps as {engine.graphs.captured} CUDA graphs"
    return line
