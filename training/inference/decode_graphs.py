"""The paged decode step replayed as CUDA graphs.

A decode step of the continuous engine (one token for each running row,
:class:`training.inference.paged_cache.PagedStep`) launches a few hundred small kernels
(a 16-layer model: about 20 a layer), and at serving batch sizes the GPU finishes them
faster than Python issues them: on an H100 the 1B model's 64-row step took ~12 ms of
which the GPU was busy a fraction. A CUDA graph records the step's kernels once and
replays them with one launch.

A graph has fixed shapes, so steps are padded to buckets: the rows to the next of
:func:`row_buckets` (padding rows read and write only the scratch block and are dropped),
the key length to the next of :func:`key_buckets` (whole blocks; the padded keys read
the scratch block, masked out). The graph takes its inputs from a tensor it owns: the
host writes each step's tokens, start positions and block tables there (one copy), and
everything else, slots, positions and the mask, is computed inside the graph
(:meth:`PagedKVCache.step_from`). The engine captures every bucket when it starts
(:meth:`DecodeGraphs.capture_all`: 19 row sizes × 4 key lengths = 76 graphs for 256
rows and 2048 positions); a bucket
not captured yet is captured when first used. The graphs share one memory pool (only one
runs at a time). Padding changes the shapes the kernels see, so logits may differ from
the unpadded step by rounding (the tests check them on CPU through ``capture=False``,
which runs the same padded step without a graph, and on a GPU against the plain step).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from training.inference.paged_cache import PagedKVCache
from training.inference.runtime import decoding
from training.models.gpt import GPTModel

MIN_KEY_BUCKET = 512  # key positions a graph's length is a multiple of, at least
MAX_KEY_BUCKETS = 8  # wider buckets for longer contexts, so at most this many lengths


def row_buckets(max_rows: int) -> list[int]:
    """The row counts graphs are captured for: 1, 2, 4, 8, then every 8 up to 64, every
    16 up to 128, every 32 beyond, and ``max_rows``."""
    sizes = [1, 2, 4, *range(8, 64, 8), *range(64, 128, 16), *range(128, max_rows, 32)]
    return [*[size for size in sizes if size < max_rows], max_rows]


def key_buckets(context: int, block_size: int) -> list[int]:
    """The key lengths graphs are captured for: multiples of a width (whole blocks, at
    least ``MIN_KEY_BUCKET``), the last one the whole context in blocks."""
    longest = block_size * math.ceil(context / block_size)
    width = max(MIN_KEY_BUCKET, math.ceil(longest / MAX_KEY_BUCKETS))
    width = block_size * math.ceil(width / block_size)
    return [*range(width, longest, width), longest]


@dataclass
class _Bucket:
    """One graph's inputs and output; ``graph`` None until captured (or never)."""

    inputs: Tensor  # [R, 2 + W]: each row's token, start position and block table
    output: Tensor | None = None  # [R, V] fp32 logits
    graph: torch.cuda.CUDAGraph | None = None

    @property
    def tokens(self) -> Tensor:
        return self.inputs[:, :1]

    @property
    def starts(self) -> Tensor:
        return self.inputs[:, 1]

    @property
    def tables(self) -> Tensor:
        return self.inputs[:, 2:]


class DecodeGraphs:
    """Decode steps of ``model`` over ``cache``, one CUDA graph per (rows, keys) bucket."""

    def __init__(
        self,
        model: GPTModel,
        cache: PagedKVCache,
        max_rows: int,
        *,
        autocast_dtype: torch.dtype | None = None,
        key_bucket: int | None = None,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.cache = cache
        self.device = cache.keys.device
        if capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the cache is on {self.device}")
        self.autocast_dtype = autocast_dtype
        self.capture = capture
        self.rows = row_buckets(max_rows)
        context = model.config.max_position_embeddings
        self.keys = key_buckets(context, cache.block_size)
        if key_bucket is not None:  # a fixed width (tests)
            if key_bucket % cache.block_size:
                raise ValueError(
                    f"key_bucket {key_bucket} is not whole blocks of {cache.block_size}"
                )
            self.keys = [*range(key_bucket, self.keys[-1], key_bucket), self.keys[-1]]
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._ones = torch.ones(max_rows, dtype=torch.long, device=self.device)

    @property
    def captured(self) -> int:
        return sum(bucket.graph is not None for bucket in self._buckets.values())

    def bucket_of(self, rows: int, keys: int) -> tuple[int, int]:
        """The padded shape a step of ``rows`` rows attending to ``keys`` positions runs at."""
        if not 1 <= rows <= self.rows[-1]:
            raise ValueError(f"{rows} rows: a decode graph takes 1 to {self.rows[-1]}")
        if not 1 <= keys <= self.keys[-1]:
            raise ValueError(f"{keys} key positions: a decode graph takes 1 to {self.keys[-1]}")
        padded_rows = self.rows[bisect.bisect_left(self.rows, rows)]
        return padded_rows, self.keys[bisect.bisect_left(self.keys, keys)]

    def capture_all(self) -> None:
        """Capture every bucket's graph now, on padding rows (they touch only the scratch
        block), so that no request waits for a capture later."""
        if not self.capture:
            return
        for rows in self.rows:
            for keys in self.keys:
                bucket = self._bucket(rows, keys)
                if bucket.graph is None:
                    self._write_inputs(bucket, [], [], [], keys)
                    self._capture(bucket)

    def forward(
        self, tokens: Sequence[int], tables: Sequence[Sequence[int]], starts: Sequence[int]
    ) -> Tensor:
        """Feed row ``b`` its token ``tokens[b]`` at position ``starts[b]`` (its keys and
        values go to the cache): fp32 logits ``[B, V]``, a view that the next call
        overwrites."""
        rows = len(tokens)
        padded_rows, keys = self.bucket_of(rows, max(starts) + 1)
        bucket = self._bucket(padded_rows, keys)
        self._write_inputs(bucket, tokens, tables, starts, keys)
        if not self.capture:
            return self._run(bucket)[:rows]
        if bucket.graph is None:
            self._capture(bucket)
        assert bucket.graph is not None and bucket.output is not None
        bucket.graph.replay()
        return bucket.output[:rows]

    def _bucket(self, rows: int, keys: int) -> _Bucket:
        bucket = self._buckets.get((rows, keys))
        if bucket is None:
            width = keys // self.cache.block_size
            bucket = _Bucket(torch.zeros(rows, 2 + width, dtype=torch.long, device=self.device))
            self._buckets[(rows, keys)] = bucket
        return bucket

    def _write_inputs(
        self,
        bucket: _Bucket,
        tokens: Sequence[int],
        tables: Sequence[Sequence[int]],
        starts: Sequence[int],
        keys: int,
    ) -> None:
        """One host-to-device copy: each row's token, start and table; padding rows feed
        token 0 at position 0 of the scratch block."""
        padding = bucket.inputs.size(0) - len(tokens)
        scratch = self.cache.num_blocks
        width = bucket.inputs.size(1) - 2
        padded = self.cache.padded_tables(tables, keys)
        rows = zip(tokens, starts, padded, strict=True)
        host = [[token, start, *table] for token, start, table in rows]
        host += [[0, 0, *[scratch] * width]] * padding
        bucket.inputs.copy_(torch.tensor(host))

    def _run(self, bucket: _Bucket) -> Tensor:
        rows, width = bucket.tables.shape
        keys = width * self.cache.block_size
        step = self.cache.step_from(bucket.tables, bucket.starts, self._ones[:rows], keys, 1)
        with decoding(self.device, self.autocast_dtype, cache=False):
            return self.model.forward_rows(
                bucket.tokens, step.positions, step, step.attn_mask, step.last
            )

    def _capture(self, bucket: _Bucket) -> None:
        """Run the step once on a side stream (libraries set up their workspaces outside
        the capture), then record it (recording runs nothing). The warm-up writes the
        keys and values the replay writes again: running the step twice changes nothing."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            self._run(bucket)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            bucket.output = self._run(bucket)
        bucket.graph = graph
