"""A paged KV cache: keys and values in fixed-size blocks, read through block tables.

Every layer's keys (and values) are one preallocated tensor of ``num_blocks`` blocks of
``block_size`` positions, ``[num_blocks + 1, block_size, groups, head_dim]`` stored as
flat slots; a sequence's block table (:mod:`training.inference.block_pool`) says which
blocks hold its positions, in order. The extra last block is scratch: padding tokens
write there and padded key positions read from there, always masked out.

One model step over rows at different positions is a :class:`PagedStep`: row ``b``
feeds ``counts[b]`` new tokens at positions ``starts[b]...`` (one while decoding, a
chunk of the prompt while prefilling). Attention calls its ``update`` as it calls
:class:`training.models.gpt.KVCache`'s: the new keys/values go to their slots, and each
row's keys/values ``0 .. starts[b]+counts[b]-1`` come back gathered into a padded
``[B, S, heads, D]`` with a causal mask per row (``attn_mask``, additive). In a prefill
step the key/value heads come back repeated for every query head (grouped-query
attention): with a mask, the fused kernel that CUDA has besides cuDNN's
(memory-efficient) takes no grouped heads, and cuDNN's plans anew for every key length
(``training.inference.runtime``). A decode step (one token a row) gets them as stored,
``[B, S, groups, D]``: attention folds each group's query heads into queries of that
group instead (``training.models.layers.SDPAttention``). Plain PyTorch: the gather copies
every row's context once per layer and step; a paged attention kernel (vLLM's,
FlashInfer's) reads the blocks in place instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from training.models.gpt import GPTModel


class PagedKVCache:
    """Keys and values of every layer in blocks, ``[L, (num_blocks + 1) * block_size, groups, D]``."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_groups: int,
        head_dim: int,
        *,
        num_heads: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.head_repeats = (num_heads or num_groups) // num_groups
        shape = (num_layers, (num_blocks + 1) * block_size, num_groups, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)

    @classmethod
    def for_model(
        cls,
        model: GPTModel,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
    ) -> PagedKVCache:
        """A cache shaped for ``model``, on its device; ``dtype`` defaults to its parameters'."""
        param = model.embedding.word.weight
        attention = model.layers[0].attention
        return cls(
            model.config.num_layers,
            num_blocks,
            block_size,
            attention.num_groups,
            attention.head_dim,
            num_heads=attention.num_heads,
            device=param.device,
            dtype=dtype or param.dtype,
        )

    @property
    def bytes_per_block(self) -> int:
        per_slot = self.keys[:, 0].numel() * self.keys.element_size()
        return 2 * per_slot * self.block_size

    def step(
        self, tables: Sequence[Sequence[int]], starts: Sequence[int], counts: Sequence[int]
    ) -> PagedStep:
        """The view one forward uses: row ``b`` feeds ``counts[b] >= 1`` tokens at
        positions ``starts[b]...``, within the blocks ``tables[b]``."""
        device = self.keys.device
        length = max(s + c for s, c in zip(starts, counts, strict=True))
        table = torch.tensor(self.padded_tables(tables, length), device=device)
        start = torch.tensor(starts, device=device)
        count = torch.tensor(counts, device=device)
        return self.step_from(table, start, count, length, max(counts))

    def padded_tables(self, tables: Sequence[Sequence[int]], length: int) -> list[list[int]]:
        """Each table cut or padded (with the scratch block) to cover ``length`` positions."""
        width = math.ceil(length / self.block_size)
        scratch = self.num_blocks
        return [[*t[:width], *[scratch] * (width - len(t))] for t in tables]

    def step_from(
        self, table: Tensor, start: Tensor, count: Tensor, length: int, tokens: int
    ) -> PagedStep:
        """:meth:`step` from tensors on the cache's device: ``table [B, W]`` covering
        ``length <= W * block_size`` key positions, ``start``/``count [B]``, and ``tokens``,
        the largest count. Nothing here reads a tensor back to the host, so a CUDA graph
        can capture it (:mod:`training.inference.decode_graphs`)."""
        size, scratch = self.block_size, self.num_blocks
        start, count = start[:, None], count[:, None]

        def slots(positions: Tensor) -> Tensor:
            return table.gather(1, positions // size) * size + positions % size

        offsets = torch.arange(tokens, device=table.device)[None]
        # A padding token repeats its row's last position; it writes to scratch.
        positions = start + torch.minimum(offsets, count - 1)
        write = torch.where(offsets < count, slots(positions), scratch * size)
        keys = torch.arange(length, device=table.device)
        read = slots(keys.expand(table.size(0), length))
        allowed = (keys[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        return PagedStep(
            self, positions, self._bias(allowed), count[:, 0] - 1, write.flatten(), read
        )

    def _bias(self, allowed: Tensor) -> Tensor:
        """``allowed [B, 1, T, S]`` as the additive mask SDPA's memory-efficient kernel
        reads in place: in the cache's dtype, rows padded to a multiple of 16 (otherwise
        every layer's attention converts and pads the mask again)."""
        dtype = self.keys.dtype
        length = allowed.size(-1)
        shape = (*allowed.shape[:-1], math.ceil(length / 16) * 16)
        bias = torch.full(shape, torch.finfo(dtype).min, dtype=dtype, device=allowed.device)
        return bias[..., :length].masked_fill_(allowed, 0.0)


@dataclass(frozen=True)
class PagedStep:
    """One forward's rows in a :class:`PagedKVCache` (see the module docstring)."""

    cache: PagedKVCache
    positions: Tensor  # [B, T]
    attn_mask: Tensor  # [B, 1, T, S] additive: 0 where a query may attend, else the lowest
    last: Tensor  # [B] each row's last new token
    write_slots: Tensor  # [B * T]
    read_slots: Tensor  # [B, S]

    def update(self, layer: int, k: Tensor, v: Tensor, start_pos: int) -> tuple[Tensor, Tensor]:
        """Store ``k``/``v [B, T, groups, D]`` in their slots (``start_pos`` is unused: each
        row has its own); return every row's keys/values, ``[B, S, groups, D]`` when
        decoding (``T = 1``), else ``[B, S, heads, D]``."""
        keys, values = self.cache.keys[layer], self.cache.values[layer]
        keys.index_copy_(0, self.write_slots, k.flatten(0, 1).to(keys.dtype))
        values.index_copy_(0, self.write_slots, v.flatten(0, 1).to(values.dtype))
        repeats = self.cache.head_repeats
        if self.positions.size(1) == 1:
            return keys[self.read_slots], values[self.read_slots]
        return (
            keys[self.read_slots].repeat_interleave(repeats, dim=2),
            values[self.read_slots].repeat_interleave(repeats, dim=2),
        )
