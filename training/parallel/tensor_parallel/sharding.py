"""Split a full GPT or T5 state dict into tensor-parallel shards and join shards back.

The split follows :class:`training.models.tp_backend.TensorParallelBackend`:

=========================================  ==========  =================================
parameter                                  split dim   note
=========================================  ==========  =================================
embedding.word.weight, output.weight       0           vocabulary rows
attention.qkv.linear.weight / .bias        0           contiguous: whole KV groups per
                                                       rank in the grouped layout
mlp.fc1.linear.weight / .bias              0           per chunk: ``[gate; up]`` with
                                                       SwiGLU, each chunk split alone
attention.proj.weight, mlp.fc2.weight      1           input features
*.lora.b of qkv / fc1 (LoRA)                0           as the base weight (per chunk)
*.lora.a of proj / fc2 (LoRA)               1           as the base weight
cross_attention.q.linear.weight (T5)       0           heads
cross_attention.kv.weight (T5)             0           per chunk: ``[k; v]``
cross_attention.proj.weight (T5)           1           input features
relative_bias.weight (T5)                  1           the table's head columns
everything else (norms, row biases,        -           replicated
position embedding, the other LoRA factor)
=========================================  ==========  =================================

Names are matched by suffix, so prefixes (``module.``, ``_orig_mod.``) do not matter.
Resharding TP=a to TP=b is ``gather_tp_state_dict`` then ``shard_full_state_dict``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import Tensor

from megalith.config import ConfigError, ModelConfig

_SPLIT_PATTERNS: list[tuple[re.Pattern[str], int]] = [
    (re.compile(r"(^|\.)(embedding\.word|output)\.weight$"), 0),
    (re.compile(r"(^|\.)attention\.qkv\.linear\.(weight|bias)$"), 0),
    (re.compile(r"(^|\.)mlp\.fc1\.linear\.(weight|bias)$"), 0),
    (re.compile(r"(^|\.)(attention\.proj|mlp\.fc2)\.weight$"), 1),
    # LoRA adapters (training.finetune.lora): B like a column-parallel weight, A like a
    # row-parallel one; the other factor is replicated.
    (re.compile(r"(^|\.)(attention\.qkv|mlp\.fc1)\.linear\.lora\.b$"), 0),
    (re.compile(r"(^|\.)(attention\.proj|mlp\.fc2)\.lora\.a$"), 1),
    # T5 (training.models.t5): the decoder's cross-attention, and each stack's relative
    # position bias table [buckets, heads], split by head columns.
    (re.compile(r"(^|\.)cross_attention\.(q\.linear|kv)\.weight$"), 0),
    (re.compile(r"(^|\.)(cross_attention\.proj|relative_bias)\.weight$"), 1),
]
_FC1 = re.compile(r"(^|\.)mlp\.fc1\.linear\.(weight|bias|lora\.b)$")
_KV = re.compile(r"(^|\.)cross_attention\.kv\.weight$")


def check_tensor_parallel(config: ModelConfig, tp_size: int) -> None:
    """Raise a :class:`ConfigError` naming the model sizes that ``tp_size`` does not divide.

    KV groups are never split or replicated: each rank holds whole groups, so
    ``num_query_groups`` must be a multiple of the TP size (Megatron would replicate
    KV heads when there are fewer groups than ranks; this layout refuses instead).
    """
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_query_groups": config.num_query_groups,
        "ffn_hidden_size": config.ffn_hidden_size,
        "vocab_size": config.vocab_size,
    }
    bad = [f"model.{key} = {value}" for key, value in sizes.items() if value and value % tp_size]
    if bad:
        raise ConfigError(
            f"tensor parallel size {tp_size} does not divide {', '.join(bad)}; each rank "
            "holds whole attention heads and KV groups, an equal share of the FFN width and "
            "of the (padded) vocabulary"
        )


def partition_spec(name: str, config: ModelConfig) -> tuple[int, int] | None:
    """``(split dim, output chunks)`` of parameter ``name``, or None when replicated."""
    for pattern, dim in _SPLIT_PATTERNS:
        if pattern.search(name):
            gated = _FC1.search(name) and config.activation in ("swiglu", "geglu")
            return dim, 2 if gated or _KV.search(name) else 1
    return None


def shard_tensor(tensor: Tensor, dim: int, chunks: int, rank: int, size: int) -> Tensor:
    """Rank ``rank``'s part of ``tensor``: each of its ``chunks`` parts along ``dim``
    split ``size`` ways, this rank's pieces concatenated in chunk order."""
    pieces = [part.chunk(size, dim)[rank] for part in _chunks(tensor, dim, chunks)]
    return torch.cat(pieces, dim).clone()


def unshard_tensor(shards: Sequence[Tensor], dim: int, chunks: int) -> Tensor:
    """The inverse of :func:`shard_tensor` over all ranks' shards, in rank order."""
    per_rank = [_chunks(shard, dim, chunks) for shard in shards]
    parts = [torch.cat([pieces[c] for pieces in per_rank], dim) for c in range(chunks)]
    return torch.cat(parts, dim)


def _chunks(tensor: Tensor, dim: int, chunks: int) -> tuple[Tensor, ...]:
    if tensor.size(dim) % chunks:
        raise ValueError(f"size {tensor.size(dim)} of dim {dim} is not {chunks} equal chunks")
    return tensor.chunk(chunks, dim)


def shard_full_state_dict(
    full_state_dict: dict[str, Tensor], config: ModelConfig, tp_rank: int, tp_size: int
) -> dict[str, Tensor]:
    """The state dict of TP rank ``tp_rank`` of ``tp_size`` from a full (single-device) one."""
    check_tensor_parallel(config, tp_size)
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside 0..{tp_size - 1}")
    shard = {}
    for name, tensor in full_state_dict.items():
        spec = partition_spec(name, config)
        if spec is None or tp_size == 1:
            shard[name] = tensor.clone()
        else:
            shard[name] = shard_tensor(tensor, *spec, tp_rank, tp_size)
    return shard


def gather_tp_state_dict(
    shards: Sequence[dict[str, Tensor]], config: ModelConfig
) -> dict[str, Tensor]:
    """The full state dict from every TP rank's state dict (in TP rank order).

    Replicated tensors are taken from rank 0 (they are equal on every rank).
    """
    if not shards:
        raise ValueError("no shards to gather")
    names = list(shards[0])
    for rank, shard in enumerate(shards[1:], start=1):
        if set(shard) != set(names):
            missing = sorted(set(names).symmetric_difference(shard))
            raise ValueError(f"TP rank {rank} holds different tensors than rank 0: {missing}")
    full = {}
    for name in names:
        spec = partition_spec(name, config)
        if spec is None:
            full[name] = shards[0][name].clone()
        else:
            full[name] = unshard_tensor([shard[name] for shard in shards], *spec)
    return full


__all__ = [
    "check_tensor_parallel",
    "gather_tp_state_dict",
    "partition_spec",
    "shard_full_state_dict",
    "shard_tensor",
    "unshard_tensor",
]
