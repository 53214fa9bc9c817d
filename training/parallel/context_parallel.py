"""Context parallelism (CP): the sequence of every micro-batch split over the CP ranks.

Layout, Megatron's load balancing for causal attention: a sequence of ``S`` tokens is
cut into ``2·CP`` chunks of ``S / (2·CP)``; CP rank ``r`` holds chunks ``r`` and
``2·CP − 1 − r``. Under a causal mask late queries see more keys than early ones, so
pairing an early chunk with a late one gives every rank the same attention work.

Attention: all-gather of K and V over the CP group, Megatron-core's ``all_gather``
CP communication type (what Llama 3 trained with). Ring attention (K/V passed round
the ranks, overlapped with compute) is not built. Per layer:

- forward: each rank's keys and values (its KV groups only: under GQA that is
  ``groups/heads`` of the query size) are all-gathered in one collective and put back
  in sequence order; each of the rank's two query chunks attends to the key prefix
  that ends with it, through the wrapped backend's own core attention and the
  bottom-right causal mask it already uses for a KV cache. The result is exact.
- backward: the gradients of the gathered K/V are reduce-scattered (each rank's keys
  collect the gradient from every rank whose queries saw them).

Every rank holds the whole sequence's K/V of one layer at a time (``2·groups·D`` per
token), which is small next to the activations CP splits. Activation checkpointing
(full or selective) repeats the all-gather when it recomputes a block. With sequence
parallelism each TP rank holds ``1/TP`` of its CP part between the attention and MLP
blocks; the attention sees the CP part whole, so the two compose unchanged.

Positions: RoPE and learned positions use each token's *global* position
(:func:`positions`), since a rank's chunks are not contiguous.

Loss and gradients: each rank's micro-batch loss is
``CP · (sum of its tokens' losses) / (labels != -100 in the whole micro-batch)``.
Summed over the CP ranks that is ``CP ·`` the mean one device computes; DDP, the
distributed optimizer and FSDP average gradients over data × context (dividing by
``DP·CP``), which leaves exactly the single-device gradient. (Megatron multiplies the
loss by the CP size for the same reason.) The trainer's mean of the loss over data ×
context is then the single-device loss as well, in training and evaluation.

Dropout: CP ranks hold different tokens, so their dropout masks (hidden and
attention) come from per-rank streams (:mod:`training.parallel.random`), nested inside
the TP backend's where it forks too.

Weights are replicated over CP like over DP: checkpoints and the model package are
unchanged. KV-cache decoding is not context-parallel (build the model without CP).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from megalith.config import ModelConfig
from megalith.errors import MegalithError
from training.models.backend import LayerBackend
from training.models.layers import IGNORE_INDEX, NormSpec
from training.models.packing import document_causal_mask, document_positions
from training.parallel.groups import ParallelState
from training.parallel.random import RankForked
from training.parallel.tensor_parallel.mappings import gather_from_sequence_parallel_region

SEQUENCE_DIM = 1


def _chunk_length(length: int, cp_size: int) -> int:
    if length % (2 * cp_size):
        raise MegalithError(
            f"sequence length {length} is not divisible by 2 · context {cp_size} = "
            f"{2 * cp_size} (load-balanced context parallelism splits it into 2·context "
            "chunks); set data.seq_length to a multiple of it"
        )
    return length // (2 * cp_size)


def positions(length: int, cp_size: int, cp_rank: int, device=None) -> Tensor:
    """The global positions of CP rank ``cp_rank``'s tokens: chunks ``r`` and ``2·CP−1−r``."""
    chunk = _chunk_length(length, cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
            torch.arange(late * chunk, (late + 1) * chunk, device=device),
        ]
    )


def split_sequence(x: Tensor, cp_size: int, cp_rank: int, dim: int = SEQUENCE_DIM) -> Tensor:
    """CP rank ``cp_rank``'s part of ``x`` along ``dim``: its two load-balanced chunks."""
    if cp_size == 1:
        return x
    chunk = _chunk_length(x.size(dim), cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [x.narrow(dim, cp_rank * chunk, chunk), x.narrow(dim, late * chunk, chunk)], dim=dim
    )


def merge_sequence(parts: list[Tensor], dim: int = SEQUENCE_DIM) -> Tensor:
    """The inverse of :func:`split_sequence`: the whole sequence from every rank's part
    (in CP rank order)."""
    early = [part.chunk(2, dim)[0] for part in parts]
    late = [part.chunk(2, dim)[1] for part in reversed(parts)]
    return torch.cat(early + late, dim=dim)


def _gather_keys_values(k: Tensor, v: Tensor, group: ProcessGroup) -> tuple[Tensor, Tensor]:
    """Every rank's ``k``/``v [B, T, groups, D]`` in sequence order (autograd: the
    backward reduce-scatters the gradients)."""
    kv = torch.cat([k, v], dim=2)  # one collective for both
    gathered = gather_from_sequence_parallel_region(kv, group)  # ranks' parts in rank order
    merged = merge_sequence(list(gathered.chunk(dist.get_world_size(group), SEQUENCE_DIM)))
    return merged.chunk(2, dim=2)


class ContextParallelAttention(nn.Module):
    """Exact causal attention of this rank's two query chunks against the whole
    sequence's keys, gathered over the CP group; ``inner`` is the backend's own core
    attention (its bottom-right causal mask for ``S > T`` does the offsets)."""

    def __init__(self, inner: nn.Module, group: ProcessGroup):
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        """``attn_mask [B, 1, T, S]``: this rank's rows of packed documents' (bool) mask
        against the whole sequence's keys (:func:`packed_documents_part`), else causal.
        A float ``attn_mask`` is added to the scores and is complete: this rank's rows
        against every gathered key, holding any causality itself (a T5's relative bias
        and masks, :class:`training.models.t5.ContextShard`; its keys may be another
        sequence's, as the cross-attention's encoder positions), so it is applied to
        every key at once."""
        cp_size, cp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if cp_size == 1:
            return self.inner(q, k, v) if attn_mask is None else self.inner(q, k, v, attn_mask)
        if attn_mask is not None and attn_mask.is_floating_point():
            k, v = _gather_keys_values(k, v, self.group)
            return self.inner(q, k, v, attn_mask)
        if k.size(1) != q.size(1):
            raise MegalithError(
                "a KV cache is not supported under context parallelism; build the model "
                "for decoding without parallel.context"
            )
        k, v = _gather_keys_values(k, v, self.group)
        chunk = q.size(1) // 2
        early, late = q.split(chunk, dim=1)
        # Chunk m (global) sees keys 0 .. (m+1)·chunk − 1, causally within itself.
        seen_early = (cp_rank + 1) * chunk
        seen_late = (2 * cp_size - cp_rank) * chunk
        if attn_mask is None:
            out_early = self.inner(early, k[:, :seen_early], v[:, :seen_early])
            out_late = self.inner(late, k[:, :seen_late], v[:, :seen_late])
        else:  # a chunk's rows are False past its causal prefix of keys anyway
            mask_early = attn_mask[:, :, :chunk, :seen_early]
            mask_late = attn_mask[:, :, chunk:, :seen_late]
            out_early = self.inner(early, k[:, :seen_early], v[:, :seen_early], mask_early)
            out_late = self.inner(late, k[:, :seen_late], v[:, :seen_late], mask_late)
        return torch.cat([out_early, out_late], dim=1)


class ContextParallelBackend(LayerBackend):
    """Any backend (plain, tensor-parallel) with its core attention made context-parallel;
    every other layer is the wrapped backend's."""

    def __init__(self, inner: LayerBackend, group: ProcessGroup):
        self.inner = inner
        self.group = group
        self.name = f"{inner.name}+context_parallel"

    @property
    def tensor_parallel_size(self) -> int:
        return self.inner.tensor_parallel_size

    def norm(self, size: int, spec: NormSpec) -> nn.Module:
        return self.inner.norm(size, spec)

    def column_linear(self, in_features: int, out_features: int, **kwargs) -> nn.Module:
        return self.inner.column_linear(in_features, out_features, **kwargs)

    def row_linear(self, in_features: int, out_features: int, **kwargs) -> nn.Module:
        return self.inner.row_linear(in_features, out_features, **kwargs)

    def norm_linear(self, in_features: int, out_features: int, **kwargs) -> nn.Module:
        return self.inner.norm_linear(in_features, out_features, **kwargs)

    def qkv(self, hidden_size: int, num_heads: int, num_groups: int, head_dim: int, **kwargs):
        return self.inner.qkv(hidden_size, num_heads, num_groups, head_dim, **kwargs)

    def vocab_embedding(self, vocab_size: int, hidden_size: int, *, init_std: float) -> nn.Module:
        return self.inner.vocab_embedding(vocab_size, hidden_size, init_std=init_std)

    def moe_mlp(self, config: ModelConfig, norm: NormSpec) -> nn.Module:
        return self.inner.moe_mlp(config, norm)  # the TP backend's: experts whole, grads summed

    def sequence_scatter(self) -> nn.Module:
        return self.inner.sequence_scatter()

    def dropout(self, p: float) -> nn.Module:
        # CP ranks hold different tokens: their masks must differ (within the TP fork
        # of the wrapped backend, if any).
        return RankForked(self.inner.dropout(p), self.group, random=p > 0.0)

    def core_attention(
        self,
        num_heads: int,
        num_groups: int,
        head_dim: int,
        *,
        dropout: float,
        attention_backend: str = "auto",
    ) -> nn.Module:
        inner = self.inner.core_attention(
            num_heads, num_groups, head_dim, dropout=dropout, attention_backend=attention_backend
        )
        return RankForked(ContextParallelAttention(inner, self.group), self.group, dropout > 0.0)

    def output_head(self, hidden_size: int, vocab_size: int, **kwargs) -> nn.Module:
        return self.inner.output_head(hidden_size, vocab_size, **kwargs)


def wrap_backend(backend: LayerBackend, state: ParallelState) -> LayerBackend:
    """``backend`` made context-parallel over the state's CP group; itself without CP."""
    if state.sizes.cp == 1:
        return backend
    return ContextParallelBackend(backend, state.cp_group)


def micro_batch_loss(
    model: nn.Module, tokens: Tensor, labels: Tensor, state: ParallelState
) -> Tensor:
    """This CP rank's share of the micro-batch loss (see the module docstring):
    ``CP · sum(its token losses) / count(labels != -100 over the whole sequence)``.

    ``tokens`` and ``labels`` are the whole micro-batch ``[B, S]``, the same on every
    CP rank; each keeps its load-balanced part.
    """
    cp_size, cp_rank = state.sizes.cp, state.cp_rank
    count = (labels != IGNORE_INDEX).sum()
    local_positions = positions(tokens.size(1), cp_size, cp_rank, tokens.device)
    losses = model(
        split_sequence(tokens, cp_size, cp_rank),
        labels=split_sequence(labels, cp_size, cp_rank),
        loss_reduction="none",
        position_ids=local_positions,
    )
    return losses.sum() * cp_size / count


def packed_documents_part(document_ids: Tensor, state: ParallelState) -> tuple[Tensor, Tensor]:
    """This CP rank's positions ``[B, T]`` and attention-mask rows ``[B, 1, T, S]`` of
    packed documents ``document_ids [B, S]`` (the whole micro-batch, the same on every CP
    rank): positions restart at each document, queries attend within theirs, causally,
    to the whole sequence's keys that the attention gathers."""
    cp_size, cp_rank = state.sizes.cp, state.cp_rank
    positions = split_sequence(document_positions(document_ids), cp_size, cp_rank)
    mask = split_sequence(document_causal_mask(document_ids), cp_size, cp_rank, dim=2)
    return positions, mask


__all__ = [
    "ContextParallelAttention",
    "ContextParallelBackend",
    "merge_sequence",
    "micro_batch_loss",
    "packed_documents_part",
    "positions",
    "split_sequence",
    "wrap_backend",
]
