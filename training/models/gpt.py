"""A decoder-only GPT: Llama style (RoPE, RMSNorm, SwiGLU, GQA, no biases) or GPT-2
style (learned positions, LayerNorm, GELU, biases), chosen by :class:`ModelConfig`.

Pre-norm blocks, ``x + attention(x)`` then ``x + mlp(x)``, where each branch's input
norm is fused into its first linear (``attention.qkv``, ``mlp.fc1``), the layout of
Megatron's Transformer Engine spec. Parameter names (torch backend)::

    embedding.word.weight                      [V, H]
    embedding.position.weight                  [P, H]        learned positions only
    layers.{i}.attention.qkv.norm.weight       [H]           (+ .bias with LayerNorm)
    layers.{i}.attention.qkv.linear.weight     [(n + 2g)·d, H]  grouped layout, see below
    layers.{i}.attention.qkv.linear.bias                     with bias
    layers.{i}.attention.proj.weight           [H, n·d]      (+ .bias)
    layers.{i}.mlp.fc1.norm.weight             [H]           (+ .bias with LayerNorm)
    layers.{i}.mlp.fc1.linear.weight           [F, H] GELU; [2F, H] SwiGLU as [gate; up]
    layers.{i}.mlp.fc2.weight                  [H, F]        (+ .bias)
    final_norm.weight                          [H]           (+ .bias with LayerNorm)
    output.weight                              [V, H]        an alias of embedding.word.weight when tied

With ``model.num_experts``, MoE blocks hold ``layers.{i}.mlp.norm``, ``.router`` and
stacked ``.experts`` tensors instead of ``fc1``/``fc2`` (see :mod:`training.models.moe`).

(V vocabulary, P positions, H hidden, F ffn_hidden_size, n heads, g KV groups, d head
dim.) QKV rows are grouped per KV group as in Megatron: for each group j = 0..g-1, the
n/g query heads of group j, then k_j, then v_j, d rows each; query head h uses group
h // (n/g). A contiguous tensor-parallel split gives whole groups; exporting to
separate q/k/v projections must un-interleave. See :meth:`LayerBackend.qkv`.

Activation checkpointing (``ModelConfig.activation_checkpointing``), per block:

- ``full``: only the block's input is kept; the whole block is recomputed in backward.
- ``selective``: the block keeps the outputs of its matrix products and attention
  kernel and recomputes the cheap memory-bound ops in between (norms, RoPE, the
  SwiGLU/GELU activation, residual adds; dropout replays the same RNG state), using
  torch's selective-checkpoint policy. Measured per token, fp32, FFN 4H: a Llama
  block saves 12.5·H values instead of 25·H, a GPT-2 block 10·H instead of 15·H
  (``full``: none beyond the block input), with no extra matmul FLOPs. Recomputing
  only the attention core, Megatron's choice, saves nothing with SDPA, which never
  materialises the score matrix.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from megalith.config import ConfigError, ModelConfig
from training.models.backend import LayerBackend, resolve_backend
from training.models.layers import (
    Embedding,
    NormSpec,
    RotaryEmbedding,
    apply_rope,
    geglu,
    gelu,
    gelu_erf,
    residual_stream,
    scaled_init_std,
    swiglu,
)
from training.models.packing import document_causal_mask, document_positions

Rope = tuple[Tensor, Tensor]


class KVCache:
    """Keys and values of every layer for incremental decoding, ``[L, B, S_max, groups, D]``."""

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        max_length: int,
        num_groups: int,
        head_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        shape = (num_layers, batch_size, max_length, num_groups, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def batch_size(self) -> int:
        return self.keys.size(1)

    @property
    def max_length(self) -> int:
        return self.keys.size(2)

    def update(self, layer: int, k: Tensor, v: Tensor, start_pos: int) -> tuple[Tensor, Tensor]:
        """Store ``k``/``v [B, T, groups, D]`` at ``start_pos``; return keys/values 0..start_pos+T."""
        end = start_pos + k.size(1)
        self.keys[layer, :, start_pos:end] = k
        self.values[layer, :, start_pos:end] = v
        return self.keys[layer, :, :end], self.values[layer, :, :end]


class KVStore(Protocol):
    """What attention needs from a cache: :class:`KVCache`, or a paged cache's view of one
    step (:mod:`training.inference.paged_cache`), which knows where each row's tokens go."""

    def update(self, layer: int, k: Tensor, v: Tensor, start_pos: int) -> tuple[Tensor, Tensor]: ...


def _norm_spec(config: ModelConfig) -> NormSpec:
    return NormSpec(kind=config.normalization, eps=config.norm_eps, bias=config.bias)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: LayerBackend, layer_index: int):
        super().__init__()
        tp = backend.tensor_parallel_size
        self.layer_index = layer_index
        self.uses_rope = layer_index not in config.nope_layers
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = config.num_query_groups // tp
        self.head_dim = config.head_dim
        self.qkv = backend.qkv(
            config.hidden_size,
            config.num_attention_heads,
            config.num_query_groups,
            config.head_dim,
            norm=_norm_spec(config),
            bias=config.bias,
            init_std=config.init_std,
        )
        self.core = backend.core_attention(
            self.num_heads,
            self.num_groups,
            self.head_dim,
            dropout=config.dropout,
            attention_backend=config.attention_backend,
        )
        self.proj = backend.row_linear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            bias=config.bias,
            init_std=scaled_init_std(config.init_std, config.num_layers),
        )
        self.dropout = backend.dropout(config.dropout)

    def forward(
        self,
        x: Tensor,
        rope: Rope | None,
        kv_cache: KVStore | None,
        start_pos: int,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        qkv = self.qkv(x)
        batch, length = qkv.shape[:2]  # x may be a sequence shard; qkv is the whole sequence
        per_group = self.num_heads // self.num_groups
        qkv = qkv.view(batch, length, self.num_groups, per_group + 2, self.head_dim)
        q, k, v = qkv.split([per_group, 1, 1], dim=3)
        k, v = k.squeeze(3), v.squeeze(3)
        if rope is not None and self.uses_rope:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q = q.reshape(batch, length, self.num_heads, self.head_dim)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_index, k, v, start_pos)
        # The mask only when given: core attentions that take none (context parallel) still work.
        out = self.core(q, k, v) if attn_mask is None else self.core(q, k, v, attn_mask)
        return self.dropout(self.proj(out))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, backend: LayerBackend):
        super().__init__()
        gated = config.activation in ("swiglu", "geglu")
        chunks = 2 if gated else 1
        self.fc1 = backend.norm_linear(
            config.hidden_size,
            chunks * config.ffn_hidden_size,
            norm=_norm_spec(config),
            bias=config.bias,
            init_std=config.init_std,
            output_chunks=chunks,
        )
        self.activation = {"swiglu": swiglu, "geglu": geglu, "gelu": gelu}[config.activation]
        if config.activation == "gelu" and config.gelu_approximation == "none":
            self.activation = gelu_erf
        # Where the backend runs the whole MLP as one module (TE's LayerNormMLP), with
        # these same parameters; kept outside the module tree.
        self.fused = backend.fused_mlp(
            config.hidden_size,
            config.ffn_hidden_size,
            activation=self.activation.__name__,
            norm=_norm_spec(config),
            bias=config.bias,
        )
        self.fc2 = backend.row_linear(
            config.ffn_hidden_size,
            config.hidden_size,
            bias=config.bias,
            init_std=scaled_init_std(config.init_std, config.num_layers),
        )
        self.dropout = backend.dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused is not None and self.fused.runs_for(x):
            return self.dropout(self.fused(self, x))
        return self.dropout(self.fc2(self.activation(self.fc1(x))))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, backend: LayerBackend, layer_index: int):
        super().__init__()
        self.attention = Attention(config, backend, layer_index)
        if config.is_moe_layer(layer_index):
            self.mlp = backend.moe_mlp(config, _norm_spec(config))
        else:
            self.mlp = MLP(config, backend)

    def forward(
        self,
        x: Tensor,
        rope: Rope | None,
        kv_cache: KVStore | None = None,
        start_pos: int = 0,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        x = x + self.attention(x, rope, kv_cache, start_pos, attn_mask)
        return x + self.mlp(x)


class Embeddings(nn.Module):
    """Token embedding, plus learned positions for GPT-2 style, then dropout."""

    def __init__(self, config: ModelConfig, backend: LayerBackend):
        super().__init__()
        self.word = backend.vocab_embedding(
            config.vocab_size, config.hidden_size, init_std=config.init_std
        )
        self.position = None
        if config.position_embedding == "learned":
            self.position = Embedding(
                config.max_position_embeddings, config.hidden_size, init_std=config.init_std
            )
        self.to_sequence_shards = backend.sequence_scatter()
        self.dropout = backend.dropout(config.dropout)

    def forward(self, tokens: Tensor, start_pos: int, positions: Tensor | None = None) -> Tensor:
        x = self.word(tokens)
        if self.position is not None:
            if positions is None:
                positions = torch.arange(
                    start_pos, start_pos + tokens.size(1), device=tokens.device
                )
            x = x + self.position(positions)
        return self.dropout(self.to_sequence_shards(x))


def reset_submodules(model: nn.Module) -> None:
    """Call ``reset_parameters`` of every submodule that has one (a model's init_weights)."""
    for module in model.modules():
        if module is not model and hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return (
        CheckpointPolicy.MUST_SAVE
        if op in SELECTIVE_SAVED_OPS
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


def _saved_ops() -> set[torch._ops.OpOverload]:
    aten = torch.ops.aten
    names = [
        "mm", "addmm", "bmm", "baddbmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_mm",  # float8 matmuls (training.precision.fp8)
    ]  # fmt: skip
    return {getattr(aten, name).default for name in names if hasattr(aten, name)}


# Ops whose outputs selective checkpointing keeps; a tensor-parallel backend may add
# its collectives here so they are not repeated during recomputation.
SELECTIVE_SAVED_OPS = _saved_ops()


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


class GPTModel(nn.Module):
    """The decoder; ``forward`` returns logits, or the loss when given labels."""

    def __init__(self, config: ModelConfig, backend: LayerBackend | None = None):
        super().__init__()
        for key in ("vocab_size", "max_position_embeddings"):
            if getattr(config, key) is None:
                raise ConfigError(
                    f"model.{key} must be set (or filled from the data) to build the model"
                )
        self.config = config
        self.backend = backend or resolve_backend(config.backend)
        self.activation_checkpointing = config.activation_checkpointing
        self.embedding = Embeddings(config, self.backend)
        self.rope = None
        if config.position_embedding == "rope":
            self.rope = RotaryEmbedding(
                config.head_dim,
                config.max_position_embeddings,
                config.rope_base,
                config.rope_scaling,
            )
        self.layers = nn.ModuleList(
            TransformerBlock(config, self.backend, i) for i in range(config.num_layers)
        )
        self.final_norm = self.backend.norm(config.hidden_size, _norm_spec(config))
        tied = self.embedding.word.weight if config.tie_embeddings else None
        self.output = self.backend.output_head(
            config.hidden_size,
            config.vocab_size,
            init_std=config.init_std,
            tied_weight=tied,
            loss_chunk_tokens=config.loss_chunk_tokens,
        )

    @staticmethod
    def layer_stacks(config: ModelConfig) -> dict[str, tuple[str, int]]:
        """``{state-dict prefix: (config key, block count)}`` of the numbered blocks, for
        comparing a config with the tensors of a file before building the model."""
        return {"layers": ("num_layers", config.num_layers)}

    def transformer_blocks(self) -> list[nn.Module]:
        """The blocks in order (one FSDP unit each)."""
        return list(self.layers)

    @property
    def tied_weights(self) -> dict[str, str]:
        """State-dict names that alias another entry (``{alias: source}``); save the source once."""
        return {"output.weight": "embedding.word.weight"} if self.config.tie_embeddings else {}

    def tie_weights(self) -> None:
        """Make the output head use the embedding's Parameter again (after ``to_empty``,
        which gives every module a fresh one)."""
        if self.config.tie_embeddings:
            self.output.weight = self.embedding.word.weight

    def init_weights(self) -> None:
        """Re-initialise every parameter (after ``to_empty`` from the meta device, say)."""
        reset_submodules(self)

    def new_kv_cache(
        self,
        batch_size: int,
        max_length: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """An empty cache for ``forward(..., kv_cache=cache, start_pos=...)``; defaults to
        the parameters' device and dtype."""
        if max_length > self.config.max_position_embeddings:
            raise ValueError(
                f"max_length {max_length} exceeds max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        param = self.embedding.word.weight
        attention = self.layers[0].attention
        return KVCache(
            self.config.num_layers,
            batch_size,
            max_length,
            attention.num_groups,
            attention.head_dim,
            device=device or param.device,
            dtype=dtype or param.dtype,
        )

    def forward(
        self,
        tokens: Tensor,
        labels: Tensor | None = None,
        *,
        loss_reduction: Literal["mean", "none"] = "mean",
        kv_cache: KVCache | None = None,
        start_pos: int = 0,
        position_ids: Tensor | None = None,
        document_ids: Tensor | None = None,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        """``tokens [B, T]`` -> fp32 logits ``[B, T, V]``, or with ``labels [B, T]`` the
        cross-entropy (mean over labels != -100, or ``[B, T]`` with ``loss_reduction="none"``).

        With ``kv_cache``, ``tokens`` are positions ``start_pos .. start_pos+T-1`` and attend
        to the cached positions before them; the cache is updated in place.
        ``position_ids [T]`` (or ``[B, T]``) gives the tokens' positions instead (for RoPE
        or learned positions), for a sequence part that is not contiguous (context
        parallelism). ``document_ids [B, T]`` marks packed documents
        (:mod:`training.models.packing`): attention stays within each document and
        positions restart at each one. ``attn_mask [B, 1, T, S]`` (bool, True: may attend)
        replaces the causal mask: a context-parallel rank's rows of its packed documents'
        mask, against the whole sequence's keys (:func:`training.parallel.context_parallel.
        packed_documents_part`).
        """
        self._check_positions(tokens, kv_cache, start_pos)
        self._check_position_ids(tokens, position_ids, kv_cache)
        if document_ids is not None:
            self._check_document_ids(tokens, document_ids, position_ids, kv_cache, attn_mask)
            position_ids = document_positions(document_ids)
            attn_mask = document_causal_mask(document_ids)
        x = self.embedding(tokens, start_pos, position_ids)
        rope = None
        if self.rope is not None:
            rope = self.rope(start_pos, tokens.size(1), x.device, position_ids)
        for block in self.layers:
            x = self._run_block(block, x, rope, kv_cache, start_pos, attn_mask)
        x = self.final_norm(x)
        if labels is None:
            return self.output(x).float()
        return self.output.loss(x, labels, reduction=loss_reduction)

    @torch.no_grad()
    def forward_rows(
        self, tokens: Tensor, positions: Tensor, kv_cache: KVStore, attn_mask: Tensor, last: Tensor
    ) -> Tensor:
        """Inference with every row at its own positions (continuous batching): ``tokens``
        and their ``positions [B, T]`` -> fp32 logits ``[B, V]`` of token ``last[b]`` of
        each row ``b``.

        ``kv_cache.update`` stores the new keys/values where they belong (it ignores
        ``start_pos``) and returns the keys/values the rows attend to, ``[B, S, groups, D]``
        or with the heads repeated, ``[B, S, heads, D]``; ``attn_mask [B, 1, T, S]`` (bool,
        True: may attend, or added to the scores) says which. The training ``forward`` is
        untouched by this path; one process only (no tensor parallelism). Nothing here
        reads a tensor back to the host: a CUDA graph can capture it.
        """
        if self.backend.tensor_parallel_size > 1:
            raise ValueError("forward_rows runs one process: no tensor-parallel backend")
        x = self.embedding(tokens, 0, positions)
        rope = None
        if self.rope is not None:
            # The whole table, so that the step never waits for the positions' maximum.
            cos, sin = self.rope(0, self.config.max_position_embeddings, tokens.device)
            rope = (cos[positions], sin[positions])  # the same table as forward's
        for block in self.layers:
            x = block(x, rope, kv_cache, 0, attn_mask)
        x = x[torch.arange(x.size(0), device=x.device), last]
        return self.output(self.final_norm(x)).float()

    def _run_block(
        self,
        block: TransformerBlock,
        x: Tensor,
        rope: Rope | None,
        kv_cache: KVCache | None,
        start_pos: int,
        attn_mask: Tensor | None = None,
    ) -> Tensor:
        x = residual_stream(x, self.config.fp32_residual)
        mode = self.activation_checkpointing
        if mode == "none" or kv_cache is not None or not torch.is_grad_enabled():
            return block(x, rope, kv_cache, start_pos, attn_mask)
        masked = {} if attn_mask is None else {"attn_mask": attn_mask}
        if mode == "full":
            return checkpoint(block, x, rope, use_reentrant=False, **masked)
        return checkpoint(
            block, x, rope, use_reentrant=False, context_fn=_selective_context, **masked
        )

    def _check_position_ids(
        self, tokens: Tensor, position_ids: Tensor | None, kv_cache: KVCache | None
    ) -> None:
        if position_ids is None:
            return
        if kv_cache is not None or position_ids.shape not in (tokens.shape[1:], tokens.shape):
            raise ValueError(
                f"position_ids must be [length] = [{tokens.size(1)}] or [batch, length] = "
                f"{list(tokens.shape)} and without a kv_cache, got shape "
                f"{tuple(position_ids.shape)}"
            )

    def _check_document_ids(
        self,
        tokens: Tensor,
        document_ids: Tensor,
        position_ids: Tensor | None,
        kv_cache: KVCache | None,
        attn_mask: Tensor | None,
    ) -> None:
        if kv_cache is not None or position_ids is not None or attn_mask is not None:
            raise ValueError(
                "document_ids cannot be combined with a kv_cache, position_ids or attn_mask"
            )
        if document_ids.shape != tokens.shape:
            raise ValueError(
                f"document_ids must be [batch, length] = {list(tokens.shape)}, "
                f"got shape {tuple(document_ids.shape)}"
            )

    def _check_positions(self, tokens: Tensor, kv_cache: KVCache | None, start_pos: int) -> None:
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, length], got shape {tuple(tokens.shape)}")
        end = start_pos + tokens.size(1)
        if start_pos < 0 or end > self.config.max_position_embeddings:
            raise ValueError(
                f"positions {start_pos}..{end - 1} are outside 0..{self.config.max_position_embeddings - 1} "
                "(model.max_position_embeddings)"
            )
        if kv_cache is None:
            if start_pos:
                raise ValueError("start_pos > 0 needs a kv_cache holding the earlier positions")
            return
        if end > kv_cache.max_length or tokens.size(0) != kv_cache.batch_size:
            raise ValueError(
                f"tokens of batch {tokens.size(0)} at positions up to {end - 1} do not fit a KV "
                f"cache of batch {kv_cache.batch_size} and length {kv_cache.max_length}"
            )


__all__ = ["GPTModel", "KVCache", "KVStore", "TransformerBlock"]
