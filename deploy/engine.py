"""The batching engine: one worker thread owns a model and decodes concurrent requests together.

Requests queue up; the worker takes the first, waits up to ``batch_window_s`` for more
(never more than ``max_batch_size``), and decodes that batch to the end with its model
family's ``generate_batch`` (``training.inference.decode.generate_ids`` for a GPT): one KV cache for the batch, prompts of different
lengths without padding, each request with its own sampling settings, seed, token
budget and EOD stop. A request's tokens reach it as they are sampled (``on_token``), so
streaming works from inside a batch. Since every row of a batch stays at the same
position, a request's tokens equal those it gets alone (greedy: exactly, up to
floating-point rounding of near ties).

A T5 package is served the same way with ``training.inference.decode_t5.generate_seq2seq_ids``:
the prompt (then EOS) is the encoder's input, encoded once per batch, and the answer is
the decoder's output, each row with its own settings as above.

Requests arriving while a batch decodes wait for the next batch (static batching: the
rows of one KV cache share positions, so a request cannot join mid-decode).

Before every step a row ends early when its deadline has passed (finish reason
``timeout``: it keeps the tokens it has) or its client went away (``cancelled``). A
request whose deadline passes while it waits ends with no tokens.

``retire()`` lets the worker finish everything already submitted, then stop: a server
swaps in a new engine for a new model version and retires the old one, so no request
is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from megalith.errors import MegalithError
from training.inference.decode import SampledToken, SamplingConfig
from training.inference.loading import ServedModel

log = logging.getLogger(__name__)


class EngineClosed(MegalithError):
    """The engine has stopped (its model was replaced): submit to the current one."""


class EngineBusy(MegalithError):
    """Too many requests are waiting already."""


@dataclass(frozen=True)
class Finished:
    """How a request ended: its new token ids (the final EOD left out)."""

    token_ids: list[int]
    finish_reason: str  # eod, stop (a chat's end of turn), length, timeout or cancelled
    prompt_tokens: int  # special tokens included


@dataclass(eq=False)
class PendingRequest:
    """One request's place in the engine.

    ``on_token(SampledToken)`` (its id, and its log-probabilities when
    ``sampling.logprobs`` asks) and ``on_done(Finished | Exception)`` run on the worker thread:
    they must be quick (a server hands the values to its event loop); a failure is logged.
    """

    prompt_ids: list[int]  # ServedModel.prompt_ids or a chat template; fits the model
    sampling: SamplingConfig
    deadline: float  # time.monotonic() after which the request stops
    on_token: Callable[[SampledToken], None]
    on_done: Callable[[Finished | BaseException], None]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def stop_reason(self) -> str | None:
        if self.cancelled.is_set():
            return "cancelled"
        if time.monotonic() >= self.deadline:
            return "timeout"
        return None


@dataclass
class EngineStats:
    batches: int = 0
    requests: int = 0
    largest_batch: int = 0


E = TypeVar("E", bound="QueuedEngine")


class QueuedEngine:
    """The request queue one worker thread serves: ``start``, ``submit`` (``EngineClosed``,
    ``EngineBusy``), ``retire``, ``join`` and ``queued``, shared by the static and the
    continuous engine. A subclass's ``_run`` takes requests from ``_waiting`` under
    ``_cond`` and, once ``_retiring`` with nothing left, sets ``_closed`` and returns."""

    def __init__(
        self, served: ServedModel, *, max_queue: int, autocast_dtype: torch.dtype | None
    ) -> None:
        if autocast_dtype == torch.bfloat16:
            # The weights in bf16 once, rather than autocast casting each at every step (a
            # 1B model: 4.4 GB read and 2.2 GB written a step). fp16 keeps fp32 weights
            # under autocast: its range is too narrow for a whole residual stream.
            served.model.to(autocast_dtype)
        self.served = served
        self.max_queue = max_queue
        self.autocast_dtype = autocast_dtype
        self._waiting: deque[PendingRequest] = deque()
        self._cond = threading.Condition()
        self._retiring = False
        self._closed = False
        # Set once the worker serves (the continuous engine first captures its CUDA graphs).
        self.ready = threading.Event()
        self._worker = threading.Thread(
            target=self._run, name=f"megalith-engine-{served.info.content_id[:8]}", daemon=True
        )

    def start(self: E) -> E:
        self._worker.start()
        return self

    def submit(self, request: PendingRequest) -> None:
        """Queue ``request``; raises ``EngineClosed`` or ``EngineBusy`` instead."""
        with self._cond:
            if self._closed:
                raise EngineClosed("this engine has stopped")
            if len(self._waiting) >= self.max_queue:
                raise EngineBusy(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(request)
            self._cond.notify()

    def retire(self) -> None:
        """Finish every request submitted so far (and any submitted meanwhile), then stop."""
        with self._cond:
            self._retiring = True
            self._cond.notify()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for a retired engine's worker; True once it has stopped."""
        self._worker.join(timeout)
        return not self._worker.is_alive()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def _run(self) -> None:
        raise NotImplementedError


class BatchingEngine(QueuedEngine):
    """Decode submitted requests in batches on one worker thread (see the module docstring)."""

    def __init__(
        self,
        served: ServedModel,
        *,
        max_batch_size: int = 8,
        batch_window_s: float = 0.005,
        max_queue: int = 256,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        super().__init__(served, max_queue=max_queue, autocast_dtype=autocast_dtype)
        self.max_batch_size = max_batch_size
        self.batch_window_s = max(0.0, batch_window_s)
        self.stats = EngineStats()
        self.running = 0  # rows of the batch being decoded

    # --- worker -----------------------------------------------------------------------

    def _run(self) -> None:
        self.ready.set()
        while (batch := self._gather()) is not None:
            self._decode(batch)

    def _gather(self) -> list[PendingRequest] | None:
        """The next batch: the first waiting request and those arriving within the window."""
        with self._cond:
            while not self._waiting and not self._retiring:
                self._cond.wait()
            if not self._waiting:
                self._closed = True  # retiring and nothing left: later submits go elsewhere
                return None
            window_end = time.monotonic() + self.batch_window_s
            while len(self._waiting) < self.max_batch_size and not self._retiring:
                remaining = window_end - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            count = min(self.max_batch_size, len(self._waiting))
            return [self._waiting.popleft() for _ in range(count)]

    def _decode(self, batch: list[PendingRequest]) -> None:
        live = []
        for request in batch:
            reason = request.stop_reason()
            if reason is None:
                live.append(request)
            else:
                notify(request.on_done, Finished([], reason, len(request.prompt_ids)))
        if not live:
            return
        self.stats.batches += 1
        self.stats.requests += len(live)
        self.stats.largest_batch = max(self.stats.largest_batch, len(live))
        self.running = len(live)
        try:
            results = self._generate(live)
        except Exception as error:  # a bug or out of memory: fail this batch, keep serving
            log.exception("generation failed for a batch of %d", len(live))
            for request in live:
                notify(request.on_done, error)
            return
        finally:
            self.running = 0
        for request, (ids, reason, prompt_tokens) in zip(live, results, strict=True):
            notify(request.on_done, Finished(ids, reason, prompt_tokens))

    def _generate(self, live: list[PendingRequest]) -> list[tuple[list[int], str, int]]:
        """``(new ids, finish reason, prompt tokens)`` per request, for a GPT or a T5."""
        tokenizer = self.served.tokenizer
        prompts = [r.prompt_ids for r in live]
        return self.served.generator.generate_batch(
            self.served.model,
            tokenizer,
            prompts,
            [r.sampling for r in live],
            seeds=[r.sampling.seed for r in live],
            autocast_dtype=self.autocast_dtype,
            on_token=lambda row, token: notify(live[row].on_token, token),
            stop=lambda row: live[row].stop_reason(),
        )


def notify(callback: Callable[[Any], None], value: Any) -> None:
    """Run a request's callback; its failure (say, a closed event loop) must not stop the
    worker or the other rows of the batch."""
    try:
        callback(value)
    except Exception:
        log.exception("a request's callback failed")
