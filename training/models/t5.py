"""A T5 v1.1-style encoder-decoder, built from the same :class:`LayerBackend` as GPT.

The encoder is a stack of bidirectional pre-norm blocks (``gpt.TransformerBlock``:
self-attention with its fused input norm, then a gated-GELU MLP); the decoder's blocks
add a cross-attention over the encoder's output between their causal self-attention
and their MLP. RMSNorm, no biases, one token embedding shared by both stacks (HF's
``shared``), a final norm per stack and an untied output head whose loss takes hidden
states (``backend.output_head``). Parameter names (torch backend)::

    embedding.word.weight                              [V, H]
    encoder.relative_bias.weight                       [buckets, n]  relative positions
    encoder.layers.{i}.attention.qkv.{norm,linear}.weight    as GPT (grouped QKV layout)
    encoder.layers.{i}.attention.proj.weight           [H, n·d]
    encoder.layers.{i}.mlp.fc1.{norm,linear}.weight    [2F, H] as [gate; up] with geglu
    encoder.layers.{i}.mlp.fc2.weight                  [H, F]
    encoder.final_norm.weight                          [H]
    decoder.relative_bias.weight                       [buckets, n]  relative positions
    decoder.layers.{j}.attention.*                     causal self-attention, as encoder
    decoder.layers.{j}.cross_attention.q.norm.weight   [H]
    decoder.layers.{j}.cross_attention.q.linear.weight [n·d, H]
    decoder.layers.{j}.cross_attention.kv.weight       [2·n·d, H] as [k; v]
    decoder.layers.{j}.cross_attention.proj.weight     [H, n·d]
    decoder.layers.{j}.mlp.*                           as encoder
    decoder.final_norm.weight                          [H]
    output.weight                                      [V, H]

Positions: ``relative`` is T5's bucketed bias added to the attention scores, one table
per stack shared by its layers (bidirectional buckets in the encoder, causal ones in the
decoder; the cross-attention has none), as Hugging Face's ``T5Attention``; ``rope``
rotates queries and keys of both self-attentions instead. Scores are scaled by
``1/sqrt(head_dim)`` as everywhere else in Megalith (T5 does not scale: the HF export
folds the factor into the query weights, :mod:`training.interop.hf_t5`).

Masks reach the core attention as one float tensor added to the scores (relative bias,
the most negative value where a key is padding or in the future), built once per
stack and forward; padded encoder positions are never attended to, by the encoder's
self-attention nor by the decoder's cross-attention.

Tensor/sequence parallelism come from the backend, as for GPT: heads (and this rank's
columns of each relative-bias table) are split over TP ranks, the cross-attention's
``q`` and ``kv`` are column-parallel (``kv`` split per chunk, ``k`` and ``v`` alone),
``proj`` row-parallel; under SP both stacks run on sequence shards, so the encoder
and decoder lengths must both be multiples of the TP size. Context parallelism: each rank
feeds its chunks of both sequences with a :class:`ContextShard` (their global positions),
and the masks are its query rows against every key the context-parallel attention gathers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from megalith.config import ConfigError, ModelConfig
from training.models.backend import LayerBackend, resolve_backend
from training.models.gpt import (
    MLP,
    Attention,
    Embeddings,
    KVCache,
    Rope,
    TransformerBlock,
    _norm_spec,
    _selective_context,
    reset_submodules,
)
from training.models.layers import RotaryEmbedding, residual_stream, scaled_init_std


def relative_position_bucket(
    relative_position: Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> Tensor:
    """T5's bucket of each ``key - query`` offset (Mesh TensorFlow's, HF's): half the
    buckets are exact small distances, the rest log-spaced up to ``max_distance``;
    bidirectional buckets spend half of them on keys after the query."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """One stack's bias table ``weight [buckets, heads]`` (this rank's heads under TP).

    ``forward`` returns the bias ``[1, heads, T, S]`` for queries at positions
    ``query_start .. query_start+T-1`` and keys ``0 .. S-1``.
    """

    def __init__(self, config: ModelConfig, num_heads: int, *, bidirectional: bool, split: bool):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance
        self.init_std = config.init_std
        self.split = split  # the columns are this rank's heads: split along dim 1
        self.weight = nn.Parameter(torch.empty(self.num_buckets, num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def tensor_parallel_parameters(self) -> list[tuple[nn.Parameter, int, int]]:
        """``(parameter, split dim, chunks)`` for tensor_parallel_partition: heads are columns."""
        return [(self.weight, 1, 1)] if self.split else []

    def forward(
        self, queries: int, keys: int, query_start: int = 0, query_positions: Tensor | None = None
    ) -> Tensor:
        """``query_positions [T]``: the queries' positions when they are not consecutive
        (a context-parallel rank's two chunks)."""
        device = self.weight.device
        key_pos = torch.arange(keys, device=device)
        if query_positions is None:
            # Two gathers: the table for every key - query offset, then [T, S] from those.
            # The gradient then reaches the table through T + S - 1 slots, not T·S
            # atomic adds onto `num_buckets` slots (measured 1.9 ms a T5-base step).
            smallest = 1 - queries - query_start  # key 0 against the last query
            offsets = torch.arange(smallest, keys - query_start, device=device)
            per_offset = self.weight[self._buckets(offsets)]
            query_pos = torch.arange(query_start, query_start + queries, device=device)
            bias = per_offset[key_pos[None, :] - query_pos[:, None] - smallest]
        else:
            bias = self.weight[self._buckets(key_pos[None, :] - query_positions[:, None])]
        # Contiguous: attention kernels read the bias row by row (Inductor writes it so
        # in the gather itself).
        return bias.permute(2, 0, 1).unsqueeze(0).contiguous()

    def _buckets(self, offsets: Tensor) -> Tensor:
        return relative_position_bucket(
            offsets,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )


def additive_mask(
    bias: Tensor | None, allowed: Tensor | None, queries: int, keys: int, device: torch.device
) -> Tensor:
    """The float mask added to the attention scores: ``bias`` (or 0) where ``allowed``
    (bool, broadcastable to ``[B, heads, T, S]``), the most negative value elsewhere."""
    if bias is None:
        bias = torch.zeros(1, 1, queries, keys, device=device)
    if allowed is None:
        return bias
    return bias.masked_fill(~allowed, torch.finfo(bias.dtype).min)


def causal_allowed(queries: int, keys: int, device: torch.device) -> Tensor:
    """``[1, 1, T, S]`` True where query ``i`` (the last ``T`` of ``S``) may see the key."""
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
    return allowed[None, None]


class CrossAttention(nn.Module):
    """Decoder queries attend to every (non-padding) encoder position; no positions."""

    def __init__(self, config: ModelConfig, backend: LayerBackend):
        super().__init__()
        tp = backend.tensor_parallel_size
        self.num_heads = config.num_attention_heads // tp
        self.head_dim = config.head_dim
        width = config.num_attention_heads * config.head_dim
        self.q = backend.norm_linear(
            config.hidden_size, width, norm=_norm_spec(config), bias=False, init_std=config.init_std
        )
        self.kv = backend.column_linear(
            config.hidden_size, 2 * width, bias=False, init_std=config.init_std, output_chunks=2
        )
        self.core = backend.core_attention(
            self.num_heads,
            self.num_heads,
            self.head_dim,
            dropout=config.dropout,
            attention_backend=config.attention_backend,
        )
        self.proj = backend.row_linear(
            width,
            config.hidden_size,
            bias=False,
            init_std=scaled_init_std(config.init_std, config.num_layers),
        )
        self.dropout = backend.dropout(config.dropout)

    def forward(self, x: Tensor, encoded: Tensor, attn_mask: Tensor) -> Tensor:
        q = self.q(x)
        batch, length = q.shape[:2]
        k, v = self.kv(encoded).chunk(2, dim=-1)  # each rank's [k; v] parts, per chunk
        keys = k.size(1)
        q = q.view(batch, length, self.num_heads, self.head_dim)
        k = k.reshape(batch, keys, self.num_heads, self.head_dim)
        v = v.reshape(batch, keys, self.num_heads, self.head_dim)
        return self.dropout(self.proj(self.core(q, k, v, attn_mask)))


class DecoderBlock(nn.Module):
    """``x + self_attention(x)``, ``x + cross_attention(x, encoded)``, ``x + mlp(x)``."""

    def __init__(self, config: ModelConfig, backend: LayerBackend, layer_index: int):
        super().__init__()
        self.attention = Attention(config, backend, layer_index)
        self.cross_attention = CrossAttention(config, backend)
        self.mlp = MLP(config, backend)

    def forward(
        self,
        x: Tensor,
        encoded: Tensor,
        rope: Rope | None,
        self_mask: Tensor | None,
        cross_mask: Tensor,
        kv_cache: KVCache | None = None,
        start_pos: int = 0,
    ) -> Tensor:
        x = x + self.attention(x, rope, kv_cache, start_pos, self_mask)
        x = x + self.cross_attention(x, encoded, cross_mask)
        return x + self.mlp(x)


class Stack(nn.Module):
    """One side's layers, its relative-bias table (if any) and its final norm."""

    def __init__(
        self, blocks: list[nn.Module], config: ModelConfig, backend: LayerBackend, encoder: bool
    ):
        super().__init__()
        self.relative_bias = None
        if config.position_embedding == "relative":
            heads = config.num_attention_heads // backend.tensor_parallel_size
            split = backend.tensor_parallel_size > 1
            self.relative_bias = RelativePositionBias(
                config, heads, bidirectional=encoder, split=split
            )
        self.layers = nn.ModuleList(blocks)
        self.final_norm = backend.norm(config.hidden_size, _norm_spec(config))
        self.dropout = backend.dropout(config.dropout)

    def position_bias(
        self, queries: int, keys: int, query_start: int = 0, query_positions: Tensor | None = None
    ) -> Tensor | None:
        if self.relative_bias is None:
            return None
        return self.relative_bias(queries, keys, query_start, query_positions)


@dataclass(frozen=True)
class ContextShard:
    """A context-parallel rank's part of a T5 micro-batch
    (:mod:`training.parallel.context_parallel`'s load-balanced chunks of each sequence):
    the global positions of its encoder and decoder tokens, and the whole lengths its
    attentions' keys span once gathered. Masks and relative biases are built for those
    rows against every key, so they are exact."""

    encoder_positions: Tensor  # [S / CP]
    decoder_positions: Tensor  # [T / CP]
    encoder_length: int  # S
    decoder_length: int  # T


class T5Model(nn.Module):
    """The encoder-decoder; ``forward`` returns logits, or the loss when given labels."""

    def __init__(self, config: ModelConfig, backend: LayerBackend | None = None):
        super().__init__()
        if config.family != "t5":
            raise ConfigError(f"T5Model needs model.family t5, got {config.family!r}")
        if config.vocab_size is None:
            raise ConfigError("model.vocab_size must be set (or filled from the data)")
        if config.position_embedding == "rope" and config.max_position_embeddings is None:
            raise ConfigError("model.max_position_embeddings must be set for rope positions")
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
        encoder_blocks = [
            TransformerBlock(config, self.backend, i) for i in range(config.num_layers)
        ]
        decoder_blocks = [
            DecoderBlock(config, self.backend, i) for i in range(config.decoder_layers)
        ]
        self.encoder = Stack(encoder_blocks, config, self.backend, encoder=True)
        self.decoder = Stack(decoder_blocks, config, self.backend, encoder=False)
        self.output = self.backend.output_head(
            config.hidden_size,
            config.vocab_size,
            init_std=config.init_std,
            tied_weight=None,
            loss_chunk_tokens=config.loss_chunk_tokens,
        )

    @staticmethod
    def layer_stacks(config: ModelConfig) -> dict[str, tuple[str, int]]:
        """``{state-dict prefix: (config key, block count)}`` (``GPTModel.layer_stacks``)."""
        return {
            "encoder.layers": ("num_layers", config.num_layers),
            "decoder.layers": ("num_decoder_layers", config.decoder_layers),
        }

    def transformer_blocks(self) -> list[nn.Module]:
        """The encoder's blocks, then the decoder's (one FSDP unit each)."""
        return [*self.encoder.layers, *self.decoder.layers]

    @property
    def tied_weights(self) -> dict[str, str]:
        """No aliases: T5 v1.1's head is untied (``GPTModel``'s API, for savers)."""
        return {}

    def tie_weights(self) -> None:
        """Nothing to re-tie (kept for callers written against ``GPTModel``)."""

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
        """An empty cache of the decoder's self-attention keys and values, for
        ``decode(..., kv_cache=cache, start_pos=...)``."""
        limit = self.config.max_position_embeddings if self.rope is not None else None
        if limit is not None and max_length > limit:
            raise ValueError(f"max_length {max_length} exceeds max_position_embeddings {limit}")
        param = self.embedding.word.weight
        attention = self.decoder.layers[0].attention
        return KVCache(
            self.config.decoder_layers,
            batch_size,
            max_length,
            attention.num_groups,
            attention.head_dim,
            device=device or param.device,
            dtype=dtype or param.dtype,
        )

    def forward(
        self,
        encoder_tokens: Tensor,
        decoder_tokens: Tensor,
        labels: Tensor | None = None,
        *,
        encoder_mask: Tensor | None = None,
        loss_reduction: Literal["mean", "none"] = "mean",
        shard: ContextShard | None = None,
    ) -> Tensor:
        """``encoder_tokens [B, S]``, ``decoder_tokens [B, T]`` (the targets shifted right,
        starting with the pad id) -> fp32 logits ``[B, T, V]``, or with ``labels [B, T]``
        the cross-entropy (mean over labels != -100, or ``[B, T]`` with
        ``loss_reduction="none"``). ``encoder_mask [B, S]`` bool: False marks padding,
        which no attention reads. ``shard``: this context-parallel rank's part of each
        sequence (the tokens and labels are that part; ``encoder_mask`` stays whole)."""
        if labels is not None and labels.shape != decoder_tokens.shape:
            raise ValueError(
                f"labels must be shaped like decoder_tokens {list(decoder_tokens.shape)}, "
                f"got {list(labels.shape)}"
            )
        encoded = self.encode(encoder_tokens, encoder_mask, shard)
        hidden = self.decode_hidden(decoder_tokens, encoded, encoder_mask, shard=shard)
        if labels is None:
            return self.output(hidden).float()
        return self.output.loss(hidden, labels, reduction=loss_reduction)

    def encode(
        self, tokens: Tensor, mask: Tensor | None = None, shard: ContextShard | None = None
    ) -> Tensor:
        """The encoder's normed output ``[B, S, H]`` (this rank's sequence shard under SP,
        its context-parallel part with ``shard``)."""
        self._check_tokens("encoder_tokens", tokens)
        length = tokens.size(1)
        whole = (tokens.size(0), length if shard is None else shard.encoder_length)
        if mask is not None and (tuple(mask.shape) != whole or mask.dtype != torch.bool):
            raise ValueError(
                f"encoder_mask must be bool {list(whole)} (the whole encoder sequence), "
                f"got {mask.dtype} {list(mask.shape)}"
            )
        attn_mask = self.encoder_attention_mask(length, mask, tokens.device, shard)
        x = self.embedding(tokens, 0)
        positions = None if shard is None else shard.encoder_positions
        rope = self.rope(0, length, x.device, positions) if self.rope is not None else None
        for block in self.encoder.layers:
            x = self._run_block(block, x, rope, attn_mask=attn_mask)
        return self.encoder.dropout(self.encoder.final_norm(x))

    def encoder_attention_mask(
        self,
        length: int,
        mask: Tensor | None,
        device: torch.device,
        shard: ContextShard | None = None,
    ) -> Tensor:
        """The encoder self-attention's float mask ``[B or 1, heads, S, S]``: relative
        bias, padding keys (``mask`` False) at the most negative value. Pipeline stages
        build it from the full lengths (:mod:`training.parallel.pipeline_t5`). With
        ``shard``, this rank's rows against every key."""
        keys = length if shard is None else shard.encoder_length
        positions = None if shard is None else shard.encoder_positions
        allowed = None if mask is None else mask[:, None, None, :]
        bias = self.encoder.position_bias(length, keys, 0, positions)
        return additive_mask(bias, allowed, length, keys, device)

    def decoder_attention_masks(
        self,
        length: int,
        encoder_mask: Tensor | None,
        device: torch.device,
        start_pos: int = 0,
        shard: ContextShard | None = None,
    ) -> tuple[Tensor | None, Tensor]:
        """``(self_mask, cross_mask)`` of the decoder's ``length`` queries at positions
        ``start_pos ..``: causal (with the relative bias; None: SDPA's own causal mask),
        and the cross-attention's padding mask over the encoder positions. With
        ``shard``, this rank's rows against every key (causal by global position)."""
        if shard is not None:  # this rank's rows, causal by global position
            keys, positions = shard.decoder_length, shard.decoder_positions
            bias = self.decoder.position_bias(length, keys, 0, positions)
            allowed = torch.arange(keys, device=device)[None, :] <= positions[:, None]
            self_mask = additive_mask(bias, allowed[None, None], length, keys, device)
        else:
            keys = start_pos + length
            self_mask = None  # SDPA's own causal mask (rope, nothing cached before)
            bias = self.decoder.position_bias(length, keys, start_pos)
            if bias is not None or start_pos:
                allowed = causal_allowed(length, keys, device)
                self_mask = additive_mask(bias, allowed, length, keys, device)
        source = encoder_mask.size(1) if encoder_mask is not None else None
        cross_allowed = None if encoder_mask is None else encoder_mask[:, None, None, :]
        cross_mask = additive_mask(None, cross_allowed, length, source or 1, device)
        return self_mask, cross_mask

    def decode_hidden(
        self,
        tokens: Tensor,
        encoded: Tensor,
        encoder_mask: Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        start_pos: int = 0,
        shard: ContextShard | None = None,
    ) -> Tensor:
        """The decoder's normed output for ``tokens`` at positions ``start_pos ..``; with
        ``kv_cache`` they attend to the cached positions before them; with ``shard``
        they are this context-parallel rank's part of the sequence."""
        self._check_tokens("decoder_tokens", tokens, start_pos)
        length = tokens.size(1)
        if start_pos and kv_cache is None:
            raise ValueError("start_pos > 0 needs a kv_cache holding the earlier positions")
        self_mask, cross_mask = self.decoder_attention_masks(
            length, encoder_mask, tokens.device, start_pos, shard
        )
        x = self.embedding(tokens, start_pos)
        positions = None if shard is None else shard.decoder_positions
        rope = None
        if self.rope is not None:
            rope = self.rope(start_pos, length, x.device, positions)
        for block in self.decoder.layers:
            x = self._run_block(
                block,
                x,
                encoded,
                rope,
                self_mask,
                cross_mask,
                kv_cache=kv_cache,
                start_pos=start_pos,
            )
        return self.decoder.dropout(self.decoder.final_norm(x))

    def decode(
        self,
        tokens: Tensor,
        encoded: Tensor,
        encoder_mask: Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        start_pos: int = 0,
    ) -> Tensor:
        """fp32 logits ``[B, T, V]`` of :meth:`decode_hidden` (generation, one step at a time)."""
        hidden = self.decode_hidden(
            tokens, encoded, encoder_mask, kv_cache=kv_cache, start_pos=start_pos
        )
        return self.output(hidden).float()

    def _run_block(self, block: nn.Module, x: Tensor, *args, **kwargs) -> Tensor:
        args = (residual_stream(x, self.config.fp32_residual), *args)
        mode = self.activation_checkpointing
        if mode == "none" or kwargs.get("kv_cache") is not None or not torch.is_grad_enabled():
            return block(*args, **kwargs)
        if mode == "full":
            return checkpoint(block, *args, use_reentrant=False, **kwargs)
        return checkpoint(
            block, *args, use_reentrant=False, context_fn=_selective_context, **kwargs
        )

    def _check_tokens(self, name: str, tokens: Tensor, start_pos: int = 0) -> None:
        if tokens.dim() != 2:
            raise ValueError(f"{name} must be [batch, length], got shape {tuple(tokens.shape)}")
        limit = self.config.max_position_embeddings
        end = start_pos + tokens.size(1)
        if self.rope is not None and end > limit:
            raise ValueError(
                f"{name} positions up to {end - 1} exceed model.max_position_embeddings {limit}"
            )


__all__ = ["ContextShard", "RelativePositionBias", "T5Model", "relative_position_bucket"]
