"""The Transformer Engine layer backend (``model.backend: te``; ``auto`` picks it where
``transformer_engine`` imports): ``te.LayerNormLinear`` for the fused norm + QKV,
``te.Linear`` for the output projection, ``te.LayerNormMLP`` for a whole dense MLP (norm,
fc1, activation, fc2: :class:`TEFusedMLP`; an erf GELU or a LayerNorm without bias runs
as ``te.LayerNormLinear`` + our activation + ``te.Linear``), ``te.DotProductAttention``
for the attention core, and fp8 through ``te.fp8_autocast`` (:mod:`training.precision.fp8`).

Checkpoint names. The model keeps the torch backend's parameter names and whole-tensor
format (``layers.{i}.attention.qkv.norm.weight``, ``...qkv.linear.weight``,
``...proj.weight``, ...; see :mod:`training.models.gpt`), so checkpoints, model
packages, Hugging Face export and every tool work unchanged. Each module here *is*
the torch backend's module (a subclass of ``NormLinear``, ``Linear`` or
``SDPAttention``, same children, same init) and owns its parameters; its Transformer
Engine module is an *engine* built on the first CUDA forward, kept outside the module
tree (so outside ``state_dict``, ``named_parameters`` and the optimizer), and handed
our ``Parameter`` objects under TE's names before every call (:data:`TE_PARAMETER_NAMES`:
``layer_norm_weight``/``layer_norm_bias``/``weight``/``bias``). TE's backward therefore
writes the gradients into our parameters. Off CUDA (CPU evaluation of a package, the
meta device, tests) the modules compute the torch backend's functions with the same
weights. TE's own per-module state (delayed scaling's amax history, kept in its
``_extra_state``) is not checkpointed: a resumed ``delayed`` run rebuilds it within
``amax_history_len`` steps; the default ``tensorwise`` recipe (current scaling) has none.

Limits: a LayerNorm without bias has no fused TE kernel (TE's LayerNorm always has a
bias), so it runs as our norm then ``te.Linear``; attention over a KV cache (queries
fewer than keys), bool or per-sample masks and fp32 inputs use SDPA (T5's relative bias,
one for the whole batch, goes to TE's attention as a bias with its gradient);
``torch.compile`` graph-breaks around the TE calls (TE marks them dynamo-disabled);
activation checkpointing with fp8 is refused by :mod:`training.precision.fp8` (the
recomputed forward would run outside ``fp8_autocast``);
under tensor parallelism the model gets TE's own tensor-parallel modules instead
(:mod:`training.parallel.te_tensor_parallel`).

Verified with a real Transformer Engine (2.20.2, torch 2.11, one H100, 2026-11-25): the
``gpu`` tests of tests/test_te_backend.py compare it with the torch backend (forward,
backward, Trainer curves in bf16, fp8 tensorwise/delayed, fp8 under torch.compile); the
rest of that file checks the wiring on CPU against a stand-in. The fused MLP
(``te.LayerNormMLP``, alone and over a TP group) passed the same tests on 2026-11-27 (4× H100)
with SwiGLU and the tanh GELU, T5's gated GELU (``geglu``) on 2026-11-28 (2× H100), and
T5's biased attention through TE's ``post_scale_bias`` on 2026-11-28 (H100).
Results: benchmarks/RESULTS.md ("Tests that need a GPU", and "the dense MLP as one
``te.LayerNormMLP``").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from megalith.errors import MegalithError
from training.models import layers
from training.models.backend import TorchBackend
from training.models.layers import NormSpec

# Our parameter (relative to the module) -> the TE engine's parameter name.
TE_PARAMETER_NAMES = {
    "norm_linear": {
        "norm.weight": "layer_norm_weight",
        "norm.bias": "layer_norm_bias",
        "linear.weight": "weight",
        "linear.bias": "bias",
    },
    "linear": {"weight": "weight", "bias": "bias"},
    # The whole dense MLP (fc1 = norm + linear, fc2) as one te.LayerNormMLP.
    "mlp": {
        "fc1.norm.weight": "layer_norm_weight",
        "fc1.norm.bias": "layer_norm_bias",
        "fc1.linear.weight": "fc1_weight",
        "fc1.linear.bias": "fc1_bias",
        "fc2.weight": "fc2_weight",
        "fc2.bias": "fc2_bias",
    },
}
# Our MLP activations that TE has under the same name (TE's GELU is the tanh one; it has
# no erf GELU, so an MLP with that runs its layers one by one).
TE_ACTIVATIONS = frozenset({"swiglu", "geglu", "gelu"})

TEProvider = Callable[[], Any]


def import_transformer_engine() -> Any:
    import transformer_engine.pytorch as te

    return te


def te_parameter_names(model: nn.Module) -> dict[str, str]:
    """Every parameter name of ``model`` (whole-tensor checkpoint names) -> the name it
    has inside the TE engines (``...qkv.norm.weight`` -> ``...qkv.layer_norm_weight``);
    the names of the torch layers (embeddings, final norm, head) map to themselves.
    Built from the module tree with the same table the engines use at run time."""
    mapping = {name: name for name, _ in model.named_parameters()}
    modules = list(model.named_modules())
    engines = [(path, m.__dict__["_engine"]) for path, m in modules if "_engine" in m.__dict__]
    # A fused MLP's engine is what runs, not its fc1/fc2 engines: it maps their names last.
    engines += [
        (path, m.fused.engine)
        for path, m in modules
        if isinstance(m.__dict__.get("fused"), TEFusedMLP)
    ]
    for path, engine in engines:
        for ours, theirs in engine.names.items():
            full = f"{path}.{ours}" if path else ours
            if full in mapping:
                mapping[full] = f"{path}.{theirs}" if path else theirs
    return mapping


Feed = Callable[[str, Tensor], Tensor]


class Engine:
    """The lazily built TE module of one of our modules, fed our parameters each call.

    ``feed(name, parameter)``, where given, is what the engine gets instead of the
    parameter itself (tensor parallelism passes replicated parameters through a
    gradient all-reduce under sequence parallelism).

    ``overlap``, where given, builds the module that training forwards run: one whose
    tensor-parallel communication TE overlaps with its GEMMs through userbuffers of a
    fixed number of rows (``overlap_rows`` tokens in each input); forwards without
    gradients (validation) run ``build``'s module, which takes any shape. Both modules
    read the same parameters."""

    def __init__(
        self,
        build: Callable[[], nn.Module],
        names: dict[str, str],
        feed: Feed | None = None,
        overlap: Callable[[], nn.Module] | None = None,
        overlap_rows: int | None = None,
    ):
        self.build, self.names, self.feed, self.module = build, names, feed, None
        self.build_overlap, self.overlap_rows, self.overlap_module = overlap, overlap_rows, None
        # Opaque to torch.compile: TE's modules are dynamo-disabled anyway, and the
        # aliasing in _run is bookkeeping, not graph. Disabled here rather than by a
        # decorator, which would import dynamo (1.6 s) in every process importing models.
        self._run_opaque = torch.compiler.disable(self._run)

    def __call__(self, owner: nn.Module, *inputs: Tensor, **options: Any) -> Tensor:
        return self._run_opaque(owner, *inputs, **options)

    def _run(self, owner: nn.Module, *inputs: Tensor, **options: Any) -> Tensor:
        module = self._module(inputs[0])
        for ours, theirs in self.names.items():
            param = _attribute(owner, ours)
            if param is not None:
                fed = param if self.feed is None else self.feed(ours, param)
                module._parameters[theirs] = fed  # alias: TE reads and grads ours
        module.train(owner.training)
        return module(*inputs, **options)

    def _module(self, x: Tensor) -> nn.Module:
        """The overlapping module for a training forward, the plain one otherwise."""
        if self.build_overlap is None or not torch.is_grad_enabled():
            if self.module is None:
                self.module = self.build()
            return self.module
        rows = x.numel() // x.size(-1)
        if rows != self.overlap_rows:
            raise MegalithError(
                f"parallel.tp_comm_overlap: TE's userbuffers hold {self.overlap_rows} tokens "
                f"here but this training forward has {rows}; every training micro-batch must "
                "be training.micro_batch_size x data.seq_length tokens"
            )
        if self.overlap_module is None:
            self.overlap_module = self.build_overlap()
        return self.overlap_module


def _attribute(module: nn.Module, name: str) -> Tensor | None:
    """``module.norm.bias`` for ``"norm.bias"``; None where there is none (no bias)."""
    for part in name.split("."):
        module = getattr(module, part, None)
    return module


def engine_device(x: Tensor, devices: tuple[str, ...]) -> bool:
    """Whether the engines run for ``x`` (CUDA); elsewhere the torch functions do."""
    return x.device.type in devices


def attach_engine(module: nn.Module, engine: Engine, devices: tuple[str, ...]) -> None:
    """Give ``module`` its engine, outside the module tree (so outside ``state_dict``)."""
    module.__dict__["_engine"] = engine
    module.__dict__["_devices"] = devices


class TENormLinear(layers.NormLinear):
    """``linear(norm(x))`` with the torch backend's names; ``te.LayerNormLinear`` on CUDA."""

    def __init__(self, norm: nn.Module, linear: nn.Linear, engine: Engine, devices):
        super().__init__(norm, linear)
        attach_engine(self, engine, devices)

    def forward(self, x: Tensor) -> Tensor:
        if engine_device(x, self._devices):
            return self._engine(self, x)
        return super().forward(x)


class TELinear(layers.Linear):
    """``nn.Linear`` with our init and names; ``te.Linear`` on CUDA."""

    def attach(self, engine: Engine, devices: tuple[str, ...]) -> TELinear:
        attach_engine(self, engine, devices)
        return self

    def forward(self, x: Tensor) -> Tensor:
        if engine_device(x, self._devices):
            return self._engine(self, x)
        return F.linear(x, self.weight, self.bias)


class TEAttention(layers.SDPAttention):
    """Attention through ``te.DotProductAttention`` (``bshd``) on CUDA in bf16/fp16:

    - causal, where queries and keys are the same positions and no mask is given;
    - with a float mask that is one bias per head for the whole batch (``[1, heads, T,
      S]``: T5's relative position biases, the decoder's causality folded in): TE's
      ``post_scale_bias`` over no mask, whose cuDNN kernels also return the bias's gradient;
    - with a float mask constant over the keys (``[B or 1, 1, T, 1]``: T5's cross-attention
      without padding), which softmax ignores: no mask.

    SDPA otherwise: a KV cache without a mask, bool masks (packed documents), per-sample
    float masks (T5 with padding), fp32."""

    def __init__(self, num_heads, num_groups, head_dim, *, dropout, engine, devices):
        super().__init__(num_heads, num_groups, head_dim, dropout=dropout)
        attach_engine(self, engine, devices)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None) -> Tensor:
        usable = q.dtype in (torch.bfloat16, torch.float16) and engine_device(q, self._devices)
        qkv = (q.contiguous(), k.contiguous(), v.contiguous()) if usable else ()
        if usable and attn_mask is None and q.size(1) == k.size(1):
            out = self._engine(self, *qkv)
        elif usable and layers.constant_over_keys(attn_mask):
            out = self._engine(self, *qkv, attn_mask_type="no_mask")
        elif usable and self._bias_per_head(attn_mask, q, k):
            bias = attn_mask.clamp(min=torch.finfo(q.dtype).min).to(q.dtype)  # as SDPA's
            out = self._engine(
                self,
                *qkv,
                attn_mask_type="no_mask",
                core_attention_bias_type="post_scale_bias",
                core_attention_bias=bias.contiguous(),
            )
        else:
            return super().forward(q, k, v, attn_mask)
        return out.reshape(q.size(0), q.size(1), self.num_heads * self.head_dim)

    def _bias_per_head(self, mask: Tensor | None, q: Tensor, k: Tensor) -> bool:
        """``mask`` is ``[1, heads, T, S]`` float: one bias for the whole batch."""
        shape = (1, self.num_heads, q.size(1), k.size(1))
        return mask is not None and mask.is_floating_point() and tuple(mask.shape) == shape


def fusable_mlp(activation: str, norm: NormSpec) -> str | None:
    """TE's name for an MLP activation that ``te.LayerNormMLP`` can run with this norm, or
    None (an erf GELU; a LayerNorm without bias, which TE's LayerNorm always has)."""
    if norm.kind == "layernorm" and not norm.bias:
        return None
    return activation if activation in TE_ACTIVATIONS else None


class TEFusedMLP:
    """A dense MLP through ``te.LayerNormMLP`` on CUDA: norm, fc1, activation and fc2 in
    one module, so under fp8 the activation writes fp8 for fc2 directly and its backward
    fuses with the cast of fc1's output gradient. It reads the MLP's own parameters
    (``TE_PARAMETER_NAMES["mlp"]``); the MLP's ``fc1``/``fc2`` engines then never run."""

    def __init__(self, engine: Engine, devices: tuple[str, ...]):
        self.engine, self.devices = engine, devices

    def runs_for(self, x: Tensor) -> bool:
        return engine_device(x, self.devices)

    def __call__(self, mlp: nn.Module, x: Tensor) -> Tensor:
        return self.engine(mlp, x)


def layer_norm_mlp_module(
    te: TEProvider,
    hidden_size: int,
    ffn_hidden_size: int,
    norm: NormSpec,
    *,
    activation: str,
    bias: bool,
    dtype: torch.dtype,
    **parallel: Any,
) -> Callable[[], nn.Module]:
    """What builds a ``te.LayerNormMLP`` (``parallel`` as in :func:`layer_norm_linear_module`)."""
    return lambda: te().LayerNormMLP(
        hidden_size,
        ffn_hidden_size,
        eps=norm.eps,
        bias=bias,
        normalization="RMSNorm" if norm.kind == "rmsnorm" else "LayerNorm",
        activation=activation,
        params_dtype=dtype,
        device="meta",
        **parallel,
    )


def fused_mlp_engine(
    te: TEProvider,
    hidden_size: int,
    ffn_hidden_size: int,
    *,
    activation: str,
    norm: NormSpec,
    bias: bool,
    devices: tuple[str, ...],
    feed: Feed | None = None,
    overlap: dict[str, Any] | None = None,
    overlap_rows: int | None = None,
    **parallel: Any,
) -> TEFusedMLP | None:
    """A dense MLP as one ``te.LayerNormMLP``, or None where TE lacks its activation or
    norm (:func:`fusable_mlp`); ``parallel``: TE's tensor-parallel arguments; ``overlap``:
    TE's userbuffers arguments of the module training forwards run (``overlap_rows``
    tokens per input, :class:`Engine`)."""
    te_activation = fusable_mlp(activation, norm)
    if te_activation is None:
        return None

    def build(**userbuffers: Any) -> Callable[[], nn.Module]:
        return layer_norm_mlp_module(
            te,
            hidden_size,
            ffn_hidden_size,
            norm,
            activation=te_activation,
            bias=bias,
            dtype=torch.get_default_dtype(),
            **parallel,
            **userbuffers,
        )

    overlapped = None if overlap is None else build(**overlap)
    engine = Engine(build(), TE_PARAMETER_NAMES["mlp"], feed, overlapped, overlap_rows)
    return TEFusedMLP(engine, devices)


def layer_norm_linear_module(
    te: TEProvider,
    in_features: int,
    out_features: int,
    norm: NormSpec,
    *,
    bias: bool,
    dtype: torch.dtype,
    **parallel: Any,
) -> Callable[[], nn.Module]:
    """What builds a ``te.LayerNormLinear``; ``parallel``: TE's tensor-parallel (and
    userbuffers) arguments (``parallel_mode``, ``tp_group``, ``tp_size``,
    ``sequence_parallel``, ``ub_*``), sizes global."""
    return lambda: te().LayerNormLinear(
        in_features,
        out_features,
        eps=norm.eps,
        bias=bias,
        normalization="RMSNorm" if norm.kind == "rmsnorm" else "LayerNorm",
        params_dtype=dtype,
        device="meta",  # parameters are ours; nothing to allocate
        **parallel,
    )


def linear_module(
    te: TEProvider, in_features: int, out_features: int, *, bias: bool, **parallel: Any
) -> Callable[[], nn.Module]:
    """What builds a ``te.Linear`` (``parallel`` as in :func:`layer_norm_linear_module`)."""
    return lambda: te().Linear(in_features, out_features, bias=bias, device="meta", **parallel)


def layer_norm_linear_engine(
    te: TEProvider,
    in_features: int,
    out_features: int,
    norm: NormSpec,
    *,
    bias: bool,
    dtype: torch.dtype,
    feed: Feed | None = None,
    **parallel: Any,
) -> Engine:
    """A ``te.LayerNormLinear`` engine (``parallel`` as in :func:`layer_norm_linear_module`)."""
    build = layer_norm_linear_module(
        te, in_features, out_features, norm, bias=bias, dtype=dtype, **parallel
    )
    return Engine(build, TE_PARAMETER_NAMES["norm_linear"], feed)


def linear_engine(
    te: TEProvider,
    in_features: int,
    out_features: int,
    *,
    bias: bool,
    feed: Feed | None = None,
    **parallel: Any,
) -> Engine:
    """A ``te.Linear`` engine (``parallel`` as in :func:`layer_norm_linear_module`)."""
    build = linear_module(te, in_features, out_features, bias=bias, **parallel)
    return Engine(build, TE_PARAMETER_NAMES["linear"], feed)


def attention_engine(
    te: TEProvider, num_heads: int, num_groups: int, head_dim: int, dropout: float
) -> Engine:
    """A causal ``te.DotProductAttention`` engine over ``bshd`` tensors of these heads."""
    return Engine(
        lambda: te().DotProductAttention(
            num_heads,
            head_dim,
            num_gqa_groups=num_groups,
            attention_dropout=dropout,
            qkv_format="bshd",
            attn_mask_type="causal",
        ),
        {},
    )


class TransformerEngineBackend(TorchBackend):
    """Transformer Engine layers with the torch backend's parameters (see the module doc).

    ``te`` provides the ``transformer_engine.pytorch`` namespace (imported on first use);
    ``devices`` are where the TE engines run (CUDA; tests pass a stand-in and ``cpu``).
    Under tensor parallelism the model is built with
    :class:`~training.parallel.te_tensor_parallel.TETensorParallelBackend` instead.
    """

    name = "te"

    def __init__(
        self, te: TEProvider = import_transformer_engine, devices: tuple[str, ...] = ("cuda",)
    ):
        self.te, self.devices = te, devices

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
        norm_module = layers.make_norm(in_features, norm)
        if norm.kind == "layernorm" and not norm.bias:  # TE's LayerNorm always has a bias
            linear = self.row_linear(in_features, out_features, bias=bias, init_std=init_std)
            return layers.NormLinear(norm_module, linear)
        linear = layers.Linear(in_features, out_features, bias=bias, init_std=init_std)
        engine = layer_norm_linear_engine(
            self.te, in_features, out_features, norm, bias=bias, dtype=linear.weight.dtype
        )
        return TENormLinear(norm_module, linear, engine, self.devices)

    def column_linear(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        init_std: float,
        output_chunks: int = 1,
    ) -> nn.Module:
        return self.row_linear(in_features, out_features, bias=bias, init_std=init_std)

    def fused_mlp(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str,
        norm: NormSpec,
        bias: bool,
    ) -> TEFusedMLP | None:
        return fused_mlp_engine(
            self.te,
            hidden_size,
            ffn_hidden_size,
            activation=activation,
            norm=norm,
            bias=bias,
            devices=self.devices,
        )

    def row_linear(
        self, in_features: int, out_features: int, *, bias: bool, init_std: float
    ) -> nn.Module:
        module = TELinear(in_features, out_features, bias=bias, init_std=init_std)
        return module.attach(
            linear_engine(self.te, in_features, out_features, bias=bias), self.devices
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
        if attention_backend != "auto":  # SDPA asked for: inside compiled graphs, no break
            return super().core_attention(num_heads, num_groups, head_dim, dropout=dropout)
        engine = attention_engine(self.te, num_heads, num_groups, head_dim, dropout)
        return TEAttention(
            num_heads, num_groups, head_dim, dropout=dropout, engine=engine, devices=self.devices
        )


__all__ = [
    "TE_PARAMETER_NAMES",
    "Engine",
    "TEAttention",
    "TEFusedMLP",
    "TELinear",
    "TENormLinear",
    "TransformerEngineBackend",
    "attach_engine",
    "attention_engine",
    "engine_device",
    "fusable_mlp",
    "fused_mlp_engine",
    "layer_norm_linear_engine",
    "layer_norm_linear_module",
    "layer_norm_mlp_module",
    "linear_engine",
    "linear_module",
    "te_parameter_names",
]
