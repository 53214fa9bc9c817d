"""Continuous batching over a paged KV cache: requests join and leave the batch at every step.

The public interface is :class:`deploy.engine.QueuedEngine`'s, as the static
``BatchingEngine``'s (``start``, ``submit``, ``retire``, ``join``, ``queued``; the same
``PendingRequest``, ``Finished``, ``EngineClosed`` and ``EngineBusy``), so a server takes
either. GPT models only: a T5
keeps the static ``BatchingEngine`` (its encoder output would need a cache of its own).
One process: a tensor-parallel backend is refused. Transformer Engine layers run as
they are, and their attention leaves masked attention (every step here) to SDPA.

One worker thread owns the model. Each round it

1. ends the rows whose client went away (``cancelled``) or whose deadline passed
   (``timeout``, with the tokens they have) and frees their blocks; a request whose
   deadline passes while it waits ends with no tokens;
2. admits waiting requests, first come first served, while fewer than ``max_running``
   run and the head request's blocks fit (it waits otherwise; ``submit`` raises
   ``EngineBusy`` once ``max_queue`` requests wait);
3. decodes one token for every running sequence past its prompt (one forward, each row
   at its own position);
4. prefills up to ``prefill_chunk`` prompt tokens of the sequences still reading their
   prompt, in admission order (a second forward), so a long prompt is read a chunk per
   step while the other rows keep decoding; a sequence whose prompt is complete samples
   its first token there.

Memory: KV lives in ``num_blocks`` blocks of ``block_size`` positions
(:mod:`training.inference.paged_cache`, :mod:`training.inference.block_pool`). A
request reserves at admission every block it can need, prompt plus ``max_new_tokens``,
so a running sequence never runs out mid-decode and nothing is preempted; the price is
that short answers hold their budget's blocks until they end. Full prompt blocks are
published to the prefix cache once written, and a later prompt with the same leading
blocks (a shared system prompt) reuses them; ``kv_stats()`` counts the hits.

Speed on CUDA: each decode step is replayed as a CUDA graph
(:mod:`training.inference.decode_graphs`, captured for every bucket of rows and key
length when the worker starts; ``ready`` is set after that), and under bf16 the weights
are cast once (:class:`deploy.engine.QueuedEngine`). Prefill steps run eagerly.

Sampling is ``training.inference.decode``'s: each request its own ``SamplingConfig``,
random stream seeded with its seed, EOD and stop tokens, token budget; each token
reaches ``on_token`` as it is sampled. A request's tokens equal those it gets alone
(greedy: exactly, up to floating-point rounding of near ties).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from deploy.engine import Finished, PendingRequest, QueuedEngine, notify
from training.inference.block_pool import BlockPool, block_hashes
from training.inference.decode import (
    BatchRows,
    SampledToken,
    fit_prompt,
    mask_vocab,
    sample_tokens,
)
from training.inference.decode_graphs import DecodeGraphs
from training.inference.loading import ServedModel
from training.inference.paged_cache import PagedKVCache
from training.inference.runtime import decoding
from training.models.gpt import GPTModel

log = logging.getLogger(__name__)


@dataclass
class ContinuousStats:
    requests: int = 0  # admitted
    steps: int = 0  # forwards run, decode and prefill
    largest_batch: int = 0  # most sequences running at once


@dataclass(eq=False)
class Sequence:
    """A running request: its block table, how much of it is in the cache, its sampling."""

    request: PendingRequest
    prompt: list[int]
    hashes: list[bytes]  # of its full prompt blocks
    blocks: list[int]
    rows: BatchRows  # one row: settings, random stream, new tokens, finish reason
    computed: int  # positions whose keys and values are cached
    published: int  # leading prompt blocks offered to the prefix cache
    next_token: int | None = None  # sampled, to be fed at position ``computed``

    def emit(self, _row: int, token: SampledToken) -> None:
        notify(self.request.on_token, token)


class ContinuousEngine(QueuedEngine):
    """Decode submitted requests with continuous batching (see the module docstring)."""

    def __init__(
        self,
        served: ServedModel,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_running: int = 64,
        prefill_chunk: int = 2048,
        max_queue: int = 256,
        autocast_dtype: torch.dtype | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        if served.seq2seq or not isinstance(served.model, GPTModel):
            raise ValueError("continuous batching serves GPT models; serve a T5 statically")
        if served.model.backend.tensor_parallel_size > 1:
            raise ValueError("continuous batching runs in one process: no tensor parallelism")
        if min(block_size, max_running, prefill_chunk) < 1:
            raise ValueError("block_size, max_running and prefill_chunk must be >= 1")
        super().__init__(served, max_queue=max_queue, autocast_dtype=autocast_dtype)
        self.model = served.model
        self.context = self.model.config.max_position_embeddings
        per_sequence = math.ceil(self.context / block_size)
        num_blocks = num_blocks or max_running * per_sequence
        if num_blocks < per_sequence:
            raise ValueError(
                f"num_blocks {num_blocks} cannot hold one sequence of the model's "
                f"{self.context} positions ({per_sequence} blocks of {block_size})"
            )
        self.block_size = block_size
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.pool = BlockPool(num_blocks)
        self.cache = PagedKVCache.for_model(self.model, num_blocks, block_size, autocast_dtype)
        self.device = self.cache.keys.device
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(
                self.model, self.cache, max_running, autocast_dtype=autocast_dtype
            )
        self.stats = ContinuousStats()
        self._running: list[Sequence] = []

    @property
    def running(self) -> int:
        return len(self._running)

    def kv_stats(self) -> dict[str, Any]:
        """Blocks in use and free (cached prefix blocks no sequence holds count as free),
        prefix-cache counters in tokens, running and queued sequences."""
        pool = self.pool
        return {
            "blocks_used": pool.used,
            "blocks_free": pool.num_blocks - pool.used,
            "blocks_cached": pool.cached,
            "block_size": self.block_size,
            "prefix_hits": pool.prefix_hits,
            "prefix_queries": pool.prefix_queries,
            "running": self.running,
            "queued": self.queued,
            **{f"engine_{key}": value for key, value in asdict(self.stats).items()},
        }

    # --- worker -----------------------------------------------------------------------

    def _run(self) -> None:
        if self.graphs is not None:
            self._capture_graphs()
        self.ready.set()
        while self._schedule():
            try:
                self._step()
            except Exception as error:  # a bug or out of memory: fail these rows, keep serving
                log.exception("a step of %d sequences failed", len(self._running))
                for sequence in list(self._running):
                    self._finish(sequence, error)

    def _capture_graphs(self) -> None:
        assert self.graphs is not None
        started = time.perf_counter()
        try:
            self.graphs.capture_all()
        except Exception:  # serve without graphs rather than not at all
            log.exception("capturing the decode steps as CUDA graphs failed; decoding eagerly")
            self.graphs = None
            return
        seconds = time.perf_counter() - started
        log.info("captured %d decode graphs in %.1f s", self.graphs.captured, seconds)

    def _schedule(self) -> bool:
        """Drop expired waiting requests and admit what fits; False once retired and idle."""
        ended: list[tuple[PendingRequest, Finished | BaseException]] = []
        with self._cond:
            while not self._waiting and not self._running and not self._retiring:
                self._cond.wait()
            if not self._waiting and not self._running:
                self._closed = True  # retiring and nothing left: later submits go elsewhere
                return False
            for request in list(self._waiting):
                if (reason := request.stop_reason()) is not None:
                    self._waiting.remove(request)
                    ended.append((request, Finished([], reason, len(request.prompt_ids))))
            while self._waiting and len(self._running) < self.max_running:
                try:
                    sequence = self._admit(self._waiting[0])
                except ValueError as error:  # an empty prompt, no room for max_new_tokens
                    ended.append((self._waiting.popleft(), error))
                    continue
                if sequence is None:
                    break  # the head waits for blocks; later requests wait behind it
                self._waiting.popleft()
                if sequence.rows.finish[0]:  # max_new_tokens 0
                    self.pool.release(sequence.blocks)
                    ended.append((sequence.request, self._result(sequence)))
                else:
                    self._running.append(sequence)
        for request, result in ended:
            notify(request.on_done, result)
        self.stats.largest_batch = max(self.stats.largest_batch, len(self._running))
        return True

    def _admit(self, request: PendingRequest) -> Sequence | None:
        """Reserve ``request``'s blocks, reusing cached prefix blocks; None if they do not fit."""
        sampling = request.sampling
        prompt = fit_prompt(request.prompt_ids, self.context, sampling.max_new_tokens)
        hashes = block_hashes(prompt, self.block_size)
        # At least the prompt's last token is computed: its logits give the first token.
        shared = self.pool.cached_prefix(hashes[: (len(prompt) - 1) // self.block_size])
        positions = max(len(prompt), len(prompt) + sampling.max_new_tokens - 1)
        needed = math.ceil(positions / self.block_size) - len(shared)
        if needed > self.pool.available(shared):
            return None
        self.pool.share(shared)
        blocks = shared + self.pool.allocate(needed)
        cached = len(shared) * self.block_size
        self.pool.count_query(len(prompt), cached)
        self.stats.requests += 1
        rows = BatchRows(sampling, 1, [sampling.seed])
        return Sequence(request, prompt, hashes, blocks, rows, cached, len(shared))

    def _step(self) -> None:
        for sequence in list(self._running):
            if (reason := sequence.request.stop_reason()) is not None:
                sequence.rows.finish[0] = reason
                self._finish(sequence, self._result(sequence))
        decoding = [s for s in self._running if s.next_token is not None]
        if decoding:
            self._sample(decoding, self._decode(decoding))
        chunks = self._prefill_chunks()
        if chunks:
            prefilling = list(chunks)
            tokens = [s.prompt[s.computed : s.computed + n] for s, n in chunks.items()]
            logits = self._forward(prefilling, tokens)
            for sequence in prefilling:
                self._publish(sequence)
            ready = [i for i, s in enumerate(prefilling) if s.computed == len(s.prompt)]
            if ready:
                self._sample([prefilling[i] for i in ready], logits[ready])

    def _prefill_chunks(self) -> dict[Sequence, int]:
        """This step's prompt tokens per prefilling sequence, ``prefill_chunk`` in all."""
        chunks, budget = {}, self.prefill_chunk
        for sequence in self._running:
            left = len(sequence.prompt) - sequence.computed
            if left > 0 and budget > 0:
                chunks[sequence] = min(left, budget)
                budget -= chunks[sequence]
        return chunks

    def _decode(self, sequences: list[Sequence]) -> Tensor:
        """Feed each sequence its sampled token: the logits of the next, ``[B, V]``."""
        tokens = [s.next_token for s in sequences if s.next_token is not None]
        if self.graphs is None:
            return self._forward(sequences, [[token] for token in tokens])
        tables = [s.blocks for s in sequences]
        logits = self.graphs.forward(tokens, tables, [s.computed for s in sequences])
        self._advance(sequences, [1] * len(sequences))
        return logits

    def _forward(self, sequences: list[Sequence], tokens: list[list[int]]) -> Tensor:
        """Feed each sequence its ``tokens`` from position ``computed`` on; the logits of
        each one's last token. Their keys and values are cached and ``computed`` counts them."""
        counts = [len(row) for row in tokens]
        step = self.cache.step(
            [s.blocks for s in sequences], [s.computed for s in sequences], counts
        )
        width = max(counts)
        padded = [row + [row[-1]] * (width - len(row)) for row in tokens]
        batch = torch.tensor(padded, device=self.device)
        with decoding(self.device, self.autocast_dtype):
            logits = self.model.forward_rows(batch, step.positions, step, step.attn_mask, step.last)
        self._advance(sequences, counts)
        return logits

    def _advance(self, sequences: list[Sequence], counts: list[int]) -> None:
        """A forward cached ``counts[i]`` more positions of sequence ``i``."""
        for sequence, count in zip(sequences, counts, strict=True):
            sequence.computed += count
        self.stats.steps += 1

    def _sample(self, sequences: list[Sequence], logits: Tensor) -> None:
        """Each sequence's next token from its logits row; a finished sequence leaves."""
        tokenizer = self.served.tokenizer
        logits = mask_vocab(logits, tokenizer.vocab_size)
        configs = [s.rows.configs[0] for s in sequences]
        streams = [s.rows.streams[0] for s in sequences]
        _, chosen = sample_tokens(logits, configs, streams, range(len(sequences)))
        for sequence, token in zip(sequences, chosen, strict=True):
            sequence.rows.take(0, token, tokenizer.eod_id, sequence.emit)
            if sequence.rows.finish[0]:
                self._finish(sequence, self._result(sequence))
            else:
                sequence.next_token = token.id

    def _publish(self, sequence: Sequence) -> None:
        """Offer the sequence's newly written full prompt blocks to the prefix cache."""
        written = min(sequence.computed, len(sequence.prompt)) // self.block_size
        for index in range(sequence.published, written):
            self.pool.publish(sequence.blocks[index], sequence.hashes[index])
        sequence.published = max(sequence.published, written)

    def _finish(self, sequence: Sequence, result: Finished | BaseException) -> None:
        self._running.remove(sequence)
        self.pool.release(sequence.blocks)
        notify(sequence.request.on_done, result)

    @staticmethod
    def _result(sequence: Sequence) -> Finished:
        return Finished(sequence.rows.new[0], sequence.rows.finish[0], len(sequence.prompt))
