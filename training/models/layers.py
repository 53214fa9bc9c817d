"""Plain PyTorch layers behind :class:`~training.models.backend.TorchBackend`, and RoPE.

Linears stay ``nn.Linear`` instances (a fused norm+linear is a module *holding* a
norm and an ``nn.Linear``) so tools that swap ``nn.Linear`` modules, such as
torchao's float8 training, keep working.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalith.config import RopeScaling
from training.models import shared_bias_attention
from training.models.fused_cross_entropy import linear_cross_entropy
from training.models.gated_grad import gated

IGNORE_INDEX = -100


@dataclass(frozen=True)
class NormSpec:
    """Which normalization to build: RMSNorm (weight only) or LayerNorm (weight, optional bias)."""

    kind: Literal["rmsnorm", "layernorm"]
    eps: float
    bias: bool = False


def make_norm(size: int, spec: NormSpec) -> nn.Module:
    """:class:`RMSNorm` or ``nn.LayerNorm``; weights start at 1, biases at 0."""
    if spec.kind == "rmsnorm":
        return RMSNorm(size, eps=spec.eps)
    return nn.LayerNorm(size, eps=spec.eps, bias=spec.bias)


def weight_like(weight: Tensor | None, x: Tensor) -> Tensor | None:
    """A norm's ``weight`` in its input's dtype. torch's fused RMSNorm kernel needs the two
    equal, and a bf16 residual stream (the default under autocast) meets fp32 weights: an
    eager step would otherwise run the op's composite form, one kernel per part. (LayerNorm
    needs none: autocast runs it in fp32.)"""
    if weight is None or weight.dtype == x.dtype:
        return weight
    return weight.to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` with its weight cast to the input's dtype (:func:`weight_like`)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, self.normalized_shape, weight_like(self.weight, x), self.eps)


def to_autocast_dtype(*tensors: Tensor | None) -> list[Tensor | None]:
    """The tensors in the autocast dtype where autocast is on for their device (as
    ``F.linear`` would cast them), else as they are: for code outside autocast's reach
    (a custom autograd Function, whose backward runs without autocast; the residual
    stream)."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return list(tensors)
    dtype = torch.get_autocast_dtype(device)
    return [None if t is None else t.to(dtype) for t in tensors]


def residual_stream(x: Tensor, fp32: bool) -> Tensor:
    """``x`` as a block takes it: unchanged with ``fp32`` (``model.fp32_residual``: the
    embedding's fp32 output keeps every residual sum in fp32), else in the autocast dtype
    (the default, as Megatron-LM's). Casting at each block's entry also covers a pipeline
    stage's input, which arrives in the parameters' dtype."""
    return x if fp32 else to_autocast_dtype(x)[0]


class Linear(nn.Linear):
    """``nn.Linear`` initialised as in GPT-2/Megatron: weight ~ N(0, init_std), bias 0."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, init_std: float):
        self.init_std = init_std  # nn.Linear.__init__ calls reset_parameters, which reads it
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class NormLinear(nn.Module):
    """``linear(norm(x))`` as one module, the shape of ``te.LayerNormLinear``."""

    def __init__(self, norm: nn.Module, linear: nn.Linear):
        super().__init__()
        self.norm = norm
        self.linear = linear

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.norm(x))


class Embedding(nn.Embedding):
    """``nn.Embedding`` with weight ~ N(0, init_std)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_std: float):
        self.init_std = init_std  # read by reset_parameters during nn.Embedding.__init__
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class OutputHead(nn.Module):
    """Logits ``hidden @ W^T`` and the cross-entropy loss, optionally with a tied ``W``."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        init_std: float,
        tied_weight: nn.Parameter | None = None,
        loss_chunk_tokens: int = 0,
    ):
        super().__init__()
        self.init_std = init_std
        self.loss_chunk_tokens = loss_chunk_tokens
        self.tied = tied_weight is not None
        if tied_weight is not None:
            self.weight = tied_weight  # the same Parameter object as the embedding's
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.tied:  # a tied weight is the embedding's to initialise
            nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.weight)

    def loss(
        self, hidden: Tensor, labels: Tensor, reduction: Literal["mean", "none"] = "mean"
    ) -> Tensor:
        """Mean cross-entropy over labels != -100, or per-token losses shaped like ``labels``
        (0 where ignored). The mean of no labels at all is NaN, as in ``F.cross_entropy``.
        With ``loss_chunk_tokens`` the mean never holds the whole logits."""
        if self.loss_chunk_tokens and reduction == "mean":
            return linear_cross_entropy(
                hidden, self.weight, labels, self.loss_chunk_tokens, IGNORE_INDEX
            )
        logits = self(hidden).float()
        losses = F.cross_entropy(
            logits.view(-1, logits.size(-1)),
            labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction=reduction,
        )
        return losses if reduction == "mean" else losses.view(labels.shape)


# enable_gqa (torch >= 2.5) lets SDPA share KV heads without copying them.
_SDPA_HAS_GQA = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 5)


def _native_gqa(q: Tensor) -> bool:
    # Measured (torch 2.11-2.13): on CPU and on CUDA fp16/bf16 (cuDNN or flash) enable_gqa
    # is as fast or faster than repeating KV heads (1B Llama step on H100: +2%); CUDA's
    # fp32 kernel (memory-efficient) lacks it and would fall back to the math kernel,
    # so there we repeat KV heads and keep a fused kernel.
    if not _SDPA_HAS_GQA:
        return False
    return not q.is_cuda or q.dtype in (torch.float16, torch.bfloat16)


SDPA_KERNELS = ("cudnn", "flash", "efficient", "math")


def attention_kernels(first: str) -> Callable[[], contextlib.AbstractContextManager] | None:
    """A context that makes SDPA try ``first`` before its other kernels (``model.
    attention_backend``), or None for ``auto``: torch's own order (flash, memory-efficient,
    math, cuDNN since torch 2.5). A kernel that cannot run an input falls through to the
    next, so ``cudnn`` is safe on CPU and on GPUs without it."""
    if first == "auto":
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    by_name = {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }
    order = [by_name[first]] + [by_name[name] for name in SDPA_KERNELS if name != first]
    return functools.partial(sdpa_kernel, order, set_priority=True)


def constant_over_keys(mask: Tensor | None) -> bool:
    """``mask`` adds one value per query to all its keys (``[..., T, 1]`` float, no
    gradient): softmax is unchanged by it."""
    return (
        mask is not None
        and mask.is_floating_point()
        and mask.dim() == 4
        and mask.size(1) == 1
        and mask.size(3) == 1
        and not mask.requires_grad
    )


class SDPAttention(nn.Module):
    """Causal attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, num_heads: int, num_groups: int, head_dim: int, *, dropout: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.num_groups = num_groups
        self.head_dim = head_dim
        self.dropout = dropout

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        """``q [B,T,heads,D]``, ``k``/``v [B,S,groups,D]`` -> ``[B,T,heads*D]`` (keys and
        values may come with their heads already repeated, ``groups = heads``).

        With ``S > T`` (a KV cache) the queries are the last ``T`` positions. ``attn_mask``
        replaces the causal mask: bool ``[B, 1, T, S]`` (True = may attend) for packed
        documents (:mod:`training.models.packing`), or a float mask broadcastable to
        ``[B, heads, T, S]`` added to the scores (T5's relative position biases and
        padding, :mod:`training.models.t5`; cast to the queries' dtype, as SDPA needs,
        so that masked keys stay finite there too).
        """
        batch, length = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = k.size(1) != q.size(1)
        # One query under a mask (a decode step over a paged cache): each KV group's query
        # heads become that group's queries, [B, groups, heads/groups, D], so the masked
        # (memory-efficient) kernel reads every key once instead of a copy per query head.
        fold = gqa and length == 1 and attn_mask is not None
        if fold:
            q = q.reshape(batch, k.size(1), -1, self.head_dim)
        native_gqa = gqa and not fold and _native_gqa(q)
        if gqa and not fold and not native_gqa:
            repeats = q.size(1) // k.size(1)
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        if attn_mask is None:
            mask, causal = _causal_mask(length, k.size(2), q.device)
        else:
            mask, causal = attn_mask, False
            if constant_over_keys(mask):
                # Softmax ignores it (T5's cross-attention without padding), and SDPA's CUDA
                # kernels refuse a bias broadcast over the keys.
                mask = None
            elif mask.is_floating_point() and mask.dtype != q.dtype:
                # Clamped first: fp32's most negative value would become -inf in fp16/bf16.
                mask = mask.clamp(min=torch.finfo(q.dtype).min).to(q.dtype)
        if self._shared_bias(q, k, mask):
            out = shared_bias_attention.shared_bias_attention(
                q, k, v, mask, scale=self.head_dim**-0.5
            )
            return out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        extra = {"enable_gqa": True} if native_gqa else {}
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
            **extra,
        )
        if fold:
            out = out.reshape(batch, self.num_heads, 1, self.head_dim)
        return out.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)

    def _shared_bias(self, q: Tensor, k: Tensor, mask: Tensor | None) -> bool:
        """A learned bias ``[1, heads, T, S]`` to train (T5's relative positions without
        padding) goes to :mod:`~training.models.shared_bias_attention`, whose bias
        gradient is summed over the batch in one kernel (CUDA only)."""
        return (
            mask is not None
            and mask.requires_grad
            and torch.is_grad_enabled()
            and k.size(1) == q.size(1)
            and not (self.dropout and self.training)
            and shared_bias_attention.usable(q, mask)
        )


def _causal_mask(queries: int, keys: int, device: torch.device) -> tuple[Tensor | None, bool]:
    """SDPA's ``is_causal`` aligns the mask top-left; with cached keys we need bottom-right."""
    if queries == keys:
        return None, True
    if queries == 1:
        return None, False
    mask = torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)
    return mask, False


def llama3_scaled(inv_freq: Tensor, scaling: RopeScaling) -> Tensor:
    """Llama 3's frequency scaling (Hugging Face ``_compute_llama3_parameters``, Megatron-Core
    ``RotaryEmbedding._apply_scaling``)."""
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE tables in the rotate-half (GPT-NeoX / Hugging Face Llama / Megatron) convention.

    The cos/sin table is fp32, kept out of the state dict and out of ``model.to(dtype)``;
    it is cast to the activations' dtype when applied. It is built lazily per device and
    only as long as the positions asked for so far (doubling, at least ``MIN_TABLE``), so
    ``max_positions`` from a config never sizes an allocation by itself. Explicit
    ``positions`` (packed documents, context parallelism) get their angles computed
    directly, without a table.
    """

    MIN_TABLE = 4096

    def __init__(
        self, head_dim: int, max_positions: int, base: float, scaling: RopeScaling | None = None
    ):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.base = base
        self.scaling = scaling
        self._table: tuple[Tensor, Tensor] | None = None

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        inv_freq = 1.0 / self.base**exponents
        if self.scaling is not None:
            inv_freq = llama3_scaled(inv_freq, self.scaling)
        inv_freq = inv_freq.to(device=positions.device, dtype=torch.float32)
        angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def _table_for(self, end: int, device: torch.device) -> tuple[Tensor, Tensor]:
        table = self._table
        if table is None or table[0].device != device or table[0].size(0) < end:
            size = max(self.MIN_TABLE, 1 << max(end - 1, 0).bit_length())
            size = min(size, self.max_positions)
            table = self._cos_sin(torch.arange(size, device=device, dtype=torch.float32))
            self._table = table
        return table

    def forward(
        self, start_pos: int, length: int, device: torch.device, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """cos and sin for positions ``start_pos .. start_pos+length-1``, or for the given
        ``positions [length]`` (or ``[B, length]``); each ``[length, D]`` (``[B, length, D]``)."""
        if positions is not None:
            if torch.compiler.is_compiling() and self._covers(1, device):
                # Packed documents and context parallelism in a compiled step: positions
                # within the training sequence, which the table cached before compiling
                # covers (an index past it fails the gather's bounds check, loudly).
                cos, sin = self._table
                return cos[positions], sin[positions]
            return self._cos_sin(positions)
        if start_pos < 0 or start_pos + length > self.max_positions:
            raise ValueError(
                f"positions {start_pos}..{start_pos + length - 1} are outside "
                f"0..{self.max_positions - 1} (model.max_position_embeddings)"
            )
        end = start_pos + length
        if torch.compiler.is_compiling() and not self._covers(end, device):
            # A table cached from inside a compiled graph is that graph's output, which CUDA
            # graphs (training.compile_mode=reduce-overhead) overwrite on their next replay;
            # so without a table cached beforehand (cache_rope_tables) the graph makes its own.
            return self._cos_sin(torch.arange(start_pos, end, device=device))
        cos, sin = self._table_for(end, device)
        return cos[start_pos:end], sin[start_pos:end]

    def _covers(self, end: int, device: torch.device) -> bool:
        table = self._table
        return table is not None and table[0].device == device and table[0].size(0) >= end

    def cache_table(self, length: int, device: torch.device) -> None:
        """Build the table for positions ``0..length-1`` now, outside any compiled graph."""
        for part in self._table_for(min(length, self.max_positions), device):
            torch._dynamo.mark_static_address(part)  # CUDA graphs read it in place, uncopied


def cache_rope_tables(model: nn.Module, length: int, device: torch.device) -> None:
    """Cache every RoPE table of ``model`` for ``length`` positions before it is compiled.

    A compiled forward then slices the table (a graph input); without one, Inductor fuses
    the sin and cos of the angles into every kernel that rotates queries or keys: RoPE
    took 6.45 ms of a 211 ms 1B Llama step on an H200 that way, 2.69 with the table
    (benchmarks/RESULTS.md)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cache_table(length, device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, T, ..., D]`` by the angles of its positions (``cos``/``sin [T, D]``,
    or ``[B, T, D]`` when each row has its own positions: packed documents)."""
    shape = cos.shape[:-1] + (1,) * (x.dim() - 3) + cos.shape[-1:]
    cos = cos.view(shape).to(x.dtype)
    sin = sin.view(shape).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def swiglu(x: Tensor) -> Tensor:
    """``silu(gate) * up`` for ``x = [gate; up]`` along the last dimension."""
    return gated(x, "silu")


def geglu(x: Tensor) -> Tensor:
    """``gelu(gate) * up`` (tanh GELU) for ``x = [gate; up]``: T5 v1.1's gated-GELU."""
    return gated(x, "gelu_tanh")


def gelu(x: Tensor) -> Tensor:
    """GPT-2's GELU (tanh approximation; Hugging Face ``gelu_new``)."""
    return F.gelu(x, approximate="tanh")


def gelu_erf(x: Tensor) -> Tensor:
    """The exact (erf) GELU: Megatron-Core's without bias-GELU fusion, Hugging Face's ``gelu``."""
    return F.gelu(x)


def scaled_init_std(init_std: float, num_layers: int) -> float:
    """Std of the residual-branch output projections (GPT-2, Megatron): init_std / sqrt(2L)."""
    return init_std / math.sqrt(2.0 * num_layers)
