"""Tensor (and sequence) parallelism with the Transformer Engine backend: TE's own
tensor-parallel modules.

``GPTModel(config, TETensorParallelBackend(tp_group, sequence_parallel))`` builds one TP
shard of the model, as :class:`~training.models.tp_backend.TensorParallelBackend` does,
with the same parameters, names, shapes and init (so sharded checkpoints, shard specs and
``shard_full_state_dict`` are the same), but the linears run TE's tensor-parallel modules
on CUDA:

- the fused QKV and fc1 (with their input norm): ``te.LayerNormLinear(parallel_mode=
  "column")``, the output projection and fc2: ``te.Linear(parallel_mode="row")``, each
  given the TP group and ``sequence_parallel``: TE does the all-gather of the normalised
  sequence shards (in fp8 under an fp8 recipe), the reduce-scatter or all-reduce of the
  outputs, and their conjugates in backward;
- a dense MLP whose activation TE has: one ``te.LayerNormMLP(set_parallel_mode=True)``,
  fc1 column- and fc2 row-parallel;
- attention: ``te.DotProductAttention`` over this rank's heads;
- embedding, output head and loss, the final norm and the sequence split stay the
  tensor-parallel backend's (vocab-parallel; TE has none).

Layout. TE puts the sequence first (``[T, B, H]``) and gathers / scatters along its
first dimension; our activations are ``[B, T, H]``. With sequence parallelism the
column-parallel output (TE's ``[tp·B, T/tp, F]``, rank-major) is reordered to
``[B, T, F]`` and the row-parallel input is ordered rank-major before TE's
reduce-scatter, one copy each, as our own sequence-parallel layers copy to gather along
the sequence.

Gradients of replicated parameters applied to sequence shards (norm weights and biases,
row-parallel biases) are partial on each rank under SP; TE leaves their reduction to
the framework (Megatron-core all-reduces parameters marked ``sequence_parallel``), so
the engines get them through :func:`copy_to_tensor_parallel_region`, which all-reduces
their gradient in backward as the tensor-parallel backend's own norms do.

Communication overlap (``parallel.tp_comm_overlap``). TE can hide the sequence-parallel
all-gathers and reduce-scatters behind its GEMMs: each is split into chunks moved over
*userbuffers* (buffers the TP ranks map into each other's memory) while the GEMM
multiplies the chunks already there. :func:`initialize_comm_overlap` allocates them
(TE's ``initialize_ub``: one buffer shape, ``micro_batch_size · seq_length / cp`` rows
of ``hidden_size``, so every training micro-batch must have that many tokens) before the
first forward builds the engines; the backend then names each engine's GEMMs as TE's
tables do: ``qkv`` and ``fc1`` (column-parallel, with their norms: all-gather overlapped
in forward, the input-gradient reduce-scatter and the input's re-gather overlapped
with the backward GEMMs, "bulk"), ``proj`` and ``fc2`` (row-parallel: reduce-scatter
overlapped in forward, the output-gradient all-gather in backward). A row-parallel linear
closes the block the last column-parallel one opened (:data:`OVERLAP_PAIRS`).
Forwards without gradients (validation) run engines without userbuffers (any shape).
TE wants ``CUDA_DEVICE_MAX_CONNECTIONS=1`` set before CUDA starts (``megalith train``
does, :func:`~training.runtime.launch.comm_overlap_env`) so that each collective is
queued before the GEMM it hides behind; NVLink multicast is never used (``UB_SKIPMC``):
the userbuffers map peers' memory through CUDA IPC.

Off CUDA (the meta device, CPU tools) the modules run the tensor-parallel backend's
layers with the same weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from megalith.config import MegalithConfig, ModelConfig
from megalith.errors import MegalithError
from training.models import layers
from training.models.backend import LayerBackend
from training.models.layers import NormSpec
from training.models.te_backend import (
    TE_PARAMETER_NAMES,
    Engine,
    TEAttention,
    TEFusedMLP,
    TENormLinear,
    TEProvider,
    attach_engine,
    attention_engine,
    engine_device,
    fused_mlp_engine,
    import_transformer_engine,
    layer_norm_linear_module,
    linear_module,
)
from training.models.tp_backend import TensorParallelBackend
from training.parallel.groups import ParallelSizes
from training.parallel.random import RankForked
from training.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from training.parallel.tensor_parallel.mappings import copy_to_tensor_parallel_region

# TE's userbuffers GEMM names: the column-parallel linear opening a tensor-parallel block
# -> the row-parallel one closing it (TE's all-gather -> reduce-scatter pairs).
OVERLAP_PAIRS = {"qkv": "proj", "fc1": "fc2"}
_COLUMN_OVERLAP = dict(ub_overlap_ag=True, ub_bulk_dgrad=True, ub_bulk_wgrad=True)
_ROW_OVERLAP = dict(ub_overlap_rs=True, ub_overlap_ag=True)
# te.LayerNormMLP: fc1's column overlaps and fc2's row overlaps in one set (its
# ub_overlap_ag serves fc1's forward all-gather and fc2's output-gradient all-gather).
_FUSED_MLP_OVERLAP = dict(_COLUMN_OVERLAP, **_ROW_OVERLAP)


@dataclass(frozen=True)
class CommOverlap:
    """TE's userbuffers: ``tokens`` rows (a micro-batch's tokens on this CP rank, the
    whole sequence) of ``hidden`` features; ``gemms``: TE's ``ub_cfgs``, per GEMM the
    settings that differ from TE's defaults (``parallel.tp_comm_overlap_config``)."""

    tokens: int
    hidden: int
    gemms: dict[str, dict[str, Any]] = field(default_factory=dict)


def comm_overlap(
    config: MegalithConfig, model_config: ModelConfig, sizes: ParallelSizes
) -> CommOverlap | None:
    """The userbuffers ``parallel.tp_comm_overlap`` asks for (None when off)."""
    if not config.parallel.tp_comm_overlap:
        return None
    tokens = config.training.micro_batch_size * config.data.seq_length // sizes.cp
    gemms = {
        name: settings.model_dump(exclude_none=True)
        for name, settings in config.parallel.tp_comm_overlap_config.items()
    }
    return CommOverlap(tokens, model_config.hidden_size, gemms)


def initialize_comm_overlap(
    te: Any, overlap: CommOverlap, tp_size: int, fp8: bool, dtype: torch.dtype
) -> None:
    """Allocate TE's userbuffers (collective over every rank; TP groups are consecutive
    ranks, as TE assumes). Call once per process, before the first forward."""
    os.environ.setdefault("UB_SKIPMC", "1")  # CUDA IPC, never NVLink multicast
    modes = te.UserBufferQuantizationMode
    te.initialize_ub(
        shape=[overlap.tokens, overlap.hidden],
        tp_size=tp_size,
        quantization_modes=[modes.FP8 if fp8 else modes.NONE],
        dtype=dtype,
        ub_cfgs=overlap.gemms or None,
        bootstrap_backend="nccl",
    )


def sequence_from_te(y: Tensor, tp: int) -> Tensor:
    """TE's gathered output ``[tp·B, T/tp, F]`` (rank ``r``'s tokens of every sample in
    block ``r``) as ``[B, T, F]``."""
    rows, shard, features = y.shape
    return y.view(tp, rows // tp, shard, features).transpose(0, 1).reshape(-1, tp * shard, features)


def sequence_to_te(x: Tensor, tp: int) -> Tensor:
    """``[B, T, F]`` as ``[tp·B, T/tp, F]``: TE's reduce-scatter along its first dimension
    then leaves rank ``r`` the sequence shard ``r`` of every sample, ``[B, T/tp, F]``."""
    batch, length, features = x.shape
    return (
        x.view(batch, tp, length // tp, features)
        .transpose(0, 1)
        .reshape(-1, length // tp, features)
    )


class TEColumnParallelLinear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` run by ``te.Linear(parallel_mode="column")``."""

    def forward(self, x: Tensor) -> Tensor:
        if not engine_device(x, self._devices) or self.gather_output:
            return super().forward(x)
        y = self._engine(self, x)
        return sequence_from_te(y, self.group.size()) if self.sequence_parallel else y


class TERowParallelLinear(RowParallelLinear):
    """:class:`RowParallelLinear` run by ``te.Linear(parallel_mode="row")``."""

    def forward(self, x: Tensor) -> Tensor:
        if not engine_device(x, self._devices):
            return super().forward(x)
        if self.sequence_parallel:
            x = sequence_to_te(x, self.group.size())
        return self._engine(self, x)


class TEParallelNormLinear(TENormLinear):
    """``linear(norm(x))`` with a column-parallel linear, run by ``te.LayerNormLinear``."""

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        if self.linear.sequence_parallel and engine_device(x, self._devices):
            return sequence_from_te(y, self.linear.group.size())
        return y


class TETensorParallelBackend(TensorParallelBackend):
    """TE's tensor-parallel linears and attention over ``group``; the rest as
    :class:`TensorParallelBackend` (see the module doc)."""

    name = "te"

    def __init__(
        self,
        group: ProcessGroup,
        sequence_parallel: bool = False,
        te: TEProvider = import_transformer_engine,
        devices: tuple[str, ...] = ("cuda",),
        overlap: CommOverlap | None = None,
    ):
        super().__init__(group, sequence_parallel)
        self.te, self.devices, self.overlap = te, devices, overlap
        # Userbuffers names: the next column-parallel linear's (``qkv`` while qkv() builds)
        # and the next row-parallel one's, which closes the block the last column opened.
        self._next_column, self._next_row = "fc1", "fc2"

    def _parallel(self, mode: str) -> dict:
        """TE's tensor-parallel constructor arguments."""
        return dict(
            parallel_mode=mode,
            tp_group=self.group,
            tp_size=self.tensor_parallel_size,
            sequence_parallel=self.sequence_parallel,
        )

    def _make_engine(
        self,
        build: Any,
        names: str,
        feed: Any,
        overlap: dict[str, Any],
        rows: int,
        **arguments: Any,
    ) -> Engine:
        """An engine of ``build(**arguments)``; with ``self.overlap`` also of the module
        whose GEMMs overlap their communication (``overlap``'s TE arguments, ``rows``
        tokens per input)."""
        plain = build(**arguments)
        if self.overlap is None:
            return Engine(plain, TE_PARAMETER_NAMES[names], feed)
        overlapped = build(**arguments, **overlap)
        return Engine(plain, TE_PARAMETER_NAMES[names], feed, overlapped, rows)

    def _reduced(self, *names: str):
        """The engines' feed: ``names`` through a gradient all-reduce under SP."""
        if not self.sequence_parallel:
            return None
        group = self.group

        def feed(name: str, param: Tensor) -> Tensor:
            return copy_to_tensor_parallel_region(param, group) if name in names else param

        return feed

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
        self._next_column = "qkv"
        try:
            return super().qkv(
                hidden_size,
                num_heads,
                num_groups,
                head_dim,
                norm=norm,
                bias=bias,
                init_std=init_std,
            )
        finally:
            self._next_column = "fc1"

    def _column_overlap(self) -> dict[str, Any]:
        """TE's userbuffers arguments of the next column-parallel linear."""
        name = self._next_column
        self._next_row = OVERLAP_PAIRS[name]
        return dict(_COLUMN_OVERLAP, ub_name=name)

    def _overlap_rows(self, sharded: bool) -> int:
        """Tokens per input: a column-parallel linear's input is the sequence shard."""
        if self.overlap is None:
            return 0
        return self.overlap.tokens // (self.tensor_parallel_size if sharded else 1)

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
        norm_module = self.norm(in_features, norm)
        if norm.kind == "layernorm" and not norm.bias:  # TE's LayerNorm always has a bias
            linear = self.column_linear(
                in_features, out_features, bias=bias, init_std=init_std, output_chunks=output_chunks
            )
            return layers.NormLinear(norm_module, linear)
        linear = super().column_linear(
            in_features, out_features, bias=bias, init_std=init_std, output_chunks=output_chunks
        )
        engine = self._make_engine(
            lambda **kw: layer_norm_linear_module(
                self.te, in_features, out_features, norm, bias=bias, dtype=linear.weight.dtype, **kw
            ),
            "norm_linear",
            self._reduced("norm.weight", "norm.bias"),
            self._column_overlap(),
            self._overlap_rows(sharded=True),
            **self._parallel("column"),
        )
        return TEParallelNormLinear(norm_module, linear, engine, self.devices)

    def column_linear(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        init_std: float,
        output_chunks: int = 1,
    ) -> nn.Module:
        module = TEColumnParallelLinear(
            in_features,
            out_features,
            group=self.group,
            bias=bias,
            init_std=init_std,
            output_chunks=output_chunks,
            sequence_parallel=self.sequence_parallel,
        )
        engine = self._make_engine(
            lambda **kw: linear_module(self.te, in_features, out_features, bias=bias, **kw),
            "linear",
            None,
            self._column_overlap(),
            self._overlap_rows(sharded=True),
            **self._parallel("column"),
        )
        attach_engine(module, engine, self.devices)
        return module

    def row_linear(
        self, in_features: int, out_features: int, *, bias: bool, init_std: float
    ) -> nn.Module:
        module = TERowParallelLinear(
            in_features,
            out_features,
            group=self.group,
            bias=bias,
            init_std=init_std,
            sequence_parallel=self.sequence_parallel,
        )
        engine = self._make_engine(
            lambda **kw: linear_module(self.te, in_features, out_features, bias=bias, **kw),
            "linear",
            self._reduced("bias"),
            dict(_ROW_OVERLAP, ub_name=self._next_row),
            self._overlap_rows(sharded=False),
            **self._parallel("row"),
        )
        attach_engine(module, engine, self.devices)
        return module

    def fused_mlp(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str,
        norm: NormSpec,
        bias: bool,
    ) -> TEFusedMLP | None:
        """``te.LayerNormMLP`` over the TP group: fc1 column-, fc2 row-parallel. Under SP it
        all-gathers and reduce-scatters along the same (first) dimension, so each rank gets
        back its own tokens and needs no reordering. With userbuffers it overlaps as the
        ``fc1`` and ``fc2`` linears would (TE names its GEMMs ``fc1_fprop`` ... ``fc2_wgrad``
        itself)."""
        overlap = None if self.overlap is None else _FUSED_MLP_OVERLAP
        return fused_mlp_engine(
            self.te,
            hidden_size,
            ffn_hidden_size,
            activation=activation,
            norm=norm,
            bias=bias,
            devices=self.devices,
            feed=self._reduced("fc1.norm.weight", "fc1.norm.bias", "fc2.bias"),
            overlap=overlap,
            overlap_rows=self._overlap_rows(sharded=True),
            set_parallel_mode=True,
            tp_group=self.group,
            tp_size=self.tensor_parallel_size,
            sequence_parallel=self.sequence_parallel,
        )

    def core_attention(
        self,
        num_heads: int,
        num_groups: int,
        head_dim: int,
        *,
        dropout: float,
        attention_backend: str = "auto",
    ) -> nn.Module:
        if attention_backend != "auto":  # SDPA asked for (TensorParallelBackend's)
            return super().core_attention(
                num_heads,
                num_groups,
                head_dim,
                dropout=dropout,
                attention_backend=attention_backend,
            )
        engine = attention_engine(self.te, num_heads, num_groups, head_dim, dropout)
        attention = TEAttention(
            num_heads, num_groups, head_dim, dropout=dropout, engine=engine, devices=self.devices
        )
        return RankForked(attention, self.group, random=dropout > 0.0)


def tensor_parallel_backend(
    kernels: LayerBackend,
    group: ProcessGroup,
    sequence_parallel: bool,
    overlap: CommOverlap | None = None,
) -> TensorParallelBackend:
    """The TP backend of the kernel backend ``kernels`` (``model.backend`` resolved):
    TE's tensor-parallel modules for ``te`` (their GEMMs overlapping the communication
    with ``overlap``), our Megatron-style layers for ``torch``."""
    if kernels.name == "te":
        return TETensorParallelBackend(
            group, sequence_parallel, te=kernels.te, devices=kernels.devices, overlap=overlap
        )
    if overlap is not None:
        raise MegalithError(
            "parallel.tp_comm_overlap needs model.backend resolving to te (TE's userbuffers); "
            f"it resolves to {kernels.name}: use parallel.async_tensor_parallel with torch"
        )
    return TensorParallelBackend(group, sequence_parallel)


__all__ = [
    "OVERLAP_PAIRS",
    "CommOverlap",
    "TEColumnParallelLinear",
    "TEParallelNormLinear",
    "TERowParallelLinear",
    "TETensorParallelBackend",
    "comm_overlap",
    "initialize_comm_overlap",
    "sequence_from_te",
    "sequence_to_te",
    "tensor_parallel_backend",
]
