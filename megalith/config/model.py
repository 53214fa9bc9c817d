"""The model section: its families' and styles' defaults and rules, RoPE scaling."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import (
    Field,
    model_validator,
)

from megalith.config.base import (
    MAX_EXPERTS,
    MAX_FFN,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_PARAMETERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    StrictModel,
)

STYLE_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "normalization": "rmsnorm",
        "activation": "swiglu",
        "position_embedding": "rope",
        "bias": False,
        "tie_embeddings": False,
    },
    "gpt2": {
        "normalization": "layernorm",
        "activation": "gelu",
        "position_embedding": "learned",
        "bias": True,
        "tie_embeddings": True,
    },
}

# model.family t5 fills unset choices from these instead of ``style`` (T5 v1.1).
T5_DEFAULTS: dict[str, Any] = {
    "normalization": "rmsnorm",
    "activation": "geglu",
    "position_embedding": "relative",
    "bias": False,
    "tie_embeddings": False,
}


@dataclass(frozen=True)
class FamilyRules:
    """What a ``model.family`` fills and refuses in the config, as data (the family's code
    is its spec in training/families, which this module may not import)."""

    defaults: dict[str, Any] | None  # unset choices; None: STYLE_DEFAULTS[model.style]
    # (key, refuses(value), message), checked in order once the defaults are filled
    refused: tuple[tuple[str, Callable[[Any], bool], str], ...]
    decoder_stack: bool  # num_decoder_layers more blocks after the num_layers (encoder) ones


FAMILY_RULES: dict[str, FamilyRules] = {
    "gpt": FamilyRules(
        defaults=None,
        refused=(
            (
                "position_embedding",
                lambda v: v == "relative",
                "model.position_embedding 'relative' needs model.family t5",
            ),
            (
                "activation",
                lambda v: v == "geglu",
                "model.activation 'geglu' needs model.family t5",
            ),
            (
                "num_decoder_layers",
                lambda v: v is not None,
                "model.num_decoder_layers needs model.family t5",
            ),
        ),
        decoder_stack=False,
    ),
    "t5": FamilyRules(
        defaults=T5_DEFAULTS,
        refused=(
            (
                "position_embedding",
                lambda v: v == "learned",
                "model.position_embedding 'learned' with model.family t5: T5 uses relative or "
                "rope positions",
            ),
            (
                "normalization",
                lambda v: v == "layernorm",
                "model.normalization 'layernorm' with model.family t5: T5 uses rmsnorm",
            ),
            ("bias", lambda v: v is True, "model.bias True with model.family t5: T5 has no biases"),
            (
                "tie_embeddings",
                lambda v: v is True,
                "model.tie_embeddings True with model.family t5: T5 v1.1 has an untied output head",
            ),
            (
                "num_experts",
                bool,
                "model.num_experts with model.family t5: T5 MLPs are dense",
            ),
            (
                "activation",
                lambda v: v == "swiglu",
                "model.activation 'swiglu' with model.family t5: use geglu or gelu",
            ),
        ),
        decoder_stack=True,
    ),
}


class RopeScaling(StrictModel):
    """Llama 3's RoPE frequency scaling (Hugging Face ``rope_type: llama3``, Megatron-LM's
    ``--use-rope-scaling``): wavelengths longer than ``original_max_position_embeddings /
    low_freq_factor`` are stretched by ``factor``, those shorter than ``... /
    high_freq_factor`` kept, the ones between interpolated."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(default=8.0, gt=0)
    low_freq_factor: float = Field(default=1.0, gt=0)
    high_freq_factor: float = Field(default=4.0, gt=0)
    original_max_position_embeddings: int = Field(default=8192, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling.high_freq_factor must exceed low_freq_factor")
        return self


class ModelConfig(StrictModel):
    """A transformer. ``style`` fills every architectural choice left unset; with
    ``family: t5`` (an encoder-decoder, training/models/t5.py) T5 v1.1's choices do."""

    family: Literal["gpt", "t5"] = Field(
        default="gpt",
        description="gpt: decoder-only (training/models/gpt.py); t5: encoder-decoder "
        "(training/models/t5.py, num_layers encoder layers), T5 v1.1 defaults.",
    )
    style: Literal["llama", "gpt2"] = "llama"
    num_layers: int = Field(default=2, ge=1, le=MAX_LAYERS)
    num_decoder_layers: int | None = Field(
        default=None,
        ge=1,
        le=MAX_LAYERS,
        description="family t5: decoder layers; None: num_layers.",
    )
    hidden_size: int = Field(default=128, ge=8, le=MAX_HIDDEN)
    num_attention_heads: int = Field(default=4, ge=1, le=MAX_HEADS)
    num_query_groups: int | None = Field(
        default=None,
        ge=1,
        le=MAX_HEADS,
        description="Grouped-query attention KV groups; None means one per head.",
    )
    ffn_hidden_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_FFN,
        description="None: 4h for GELU, 8h/3 rounded up to 64 for SwiGLU.",
    )
    vocab_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_VOCAB,
        description="None: the padded vocabulary of the training data.",
    )
    max_position_embeddings: int | None = Field(
        default=None, ge=1, le=MAX_POSITIONS, description="None: data.seq_length."
    )
    normalization: Literal["rmsnorm", "layernorm"] | None = None
    activation: Literal["swiglu", "gelu", "geglu"] | None = Field(
        default=None, description="geglu: gated GELU (tanh), T5 v1.1's; family t5 only."
    )
    gelu_approximation: Literal["tanh", "none"] = Field(
        default="tanh",
        description="activation gelu: tanh (GPT-2's; Megatron-Core's fused bias-GELU) or none "
        "(exact erf GELU: Megatron-Core without bias-GELU fusion or bias, HF 'gelu').",
    )
    position_embedding: Literal["rope", "learned", "relative"] | None = Field(
        default=None, description="relative: T5's bucketed attention biases; family t5 only."
    )
    relative_attention_num_buckets: int = Field(
        default=32, ge=2, le=4096, description="position_embedding relative: buckets per stack."
    )
    relative_attention_max_distance: int = Field(
        default=128,
        ge=2,
        le=MAX_POSITIONS,
        description="position_embedding relative: the farthest bucket.",
    )
    bias: bool | None = None
    tie_embeddings: bool | None = None
    rope_base: float = Field(default=10000.0, gt=0)
    rope_scaling: RopeScaling | None = Field(
        default=None, description="Llama 3 RoPE frequency scaling; None: plain RoPE."
    )
    nope_layers: list[int] = Field(
        default_factory=list,
        description="position_embedding rope: the layers (0-based) whose attention applies no "
        "RoPE (NoPE; Megatron-LM's --no-rope-freq).",
    )
    norm_eps: float = Field(default=1e-5, gt=0)
    init_std: float = Field(default=0.02, gt=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    backend: Literal["auto", "torch", "te"] = Field(
        default="auto",
        description="Layer kernels: plain torch, Transformer Engine (te), or auto: te where it "
        "imports and measured faster (fp8 with delayed scaling, or tensorwise fp8 at hidden "
        ">= 2048) or is the only fp8 route (no torchao), torch otherwise.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    attention_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = Field(
        default="auto",
        description="The SDPA kernel tried first: auto keeps torch's order (flash, "
        "memory-efficient, math, cuDNN); cudnn puts cuDNN attention first (Hopper). Kernels "
        "that cannot run an input fall through to the next. With model.backend te, auto runs "
        "Transformer Engine's own attention and any other value runs SDPA (inside compiled "
        "graphs, where TE's attention is a graph break).",
    )
    loss_chunk_tokens: int = Field(
        default=0,
        ge=0,
        le=MAX_POSITIONS,
        description="Fuse the output layer with the cross-entropy, this many tokens at a "
        "time, so the whole [tokens, vocabulary] fp32 logits never exist (plain head, "
        "tensor parallelism 1); 0: off.",
    )
    fp32_residual: bool = Field(
        default=False,
        description="Under bf16/fp16 autocast, keep the residual stream (the embedding's "
        "output and every block's sum) in fp32, as HF's models under autocast do; false "
        "(default): in the autocast dtype, as Megatron-LM without "
        "--fp32-residual-connection (every norm and residual add moves about half the "
        "bytes: 1B +2%, T5-base +4% tokens/s on an H200, benchmarks/RESULTS.md).",
    )
    # Mixture of experts (training/models/moe.py); None or 0 experts: every MLP is dense.
    num_experts: int | None = Field(
        default=None,
        ge=0,
        le=MAX_EXPERTS,
        description="Experts per MoE layer; None or 0: dense MLPs.",
    )
    moe_top_k: int = Field(
        default=2, ge=1, le=MAX_EXPERTS, description="Experts each token is routed to."
    )
    moe_ffn_hidden_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_FFN,
        description="Each expert's FFN width; None: ffn_hidden_size.",
    )
    moe_aux_loss_coeff: float = Field(
        default=0.01,
        ge=0.0,
        description="Weight of the Switch/GShard load-balancing loss added to the training loss.",
    )
    moe_capacity_factor: float | None = Field(
        default=None,
        gt=0.0,
        description="Tokens an expert takes, as a multiple of its fair share (top_k·tokens/"
        "experts); the lowest-weight assignments beyond it are dropped. None: dropless.",
    )
    moe_layer_frequency: int = Field(
        default=1,
        ge=1,
        le=MAX_LAYERS,
        description="Every k-th block (0, k, 2k, ...) is MoE; 1: every block.",
    )

    @model_validator(mode="after")
    def _fill_style(self) -> ModelConfig:
        rules = FAMILY_RULES[self.family]
        for key, value in (rules.defaults or STYLE_DEFAULTS[self.style]).items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, value)
        for key, refuses, message in rules.refused:  # the choices the family's model lacks
            if refuses(getattr(self, key)):
                raise ValueError(message)
        groups = self.num_query_groups or self.num_attention_heads
        object.__setattr__(self, "num_query_groups", groups)
        if self.ffn_hidden_size is None:
            if self.activation in ("swiglu", "geglu"):
                ffn = -(-(8 * self.hidden_size // 3) // 64) * 64
            else:
                ffn = 4 * self.hidden_size
            object.__setattr__(self, "ffn_hidden_size", ffn)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                f"{self.num_attention_heads}"
            )
        if self.num_attention_heads % groups:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_query_groups {groups}"
            )
        if self.gelu_approximation != "tanh" and self.activation != "gelu":
            raise ValueError("model.gelu_approximation applies to activation gelu only")
        if self.gelu_approximation != "tanh" and self.num_experts:
            raise ValueError("model.gelu_approximation none is not implemented for MoE experts")
        if self.rope_scaling is not None and self.position_embedding != "rope":
            raise ValueError("model.rope_scaling needs position_embedding rope")
        if self.nope_layers and self.position_embedding != "rope":
            raise ValueError("model.nope_layers needs position_embedding rope")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise ValueError(f"model.nope_layers {self.nope_layers}: outside 0..num_layers-1")
        if self.position_embedding == "rope" and self.head_dim % 2:
            raise ValueError(
                f"head_dim {self.head_dim} (hidden_size / num_attention_heads) must be even "
                "for rope positions"
            )
        if self.head_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"head_dim {self.head_dim} (hidden_size / num_attention_heads) exceeds "
                f"{MAX_HEAD_DIM}"
            )
        if self.num_experts:
            if self.moe_ffn_hidden_size is None:
                object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
            if self.moe_top_k > self.num_experts:
                raise ValueError(
                    f"moe_top_k {self.moe_top_k} exceeds num_experts {self.num_experts}"
                )
        if self.approximate_parameters() > MAX_PARAMETERS:
            raise ValueError(
                f"num_layers, hidden_size, ffn_hidden_size, num_experts and vocab_size "
                f"describe about {self.approximate_parameters():.2e} parameters, more than "
                f"the {MAX_PARAMETERS:.0e} limit"
            )
        return self

    def approximate_parameters(self) -> int:
        """A quick upper estimate of the weights (for the size limit; training.models.flops
        counts them exactly): every block's attention and MLP (all experts), T5's decoder
        cross-attention, untied embedding and head, learned positions."""
        hidden, width = self.hidden_size, self.num_attention_heads * self.head_dim
        attention = 2 * hidden * width + 2 * hidden * self.num_query_groups * self.head_dim
        mlp = (3 if self.activation in ("swiglu", "geglu") else 2) * hidden
        dense = mlp * self.ffn_hidden_size
        moe_layers = -(-self.num_layers // self.moe_layer_frequency) if self.num_experts else 0
        experts = moe_layers * (self.num_experts or 0) * mlp * (self.moe_ffn_hidden_size or 0)
        layers = self.stacked_layers
        cross = (layers - self.num_layers) * 2 * hidden * width  # the decoder's cross-attention
        positions = self.max_position_embeddings if self.position_embedding == "learned" else 0
        tables = (2 * (self.vocab_size or 0) + (positions or 0)) * hidden
        return layers * (attention + dense) + experts + cross + tables

    @property
    def decoder_layers(self) -> int:
        """family t5: the decoder's layer count (num_decoder_layers, else num_layers)."""
        return self.num_decoder_layers or self.num_layers

    @property
    def stacked_layers(self) -> int:
        """Every stack's blocks: GPT's layers, or T5's encoder then decoder layers (what a
        pipeline splits)."""
        decoder = self.decoder_layers if FAMILY_RULES[self.family].decoder_stack else 0
        return self.num_layers + decoder

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether block ``index`` has a mixture-of-experts MLP (Megatron's moe_layer_freq)."""
        return bool(self.num_experts) and index % self.moe_layer_frequency == 0
