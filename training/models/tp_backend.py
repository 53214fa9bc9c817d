"""The tensor-parallel layer backend: :class:`GPTModel` split across a TP group.

``GPTModel(config, TensorParallelBackend(tp_group, sequence_parallel))`` on every rank
of ``tp_group`` builds one shard of the model:

- attention: the fused QKV projection is column-parallel with whole KV groups per
  rank (a contiguous split of Megatron's grouped layout), each rank attends with its
  ``heads/tp`` query heads and ``groups/tp`` KV groups, and the output projection is
  row-parallel;
- MLP: ``fc1`` column-parallel, split per chunk (SwiGLU's ``[gate; up]``), ``fc2``
  row-parallel;
- embedding and output head: vocab-parallel, the loss a vocab-parallel cross-entropy
  (no rank ever holds full-vocabulary logits); logits without labels are gathered;
- norms, position embeddings and row-parallel biases are replicated.

Sequence parallelism: the embeddings' output is split along the sequence, norms,
residual adds and dropout run on ``[B, T/tp, H]`` shards, column-parallel linears
all-gather the sequence and row-parallel ones reduce-scatter it. The replicated
parameters used on shards (norms, row biases) get their gradients all-reduced over
the TP group during backward (see :mod:`training.parallel.tensor_parallel.layers`).
Under SP every forward needs the sequence length divisible by the TP size, so
incremental decoding with a KV cache should build the model without SP (the
weights are the same).

Dropout: the residual stream is replicated across TP ranks without SP, so every TP
rank must draw the same dropout masks (TP peers are seeded identically, as Megatron's
default generator is). Attention dropout (each rank's own heads) and, under SP,
dropout on sequence shards draw per-rank masks (:mod:`training.parallel.random`).

Weights: parameter names equal the single-device model's; ``shard_full_state_dict``
and ``gather_tp_state_dict`` convert between the two.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from megalith.config import ModelConfig
from training.models import layers
from training.models.backend import BackendError, TorchBackend
from training.models.layers import NormSpec
from training.parallel.random import RankForked, rank_dropout
from training.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ScatterToSequenceParallel,
    VocabParallelEmbedding,
    VocabParallelOutputHead,
    sequence_parallel_norm,
)


class TensorParallelBackend(TorchBackend):
    """Megatron-style tensor (and optionally sequence) parallel layers over ``group``."""

    name = "tensor_parallel"

    def __init__(self, group: ProcessGroup, sequence_parallel: bool = False):
        self.group = group
        self.sequence_parallel = sequence_parallel

    @property
    def tensor_parallel_size(self) -> int:
        return dist.get_world_size(self.group)

    def moe_mlp(self, config: ModelConfig, norm: NormSpec) -> nn.Module:
        """A MoE MLP on this rank's sequence shard: the router and experts whole on every
        TP rank, their gradients summed over the group (:mod:`training.models.moe`)."""
        if not self.sequence_parallel:
            raise BackendError(
                "model.num_experts with parallel.tensor > 1 needs "
                "parallel.sequence_parallel=true: each tensor-parallel rank routes its own part "
                "of the sequence through the whole experts (as Megatron-core requires)"
            )
        layer = super().moe_mlp(config, norm)
        layer.replicate_over_tensor_parallel(self.group)
        return layer

    def norm(self, size: int, spec: NormSpec) -> nn.Module:
        if self.sequence_parallel:
            return sequence_parallel_norm(size, spec, self.group)
        return layers.make_norm(size, spec)

    def column_linear(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        init_std: float,
        output_chunks: int = 1,
    ) -> nn.Module:
        return ColumnParallelLinear(
            in_features,
            out_features,
            group=self.group,
            bias=bias,
            init_std=init_std,
            output_chunks=output_chunks,
            sequence_parallel=self.sequence_parallel,
        )

    def row_linear(
        self, in_features: int, out_features: int, *, bias: bool, init_std: float
    ) -> nn.Module:
        return RowParallelLinear(
            in_features,
            out_features,
            group=self.group,
            bias=bias,
            init_std=init_std,
            sequence_parallel=self.sequence_parallel,
        )

    def norm_linear(
        self,
        in_features: int,
        out_features: int,
        *,
        norm: NormSpec,
        bias: bool,
        init_std: float,
        output_chunks: int = 1,
    ) -> nn.Module:
        linear = self.column_linear(
            in_features, out_features, bias=bias, init_std=init_std, output_chunks=output_chunks
        )
        return layers.NormLinear(self.norm(in_features, norm), linear)

    def qkv(
        self,
        hidden_size: int,
        num_heads: int,
        num_groups: int,
        head_dim: int,
        *,
        norm: NormSpec,
        bias: bool,
        init_std: float,
    ) -> nn.Module:
        tp = self.tensor_parallel_size
        if num_groups % tp:
            raise BackendError(
                f"model.num_query_groups ({num_groups}) is not divisible by the tensor-parallel "
                f"size ({tp}): each TP rank holds whole KV groups, and replicating KV groups "
                "across ranks is not supported; use more query groups or a smaller TP size"
            )
        return super().qkv(
            hidden_size, num_heads, num_groups, head_dim, norm=norm, bias=bias, init_std=init_std
        )

    def vocab_embedding(self, vocab_size: int, hidden_size: int, *, init_std: float) -> nn.Module:
        # All-reduce, not reduce-scatter, even under SP: the model may add learned
        # positions to the full sequence before sequence_scatter splits it.
        return VocabParallelEmbedding(vocab_size, hidden_size, group=self.group, init_std=init_std)

    def dropout(self, p: float) -> nn.Module:
        if self.sequence_parallel:
            return rank_dropout(p, self.group)
        return nn.Dropout(p)

    def core_attention(
        self,
        num_heads: int,
        num_groups: int,
        head_dim: int,
        *,
        dropout: float,
        attention_backend: str = "auto",
    ) -> nn.Module:
        attention = super().core_attention(
            num_heads, num_groups, head_dim, dropout=dropout, attention_backend=attention_backend
        )
        return RankForked(attention, self.group, random=dropout > 0.0)

    def sequence_scatter(self) -> nn.Module:
        if self.sequence_parallel:
            return ScatterToSequenceParallel(self.group)
        return nn.Identity()

    def output_head(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        init_std: float,
        tied_weight: nn.Parameter | None,
        loss_chunk_tokens: int = 0,  # each rank holds only its vocabulary slice's logits
    ) -> nn.Module:
        return VocabParallelOutputHead(
            hidden_size,
            vocab_size,
            group=self.group,
            init_std=init_std,
            tied_weight=tied_weight,
            sequence_parallel=self.sequence_parallel,
        )


__all__ = ["TensorParallelBackend"]
