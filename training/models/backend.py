"""The layer backend: the one place the model asks for its building blocks.

The model (``gpt.py``) never constructs a linear layer, norm, embedding, attention
kernel or loss itself; it asks a :class:`LayerBackend`. The plain PyTorch backend
lives here; a tensor-parallel backend (column/row-parallel linears, vocab-parallel
embedding and cross-entropy) and a Transformer Engine backend (``te.Linear``,
``te.LayerNormLinear``, ``te.DotProductAttention``) implement the same methods, so
neither needs to touch the model.

Conventions every backend keeps:

- Linear weights are ``[out_features, in_features]`` as in ``nn.Linear``.
  ``column_linear`` and ``norm_linear`` split the *output* dimension across
  tensor-parallel ranks, ``row_linear`` the *input* dimension.
- ``output_chunks=k`` says the output dimension is ``k`` equal parts that must be
  split across ranks separately (SwiGLU's fc1 is ``[gate; up]``, ``k=2``), the way
  Megatron's ``partition_stride`` does; the fused QKV layout needs no such help
  (see :meth:`LayerBackend.qkv`).
- Sizes passed in are *global*; modules hold their rank's part, and the model
  divides head and group counts by :attr:`LayerBackend.tensor_parallel_size`.
"""

from __future__ import annotations

import functools
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

from torch import Tensor, nn

from megalith.config import MixedPrecisionConfig, ModelConfig
from megalith.errors import MegalithError
from training.models import layers
from training.models.layers import NormSpec
from training.models.moe import MoELayer


class BackendError(MegalithError):
    """A layer backend that was asked for but cannot be used here."""


class FusedMLP(Protocol):
    """What :meth:`LayerBackend.fused_mlp` returns: ``fused(mlp, x)`` computes
    ``fc2(activation(fc1(x)))`` with ``mlp``'s parameters, where ``runs_for(x)``."""

    def runs_for(self, x: Tensor) -> bool: ...

    def __call__(self, mlp: nn.Module, x: Tensor) -> Tensor: ...


class LayerBackend(ABC):
    """Factory for the model's layers. Every method returns an ``nn.Module``."""

    name: str = "abstract"

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks that split heads, KV groups, FFN width and vocabulary; 1 without TP."""
        return 1

    @abstractmethod
    def norm(self, size: int, spec: NormSpec) -> nn.Module:
        """A normalization over the last dimension (``x -> norm(x)``)."""

    @abstractmethod
    def column_linear(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        init_std: float,
        output_chunks: int = 1,
    ) -> nn.Module:
        """``x -> x W^T + b`` with the output dimension split across TP ranks."""

    @abstractmethod
    def row_linear(
        self, in_features: int, out_features: int, *, bias: bool, init_std: float
    ) -> nn.Module:
        """``x -> x W^T + b`` with the input dimension split across TP ranks (output reduced)."""

    @abstractmethod
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
        """``x -> linear(norm(x))``, column-parallel: one module so ``te.LayerNormLinear`` fits."""

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
        """The fused query/key/value projection (with the attention's input norm).

        Output layout, Megatron's: for each KV group ``g`` in order, the ``num_heads /
        num_groups`` query heads of that group, then ``k_g``, then ``v_g``, each
        ``head_dim`` wide::

            [q_(g,0) .. q_(g,r-1), k_g, v_g]  for g = 0 .. num_groups-1

        Query head ``h = g * r + i`` attends with KV group ``g = h // r`` (as
        ``repeat_interleave`` and Hugging Face's ``repeat_kv`` pair them). A contiguous
        split of the output dimension into TP parts therefore gives each rank whole
        groups; exporting to separate q/k/v projections must un-interleave it.
        """
        tp = self.tensor_parallel_size
        if num_heads % num_groups or num_groups % tp:
            raise BackendError(
                f"{num_heads} heads in {num_groups} KV groups cannot be split over "
                f"{tp} tensor-parallel ranks"
            )
        out_features = (num_heads + 2 * num_groups) * head_dim
        return self.norm_linear(hidden_size, out_features, norm=norm, bias=bias, init_std=init_std)

    def fused_mlp(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str,
        norm: NormSpec,
        bias: bool,
    ) -> FusedMLP | None:
        """One kernel-level module for a whole dense MLP (norm, fc1, activation, fc2) that
        reads the MLP's own parameters, or None: the MLP then runs its layers one by one.
        ``activation`` is the MLP's function name (``swiglu``, ``geglu``, ``gelu`` for the
        tanh GELU, ``gelu_erf``)."""
        return None

    def moe_mlp(self, config: ModelConfig, norm: NormSpec) -> nn.Module:
        """A mixture-of-experts MLP with its input norm (:mod:`training.models.moe`);
        experts are split over expert-parallel ranks after building, not here."""
        return MoELayer(config, self.norm(config.hidden_size, norm))

    @abstractmethod
    def vocab_embedding(self, vocab_size: int, hidden_size: int, *, init_std: float) -> nn.Module:
        """Token embedding (``tokens -> [.., hidden]``); its ``weight`` is ``[vocab, hidden]``."""

    def dropout(self, p: float) -> nn.Module:
        """Dropout on activations ``[B, T, H]`` of the residual stream (or its sequence shard)."""
        return nn.Dropout(p)

    def sequence_scatter(self) -> nn.Module:
        """Applied to the embeddings' output ``[B, T, H]`` before the first block: the
        identity, or under sequence parallelism a split to this rank's sequence shard."""
        return nn.Identity()

    @abstractmethod
    def core_attention(
        self,
        num_heads: int,
        num_groups: int,
        head_dim: int,
        *,
        dropout: float,
        attention_backend: str = "auto",
    ) -> nn.Module:
        """Causal attention over this rank's heads.

        ``forward(q [B,T,heads,D], k [B,S,groups,D], v [B,S,groups,D])`` returns
        ``[B, T, heads*D]``. With a KV cache ``S > T``: the queries are the last ``T``
        positions, and query ``i`` sees keys ``0 .. S-T+i``.

        ``attention_backend`` is ``model.attention_backend``: ``auto`` lets a backend run its
        own attention kernels; another value asks for SDPA with that kernel first.
        """

    @abstractmethod
    def output_head(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        init_std: float,
        tied_weight: nn.Parameter | None,
        loss_chunk_tokens: int = 0,
    ) -> nn.Module:
        """The language-model head and its loss.

        ``forward(hidden) -> logits [.., vocab]`` and ``loss(hidden, labels, reduction)``
        (cross-entropy, labels ``-100`` ignored, ``"mean"`` or ``"none"`` per token). The
        loss takes hidden states, not logits, so a vocab-parallel or chunked
        cross-entropy never needs full logits. With ``tied_weight`` the head uses the
        embedding's parameter instead of its own. ``loss_chunk_tokens`` > 0: the mean loss
        fuses the output layer with the cross-entropy, that many tokens at a time
        (:mod:`training.models.fused_cross_entropy`), where the backend supports it.
        """


class TorchBackend(LayerBackend):
    """Plain PyTorch on one device: ``nn.Linear``, ``nn.RMSNorm``/``LayerNorm``, SDPA."""

    name = "torch"

    def norm(self, size: int, spec: NormSpec) -> nn.Module:
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
        return layers.Linear(in_features, out_features, bias=bias, init_std=init_std)

    def row_linear(
        self, in_features: int, out_features: int, *, bias: bool, init_std: float
    ) -> nn.Module:
        return layers.Linear(in_features, out_features, bias=bias, init_std=init_std)

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
        linear = layers.Linear(in_features, out_features, bias=bias, init_std=init_std)
        return layers.NormLinear(layers.make_norm(in_features, norm), linear)

    def vocab_embedding(self, vocab_size: int, hidden_size: int, *, init_std: float) -> nn.Module:
        return layers.Embedding(vocab_size, hidden_size, init_std=init_std)

    def core_attention(
        self,
        num_heads: int,
        num_groups: int,
        head_dim: int,
        *,
        dropout: float,
        attention_backend: str = "auto",
    ) -> nn.Module:
        return layers.SDPAttention(num_heads, num_groups, head_dim, dropout=dropout)

    def output_head(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        init_std: float,
        tied_weight: nn.Parameter | None,
        loss_chunk_tokens: int = 0,
    ) -> nn.Module:
        return layers.OutputHead(
            hidden_size,
            vocab_size,
            init_std=init_std,
            tied_weight=tied_weight,
            loss_chunk_tokens=loss_chunk_tokens,
        )


# Backends beside "torch" register a factory here (the Transformer Engine one as "te", from
# training.models; it is used only where transformer_engine imports, see resolve_backend).
BACKENDS: dict[str, Callable[[], LayerBackend]] = {"torch": TorchBackend}


@functools.cache
def transformer_engine_available() -> bool:
    """True when ``transformer_engine.pytorch`` imports (it can be installed yet unusable)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or OSError/RuntimeError from missing CUDA libraries
        return False
    return True


# model.backend auto runs Transformer Engine only where it measured faster than the torch
# backend compiled (benchmarks/RESULTS.md, "Which kernel backend auto picks"): fp8 at the 1B
# shape (hidden 2048: TE's delayed scaling 1.43x HF compiled, torchao 1.34x). In bf16 the
# torch backend was as fast or faster (1B: 1.17x against TE's 1.14x), and below that width
# TE's per-module host work dominates (bf16, compiled: TE ran 0.38x the torch backend's
# speed at T5-base, hidden 768, and 0.66x at GPT-2 350M, hidden 1024).
TE_AUTO_MIN_HIDDEN = 2048


@functools.cache
def torchao_available() -> bool:
    """True when torchao (the torch backend's fp8 route) is installed."""
    return importlib.util.find_spec("torchao") is not None


def kernel_backend_name(model: ModelConfig, mixed_precision: MixedPrecisionConfig) -> str:
    """The kernel backend a run builds (``torch`` or ``te``): ``model.backend`` as given,
    or for ``auto`` Transformer Engine where it is importable and pays: fp8 with delayed
    scaling (TE's alone), or tensorwise fp8 at hidden >= ``TE_AUTO_MIN_HIDDEN`` (below
    that too when torchao is missing: TE is then the only fp8 route)."""
    if model.backend != "auto":
        return model.backend
    recipe = mixed_precision.fp8_recipe if mixed_precision.fp8 else None
    # TE's fp8 refuses activation checkpointing (precision/fp8.py); torchao's takes it.
    wide = model.hidden_size >= TE_AUTO_MIN_HIDDEN and model.activation_checkpointing == "none"
    pays = recipe == "delayed" or (recipe == "tensorwise" and (wide or not torchao_available()))
    usable = pays and "te" in BACKENDS and transformer_engine_available()
    return "te" if usable else "torch"


def slow_backend_warning(model: ModelConfig, mixed_precision: MixedPrecisionConfig) -> str | None:
    """What to tell a run that asked for ``te`` where it measured slower than torch
    (narrower than ``TE_AUTO_MIN_HIDDEN`` in bf16), or None."""
    if model.backend != "te" or mixed_precision.fp8 or model.hidden_size >= TE_AUTO_MIN_HIDDEN:
        return None
    return (
        f"model.backend=te at model.hidden_size {model.hidden_size} in bf16: TE measured slower "
        "than the torch backend at such widths (T5-base 0.38x, GPT-2 350M 0.66x, compiled; "
        "benchmarks/RESULTS.md); model.backend=auto or torch runs the torch kernels"
    )


def backend_name(model: nn.Module) -> str:
    """The kernel backend a model was built with, seen through wrappers
    (``te+context_parallel`` -> ``te``)."""
    backend = getattr(model, "backend", None)
    backend = getattr(backend, "inner", backend)
    return getattr(backend, "name", "torch")


def resolve_backend(name: str) -> LayerBackend:
    """``"torch"``, ``"te"``, or ``"auto"`` (torch here: a run picks TE for ``auto`` through
    :func:`kernel_backend_name`, which sees its precision)."""
    if name == "auto":
        return BACKENDS["torch"]()
    if name == "te":
        if not transformer_engine_available():
            raise BackendError(
                "model.backend is 'te' but transformer_engine is not importable here; install "
                "megalith[gpu] on a CUDA machine, or set model.backend to 'torch' or 'auto'"
            )
        if "te" not in BACKENDS:
            raise BackendError(
                "model.backend is 'te' but the Transformer Engine backend is not available "
                "in this version; set model.backend to 'torch' or 'auto'"
            )
    if name not in BACKENDS:
        raise BackendError(
            f"unknown model.backend {name!r}; expected one of auto, {', '.join(BACKENDS)}"
        )
    return BACKENDS[name]()
