"""The Transformer Engine backend (training/models/te_backend.py), in two halves.

Wiring, on any machine (CI has no GPU and cannot install transformer_engine):
``StandInTE`` is a few lines of torch shaped like TE 2.x's API (``LayerNormLinear`` /
``Linear`` / ``DotProductAttention`` constructor arguments, TE's parameter names,
``bshd`` attention), built on the meta device and computing with whatever parameters it
is handed. It computes the torch backend's functions by construction, so it proves our
side only: the model keeps the torch backend's names and init; the engines are built,
fed the model's own ``Parameter`` objects under TE's names and write their gradients
into them; nothing of TE reaches the state dict; weights loaded later reach the engines;
``auto`` picks TE; fp8 refusals and where the fp8 context is entered. It cannot prove
that TE computes the same numbers, that TE accepts these arguments, nor anything about
fp8 or torch.compile with TE: that is the second half.

Real Transformer Engine, marked ``gpu`` (skipped without CUDA and transformer_engine):
forward and backward against the torch backend (fp32 tightly; bf16 against an fp32
reference, as close as the torch backend's own bf16), the Trainer's loss curve against
the torch backend's in bf16, fp8 through TE's recipes (``tensorwise`` =
Float8CurrentScaling, ``delayed`` = DelayedScaling), and fp8 under ``training.compile``.
Run with ``bash benchmarks/gpu_tests.sh`` (``pytest -m gpu``). Last passed: 2026-11-27 on
an NVIDIA H100 80GB (torch 2.11.0+cu130, transformer_engine 2.20.2), with the MLP as one
``te.LayerNormMLP``: 6 passed here, 12 with tests/test_te_tensor_parallel.py; the
measured errors and loss gaps in benchmarks/RESULTS.md ("Tests that need a GPU").
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from parallel_helpers import tiny_settings
from torch import nn

from megalith.config import ModelConfig, load_config
from training.models import (
    GPTModel,
    TorchBackend,
    kernel_backend_name,
    layers,
    model_from_tensors,
    resolve_backend,
    slow_backend_warning,
)
from training.models import backend as backend_module
from training.models.gpt import MLP
from training.models.package import load_model_package, save_model_package
from training.models.t5 import T5Model
from training.models.te_backend import (
    TEFusedMLP,
    TELinear,
    TENormLinear,
    TransformerEngineBackend,
    te_parameter_names,
)
from training.parallel.tensor_parallel.mappings import (
    _GatherReduceScatter,
    _ReduceScatter,
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
)
from training.precision.fp8 import FP8Error, prepare_fp8
from training.precision.mixed import resolve_precision
from training.trainer import Trainer


def stand_in_norm(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """TE's input norm in a stand-in module (``normalization``, ``layer_norm_*``, ``eps``)."""
    if module.normalization == "RMSNorm":
        return F.rms_norm(x, x.shape[-1:], module.layer_norm_weight, module.eps)
    return F.layer_norm(
        x, x.shape[-1:], module.layer_norm_weight, module.layer_norm_bias, module.eps
    )


class _LayerNormLinear(nn.Module):
    def __init__(self, in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm",
                 params_dtype=None, device="cuda"):  # fmt: skip
        super().__init__()
        self.eps, self.normalization = eps, normalization
        self.layer_norm_weight = nn.Parameter(torch.empty(in_features, device=device))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.empty(in_features, device=device))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x):
        return F.linear(stand_in_norm(self, x), self.weight, self.bias)


class _Linear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class _LayerNormMLP(nn.Module):
    """``te.LayerNormMLP``'s contract: global sizes, local weights (fc1's ``[gate; up]`` of
    this rank); with ``set_parallel_mode`` the input copied or all-gathered along the first
    dimension, fc2's output all-reduced or reduce-scattered along it, then fc2's bias."""

    def __init__(self, hidden_size, ffn_hidden_size, eps=1e-5, bias=True, normalization="LayerNorm",
                 activation="gelu", params_dtype=None, device="cuda", set_parallel_mode=False,
                 tp_group=None, tp_size=1, sequence_parallel=False, **userbuffers):  # fmt: skip
        super().__init__()
        self.userbuffers = userbuffers  # TE's ub_* arguments: same math, other schedule
        self.eps, self.normalization, self.activation = eps, normalization, activation
        self.group, self.sp, self.tp = tp_group, sequence_parallel, set_parallel_mode
        chunks = 2 if activation in ("swiglu", "geglu") else 1
        local = ffn_hidden_size // tp_size
        self.layer_norm_weight = nn.Parameter(torch.empty(hidden_size, device=device))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(torch.empty(hidden_size, device=device))
        self.fc1_weight = nn.Parameter(torch.empty(chunks * local, hidden_size, device=device))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, local, device=device))
        self.fc1_bias = self.fc2_bias = None
        if bias:
            self.fc1_bias = nn.Parameter(torch.empty(chunks * local, device=device))
            self.fc2_bias = nn.Parameter(torch.empty(hidden_size, device=device))

    def forward(self, x):
        x2d = stand_in_norm(self, x.reshape(-1, x.size(-1)))
        if self.tp:
            sp = self.sp
            x2d = _GatherReduceScatter.apply(x2d, 0, self.group) if sp else copy_to_tensor_parallel_region(x2d, self.group)  # fmt: skip
        h = F.linear(x2d, self.fc1_weight, self.fc1_bias)
        if self.activation == "gelu":
            h = F.gelu(h, approximate="tanh")
        else:
            gate, up = h.chunk(2, dim=-1)
            h = (F.silu(gate) if self.activation == "swiglu" else F.gelu(gate, approximate="tanh")) * up  # fmt: skip
        y = F.linear(h, self.fc2_weight)
        if self.tp:
            y = _ReduceScatter.apply(y, 0, self.group) if self.sp else reduce_from_tensor_parallel_region(y, self.group)  # fmt: skip
        y = y if self.fc2_bias is None else y + self.fc2_bias
        return y.view(*x.shape[:-1], y.size(-1))


class _DotProductAttention(nn.Module):
    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None,
                 attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal"):  # fmt: skip
        super().__init__()
        assert (qkv_format, attn_mask_type) == ("bshd", "causal")
        self.heads, self.groups = num_attention_heads, num_gqa_groups

    def forward(self, q, k, v, attn_mask_type=None, core_attention_bias_type=None,
                core_attention_bias=None):  # [b, s, h, d] -> [b, s, h*d]  # fmt: skip
        repeats = self.heads // self.groups
        k, v = (t.repeat_interleave(repeats, dim=2).transpose(1, 2) for t in (k, v))
        bias = core_attention_bias
        if core_attention_bias_type is not None:  # TE's post_scale_bias: added to scaled scores
            assert core_attention_bias_type == "post_scale_bias" and bias.is_contiguous()
            assert tuple(bias.shape) == (1, q.size(2), q.size(1), k.size(2)), bias.shape
            assert bias.dtype == q.dtype
        self.calls = getattr(self, "calls", [])
        self.calls.append((attn_mask_type or "causal", core_attention_bias_type))
        causal = attn_mask_type in (None, "causal")
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=bias, is_causal=causal
        )
        return out.transpose(1, 2).flatten(2)


StandInTE = types.SimpleNamespace(
    LayerNormLinear=_LayerNormLinear,
    Linear=_Linear,
    LayerNormMLP=_LayerNormMLP,
    DotProductAttention=_DotProductAttention,
)


def stand_in_backend() -> TransformerEngineBackend:
    # Attention engines run only in bf16/fp16 (TE's flash/cuDNN kernels); linears in any dtype.
    return TransformerEngineBackend(te=lambda: StandInTE, devices=("cpu",))


def config(style: str = "llama", **extra) -> ModelConfig:
    values = dict(
        style=style, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=48, vocab_size=64, max_position_embeddings=16,
    )  # fmt: skip
    return ModelConfig(**{**values, **extra})


def pair(cfg: ModelConfig) -> tuple[GPTModel, GPTModel]:
    torch.manual_seed(0)
    plain = GPTModel(cfg, TorchBackend())
    torch.manual_seed(0)
    te = GPTModel(cfg, stand_in_backend())
    return plain, te


def engines(model: nn.Module) -> list:
    """The TE engines that run ``model``, built or not (``engine.module`` is None until
    the first forward on an engine device): each module's own, but a fused MLP's in place
    of its fc1's and fc2's."""
    found, skipped = [], set()
    for module in model.modules():
        if isinstance(module.__dict__.get("fused"), TEFusedMLP):
            found.append(module.fused.engine)
            skipped |= {id(module.fc1), id(module.fc2)}
    mine = [m for m in model.modules() if "_engine" in m.__dict__ and id(m) not in skipped]
    return found + [m.__dict__["_engine"] for m in mine]


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_stand_in_engines_run_on_our_parameters_and_write_our_gradients(style: str) -> None:
    """Wiring only: the stand-in computes the torch backend's functions, so equal numbers
    here mean the engines were fed our parameters and tensors in TE's layout (``bshd``,
    GQA groups) and their backward reached our ``Parameter`` objects, not that TE's
    kernels compute the same (the gpu tests below do). The residual stream stays fp32: in
    bf16 the stand-in and the torch backend round their sums at different points, which
    is no wiring matter."""
    plain, te = pair(config(style, fp32_residual=True))
    assert list(plain.state_dict()) == list(te.state_dict())  # no TE state leaks in
    for (name, a), (_, b) in zip(plain.named_parameters(), te.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, 64, (2, 12))
    for model in (plain, te):
        model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the attention engine runs in bf16 only
        bf16 = [model(tokens) for model in (plain, te)]
    assert len(engines(te)) == 4 * 2  # qkv, core, proj, the fused MLP in each of the 2 layers
    assert all(engine.module is not None for engine in engines(te))  # and every one ran
    torch.testing.assert_close(bf16[1], bf16[0])
    for (name, a), (_, b) in zip(plain.named_parameters(), te.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name)  # the engines' backward reached ours

    # The engines ran with the model's own Parameter objects under TE's names.
    qkv = te.layers[0].attention.qkv
    assert qkv._engine.module.weight is qkv.linear.weight
    assert qkv._engine.module.layer_norm_weight is qkv.norm.weight
    assert te.layers[0].attention.proj._engine.module.weight is te.layers[0].attention.proj.weight
    mlp = te.layers[0].mlp
    assert mlp.fused.engine.module.fc1_weight is mlp.fc1.linear.weight
    assert mlp.fused.engine.module.fc2_weight is mlp.fc2.weight
    assert mlp.fused.engine.module.layer_norm_weight is mlp.fc1.norm.weight


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_an_sdpa_kernel_asked_for_replaces_te_attention(kernel: str) -> None:
    """``model.attention_backend`` other than ``auto`` under the TE backend: attention runs
    SDPA (compiled graphs keep it, where TE's attention breaks them) while the linears
    and the MLP stay TE's; the model computes what the torch backend's does."""
    plain, te = pair(config("llama", attention_backend=kernel))
    tokens = torch.randint(0, 64, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # where TE's attention engine would run
        outputs = [model(tokens) for model in (plain, te)]
    torch.testing.assert_close(outputs[1], outputs[0])
    cores = [layer.attention.core for layer in te.layers]
    assert all(type(core) is layers.SDPAttention for core in cores), cores
    ran = [engine for engine in engines(te) if engine.module is not None]
    assert len(ran) == 3 * 2  # qkv, proj and the fused MLP of each layer; no attention engine
    assert not any(isinstance(e.module, _DotProductAttention) for e in ran)


def test_name_map_from_the_module_tree() -> None:
    _, te = pair(config("gpt2"))
    names = te_parameter_names(te)
    assert names["layers.0.attention.qkv.norm.weight"] == "layers.0.attention.qkv.layer_norm_weight"
    assert names["layers.1.mlp.fc1.norm.bias"] == "layers.1.mlp.layer_norm_bias"
    assert names["layers.1.mlp.fc1.linear.bias"] == "layers.1.mlp.fc1_bias"
    assert names["layers.1.mlp.fc2.weight"] == "layers.1.mlp.fc2_weight"
    assert names["layers.0.attention.proj.weight"] == "layers.0.attention.proj.weight"
    assert names["final_norm.weight"] == "final_norm.weight"
    te(torch.randint(0, 64, (1, 8)))
    # Every mapped name is where the engine really holds that parameter.
    params = dict(te.named_parameters())
    for ours, theirs in names.items():
        path, _, leaf = theirs.rpartition(".")
        owner = te.get_submodule(path)
        holder = owner
        if "_engine" in owner.__dict__:
            holder = owner._engine.module
        elif isinstance(owner.__dict__.get("fused"), TEFusedMLP):
            holder = owner.fused.engine.module
        assert getattr(holder, leaf) is params[ours], ours


def test_layernorm_without_bias_runs_unfused() -> None:
    """TE's LayerNorm always has a bias: our norm, then a ``te.Linear`` engine."""
    plain, te = pair(config("gpt2", bias=False))
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(te(tokens), plain(tokens))
    qkv = te.layers[0].attention.qkv
    assert not isinstance(qkv, TENormLinear) and isinstance(qkv.linear, TELinear)
    assert qkv.linear._engine.module is not None
    assert te.layers[0].mlp.fused is None and te.layers[0].mlp.fc2._engine.module is not None
    assert list(plain.state_dict()) == list(te.state_dict())


@pytest.mark.parametrize(
    ("extra", "fused"),
    [
        (dict(style="llama"), True),  # SwiGLU, RMSNorm
        (dict(style="gpt2"), True),  # tanh GELU, LayerNorm with bias
        (dict(style="gpt2", gelu_approximation="none"), False),  # TE has no erf GELU
    ],
)
def test_mlp_runs_as_one_layernorm_mlp_where_te_has_its_activation(extra, fused) -> None:
    """The fused MLP computes the MLP's function with its parameters (the stand-in is the
    torch functions, so this is wiring: the activation's name, the norm, the biases and
    the gradients reaching fc1 and fc2); an activation TE lacks runs layer by layer."""
    plain, te = pair(config(**extra))
    tokens = torch.randint(0, 64, (2, 9))
    for model in (plain, te):
        model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    mlp = te.layers[1].mlp
    assert (mlp.fused is not None) == fused
    if fused:
        assert mlp.fused.engine.module is not None and mlp.fc1._engine.module is None
    else:
        assert mlp.fc1._engine.module is not None and mlp.fc2._engine.module is not None
    for (name, a), (_, b) in zip(plain.named_parameters(), te.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def tiny_t5(layers: int) -> ModelConfig:
    """A T5 of ``layers`` encoder and decoder layers, hidden 32, 4 heads, vocabulary 64."""
    return ModelConfig(
        family="t5", num_layers=layers, num_decoder_layers=layers, hidden_size=32,
        num_attention_heads=4, vocab_size=64, max_position_embeddings=32,
    )  # fmt: skip


def test_t5_gated_gelu_mlp_runs_fused() -> None:
    """T5's gated GELU (tanh) is TE's ``geglu``; RMSNorm without biases."""
    cfg = tiny_t5(1)
    torch.manual_seed(0)
    plain = MLP(cfg, TorchBackend())
    torch.manual_seed(0)
    te = MLP(cfg, stand_in_backend())
    assert te.fused is not None
    x = torch.randn(2, 5, 32)
    outputs = [mlp(x) for mlp in (plain, te)]
    torch.testing.assert_close(outputs[1], outputs[0])
    for out in outputs:
        out.square().sum().backward()
    assert te.fused.engine.module.activation == "geglu"
    for (name, a), (_, b) in zip(plain.named_parameters(), te.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def t5_pair() -> tuple[T5Model, T5Model]:
    cfg = tiny_t5(2)
    torch.manual_seed(0)
    plain = T5Model(cfg, TorchBackend())
    torch.manual_seed(0)
    return plain, T5Model(cfg, stand_in_backend())


def test_t5_relative_bias_runs_through_te_attention_with_its_gradient() -> None:
    """T5's attentions under the TE backend (the stand-in, bf16 on CPU): the encoder's and
    the decoder's self-attentions give TE their relative bias (one for the whole batch,
    the decoder's causality folded in) as ``post_scale_bias``, cross-attention runs TE's
    unmasked (its all-zero mask changes nothing), so every attention is TE's; the loss
    and every gradient, the bias tables' included, are the torch backend's. With padding
    (per-sample masks) the encoder's and cross attentions fall back to SDPA and match."""
    plain, te = t5_pair()
    generator = torch.Generator().manual_seed(1)
    encoder = torch.randint(0, 64, (3, 12), generator=generator)
    decoder = torch.randint(0, 64, (3, 7), generator=generator)
    labels = torch.randint(0, 64, (3, 7), generator=generator)
    for padded in (None, torch.arange(12)[None, :] < torch.tensor([[12], [9], [5]])):
        losses = []
        for model in (plain, te):
            model.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(encoder, decoder, labels, encoder_mask=padded)
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0])
        for (name, a), (_, b) in zip(plain.named_parameters(), te.named_parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, msg=name, rtol=2e-2, atol=2e-3)
        assert te.encoder.relative_bias.weight.grad.abs().sum() > 0
        cores = [layer.attention.core for layer in (*te.encoder.layers, *te.decoder.layers)]
        cores += [layer.cross_attention.core for layer in te.decoder.layers]
        calls = [core._engine.module.calls for core in cores]
        biased, unmasked = ("no_mask", "post_scale_bias"), ("no_mask", None)
        if padded is None:  # 2 encoder, 2 decoder self-attentions biased; 2 cross unmasked
            assert calls == [[biased]] * 4 + [[unmasked]] * 2, calls
        else:  # per-sample masks (the encoder's, the cross-attention's) went to SDPA
            assert calls == [[biased]] * 2 + [[biased, biased]] * 2 + [[unmasked]] * 2, calls


def test_weights_loaded_later_reach_the_engines(tmp_path) -> None:
    """Engines are fed the current parameters on every call: a load after the first
    forward, or a model rebuilt from tensors (to_empty), computes with the new weights."""
    plain, te = pair(config())
    tokens = torch.randint(0, 64, (1, 8))
    te(tokens)
    torch.manual_seed(1)
    other = GPTModel(config(), TorchBackend())
    te.load_state_dict(other.state_dict())
    torch.testing.assert_close(te(tokens), other(tokens))

    rebuilt = model_from_tensors(config(), dict(other.named_parameters()), {})
    torch.testing.assert_close(rebuilt(tokens), other(tokens))

    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"not read by this test")
    save_model_package(te, config(), tokenizer, tmp_path / "package")
    loaded, _, _ = load_model_package(tmp_path / "package")
    torch.testing.assert_close(loaded(tokens), other(tokens))


@pytest.mark.parametrize(
    "settings, picked",
    [
        ([], "torch"),  # bf16: the torch backend compiled is as fast
        (["mixed_precision.fp8=true"], "torch"),  # tensorwise below hidden 2048
        (["mixed_precision.fp8=true", "model.hidden_size=2048"], "te"),
        (["mixed_precision.fp8=true", "mixed_precision.fp8_recipe=delayed"], "te"),  # TE's alone
        (["mixed_precision.fp8=true", "model.hidden_size=2048", "model.activation_checkpointing=full"], "torch"),
        (["mixed_precision.fp8=true", "mixed_precision.fp8_recipe=rowwise", "model.hidden_size=2048"], "torch"),
        (["model.backend=te"], "te"),
        (["model.backend=torch", "mixed_precision.fp8=true", "model.hidden_size=2048"], "torch"),
    ],
)  # fmt: skip
def test_auto_picks_te_only_where_it_measured_faster(monkeypatch, settings, picked) -> None:
    monkeypatch.setattr(backend_module, "transformer_engine_available", lambda: True)
    monkeypatch.setattr(backend_module, "torchao_available", lambda: True)
    run = load_config(None, settings)
    assert kernel_backend_name(run.model, run.mixed_precision) == picked


def test_auto_takes_te_for_fp8_where_torchao_is_missing(monkeypatch) -> None:
    monkeypatch.setattr(backend_module, "transformer_engine_available", lambda: True)
    monkeypatch.setattr(backend_module, "torchao_available", lambda: False)
    run = load_config(None, ["mixed_precision.fp8=true"])  # tensorwise, hidden below 2048
    assert kernel_backend_name(run.model, run.mixed_precision) == "te"
    run = load_config(None, ["mixed_precision.fp8=true", "mixed_precision.fp8_recipe=rowwise"])
    assert kernel_backend_name(run.model, run.mixed_precision) == "torch"  # torchao's alone


def test_auto_without_transformer_engine_is_torch(monkeypatch) -> None:
    monkeypatch.setattr(backend_module, "transformer_engine_available", lambda: False)
    run = load_config(None, ["mixed_precision.fp8=true", "mixed_precision.fp8_recipe=delayed"])
    assert kernel_backend_name(run.model, run.mixed_precision) == "torch"
    assert isinstance(resolve_backend("auto"), TorchBackend)
    monkeypatch.setattr(backend_module, "transformer_engine_available", lambda: True)
    assert isinstance(resolve_backend("auto"), TorchBackend)  # a model built outside a run
    assert isinstance(resolve_backend("te"), TransformerEngineBackend)


def test_te_asked_for_where_it_measured_slower_is_warned_about() -> None:
    narrow = load_config(None, ["model.backend=te", "model.hidden_size=768"])
    warning = slow_backend_warning(narrow.model, narrow.mixed_precision)
    assert warning and "model.hidden_size 768" in warning and "model.backend=auto" in warning
    for settings in (
        ["model.hidden_size=768"],  # auto
        ["model.backend=te", "model.hidden_size=768", "mixed_precision.fp8=true"],
        ["model.backend=te", "model.hidden_size=2048"],
    ):
        run = load_config(None, settings)
        assert slow_backend_warning(run.model, run.mixed_precision) is None, settings


def test_fp8_on_te_refuses_what_it_cannot_do() -> None:
    precision = load_config(None, ["mixed_precision.fp8=true"]).mixed_precision
    resolved = resolve_precision(precision, torch.device("cpu"))
    _, te = pair(config(activation_checkpointing="full"))
    with pytest.raises(FP8Error, match="activation_checkpointing"):
        prepare_fp8(te, precision, resolved)
    _, te = pair(config())
    rowwise = precision.model_copy(update={"fp8_recipe": "rowwise"})
    with pytest.raises(FP8Error, match="rowwise is torchao's"):
        prepare_fp8(te, rowwise, resolved)


def test_precision_enters_the_fp8_context_inside_autocast_around_each_forward() -> None:
    """Where TE's fp8_autocast goes: Precision.autocast (trainer, pipeline stages, eval)."""
    import contextlib

    entered = []

    @contextlib.contextmanager
    def fp8_context():
        entered.append(torch.is_autocast_enabled("cpu"))
        yield
        entered.append("exit")

    precision = resolve_precision(load_config(None, ["mixed_precision.fp8=true"]).mixed_precision,
                                  torch.device("cpu"))  # fmt: skip
    precision.fp8_context = fp8_context
    context = precision.autocast()
    assert entered == []  # nothing entered before the with
    with context:
        assert torch.is_autocast_enabled("cpu")
    assert entered == [True, "exit"] and not torch.is_autocast_enabled("cpu")


# --- The real Transformer Engine (gpu) -------------------------------------------------

needs_te = pytest.mark.skipif(
    not torch.cuda.is_available() or not backend_module.transformer_engine_available(),
    reason="needs transformer_engine and a CUDA GPU",
)
TRAIN_STEPS = 20
BF16_LOSS_TOLERANCE = 0.02  # |TE bf16 loss - torch bf16 loss| at every step (H100: max 0.003)
# benchmarks/fp8_convergence.py's verdict: mean and max |fp8 loss - bf16 loss|
FP8_MEAN_TOLERANCE, FP8_MAX_TOLERANCE = 0.05, 0.15


def real_te():
    import transformer_engine.pytorch as te

    return te


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference.float()).norm() / reference.float().norm()).item()


def logits_and_gradients(
    model: GPTModel, tokens: torch.Tensor, bf16: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        logits = model(tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def assert_real_engines_ran(model: nn.Module, attention: bool = True) -> None:
    """Every engine of ``model`` was built, and is TE's own module, not a stand-in."""
    te = real_te()
    built = [engine.module for engine in engines(model)]
    gemms = (te.LayerNormLinear, te.Linear, te.LayerNormMLP)
    kinds = gemms + ((te.DotProductAttention,) if attention else ())
    assert built and all(isinstance(module, kinds) for module in built if module is not None)
    linears = [m for m in built if isinstance(m, gemms)]
    assert len(linears) == 3 * model.config.num_layers  # qkv, proj, the MLP
    if attention:
        assert sum(isinstance(m, te.DotProductAttention) for m in built) == model.config.num_layers


def t5_mlp_config() -> ModelConfig:
    return ModelConfig(
        family="t5", num_layers=1, num_decoder_layers=1, hidden_size=128, num_attention_heads=4,
        ffn_hidden_size=256, vocab_size=256, max_position_embeddings=64,
    )  # fmt: skip


@needs_te
@pytest.mark.gpu
def test_real_te_gated_gelu_mlp_matches_the_torch_mlp() -> None:
    """T5's MLP (RMSNorm, no biases, tanh-GELU gate) as TE's ``LayerNormMLP(geglu)``: its
    output and every gradient against the torch backend's MLP with the same weights, fp32
    within 1e-3 and bf16 as close to the fp32 reference as the torch MLP's own bf16."""
    cfg = t5_mlp_config()
    torch.manual_seed(0)
    plain = MLP(cfg, TorchBackend()).cuda()
    torch.manual_seed(0)
    te = MLP(cfg, TransformerEngineBackend()).cuda()
    x = torch.randn(4, 64, 128, device="cuda")

    def run(mlp: nn.Module, bf16: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mlp.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            out = mlp(x)
        out.float().square().mean().backward()
        return out.detach(), {n: p.grad.detach().clone() for n, p in mlp.named_parameters()}

    exact, exact_grads = run(plain, bf16=False)
    out, grads = run(te, bf16=False)
    assert isinstance(te.fused.engine.module, real_te().LayerNormMLP)
    report = {"fp32 out": relative_error(out, exact)}
    report |= {f"fp32 {n}": relative_error(g, exact_grads[n]) for n, g in grads.items()}
    assert max(report.values()) < 1e-3, report
    torch_out, torch_grads = run(plain, bf16=True)
    out, grads = run(te, bf16=True)
    pairs = {"out": (out, torch_out, exact)}
    pairs |= {n: (g, torch_grads[n], exact_grads[n]) for n, g in grads.items()}
    for name, (ours, theirs, reference) in pairs.items():
        te_error, torch_error = relative_error(ours, reference), relative_error(theirs, reference)
        assert te_error <= 3 * torch_error + 5e-3, (name, te_error, torch_error)
    print(f"t5 geglu: worst fp32 {max(report.values()):.2e}")


def _assert_biased_attention_is_fused(core: nn.Module) -> None:
    """One biased call of ``core`` (a ``TEAttention``): TE chose its cuDNN (fused) kernels,
    not its unfused fallback, and returned the bias's gradient."""
    from transformer_engine.pytorch.attention.dot_product_attention import (
        dot_product_attention as selection,
    )

    heads, length = core.num_heads, 128
    q = torch.randn(2, length, heads, core.head_dim, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1, heads, length, length, device="cuda", requires_grad=True)
    core(q.requires_grad_(), q, q, bias).float().square().mean().backward()
    chosen = selection._attention_backends
    assert chosen["use_fused_attention"] and not chosen["use_unfused_attention"], chosen
    assert bias.grad is not None and bias.grad.abs().sum() > 0


@needs_te
@pytest.mark.gpu
def test_real_te_t5_biased_attention_matches_the_torch_backend() -> None:
    """A T5 (relative position biases, span-corruption shapes: 128 encoder and 29 decoder
    tokens) under TE in bf16: its attentions run TE's ``post_scale_bias`` (cuDNN's kernels
    also return the bias's gradient); the loss and every gradient, the bias tables'
    included, as close to the fp32 torch model as the torch backend's own bf16."""
    cfg = ModelConfig(
        family="t5", num_layers=2, num_decoder_layers=2, hidden_size=256, num_attention_heads=4,
        ffn_hidden_size=512, vocab_size=512, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = T5Model(cfg, TorchBackend()).cuda()
    torch.manual_seed(0)
    te = T5Model(cfg, TransformerEngineBackend()).cuda()
    generator = torch.Generator().manual_seed(1)
    encoder = torch.randint(0, 512, (8, 128), generator=generator).cuda()
    decoder = torch.randint(0, 512, (8, 29), generator=generator).cuda()
    labels = torch.randint(0, 512, (8, 29), generator=generator).cuda()

    def run(model: nn.Module, bf16: bool) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(encoder, decoder, labels)
        loss.backward()
        return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    exact, exact_grads = run(plain, bf16=False)
    torch_loss, torch_grads = run(plain, bf16=True)
    te_loss, te_grads = run(te, bf16=True)
    attention = te.encoder.layers[0].attention.core._engine.module
    assert isinstance(attention, real_te().DotProductAttention)
    _assert_biased_attention_is_fused(te.encoder.layers[0].attention.core)
    worst = {}
    for name, grad in te_grads.items():
        te_error = relative_error(grad, exact_grads[name])
        torch_error = relative_error(torch_grads[name], exact_grads[name])
        worst[name] = (round(te_error, 5), round(torch_error, 5))
        assert te_error <= 3 * torch_error + 5e-3, (name, te_error, torch_error)
    assert abs(te_loss - exact) <= 3 * abs(torch_loss - exact) + 5e-3 * exact
    print(f"t5 biased attention: loss fp32 {exact:.5f} torch bf16 {torch_loss:.5f} te {te_loss:.5f}; "
          f"relative bias grads (te, torch): {worst['encoder.relative_bias.weight']}, "
          f"{worst['decoder.relative_bias.weight']}")  # fmt: skip


@needs_te
@pytest.mark.gpu
@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_real_te_forward_and_backward_match_the_torch_backend(style: str) -> None:
    """Same weights, same tokens: TE's logits and every parameter's gradient against the
    torch backend's. fp32 (TE's linears; attention is SDPA in fp32) within 1e-3; in bf16
    autocast (TE attention too) TE is as close to the fp32 reference as the torch
    backend's own bf16 is (3x its error, plus 5e-3)."""
    cfg = config(
        style, hidden_size=128, ffn_hidden_size=256, vocab_size=256, max_position_embeddings=64
    )  # fmt: skip  (head_dim 32; GEMM dims % 16)
    torch.manual_seed(0)
    plain = GPTModel(cfg, TorchBackend()).cuda()
    torch.manual_seed(0)
    te = GPTModel(cfg, TransformerEngineBackend()).cuda()
    tokens = torch.randint(0, 256, (4, 65), device="cuda")

    reference, reference_grads = logits_and_gradients(plain, tokens, bf16=False)
    logits, grads = logits_and_gradients(te, tokens, bf16=False)
    assert_real_engines_ran(te, attention=False)  # fp32 attention is SDPA
    report = {"fp32 logits": relative_error(logits, reference)}
    report |= {f"fp32 {n}": relative_error(g, reference_grads[n]) for n, g in grads.items()}
    assert max(report.values()) < 1e-3, report

    torch_bf16, torch_grads = logits_and_gradients(plain, tokens, bf16=True)
    logits, grads = logits_and_gradients(te, tokens, bf16=True)
    assert_real_engines_ran(te)
    pairs = {"logits": (logits, torch_bf16, reference)}
    pairs |= {n: (g, torch_grads[n], reference_grads[n]) for n, g in grads.items()}
    for name, (ours, theirs, exact) in pairs.items():
        te_error, torch_error = relative_error(ours, exact), relative_error(theirs, exact)
        report[f"bf16 {name}"] = te_error
        assert te_error <= 3 * torch_error + 5e-3, (name, te_error, torch_error)
    print(f"{style}: worst fp32 {max(v for k, v in report.items() if k.startswith('fp32')):.2e}, "
          f"worst bf16 {max(v for k, v in report.items() if k.startswith('bf16')):.2e}")  # fmt: skip


@pytest.fixture(scope="module")
def trainer_runs(shards: Path, tmp_path_factory: pytest.TempPathFactory):
    """``run(name, settings)`` -> (Trainer, losses) of TRAIN_STEPS steps on the GPU, each
    run once per module (several tests compare with the same bf16 curves)."""
    cache: dict[str, tuple[Trainer, list[float]]] = {}

    def run(name: str, values: dict[str, str]) -> tuple[Trainer, list[float]]:
        if name not in cache:
            settings = tiny_settings(shards, {
                "training.device": "cuda", "mixed_precision.dtype": "bf16",
                "training.train_iters": TRAIN_STEPS, "training.eval_interval": 0,
                "model.hidden_size": 128, "model.num_attention_heads": 4,
                "model.ffn_hidden_size": 256, "optimizer.lr": 3e-3, **values,
            })  # fmt: skip
            config = load_config(None, [f"{key}={value}" for key, value in settings.items()])
            trainer = Trainer(config, tmp_path_factory.mktemp(name))
            losses = [record["loss"] for record in trainer.fit(show_progress=False).metrics]
            assert len(losses) == TRAIN_STEPS
            print(f"{name}: {' '.join(f'{loss:.4f}' for loss in losses)}")
            cache[name] = trainer, losses
        return cache[name]

    return run


def deltas(losses: list[float], reference: list[float]) -> list[float]:
    return [abs(a - b) for a, b in zip(losses, reference, strict=True)]


@needs_te
@pytest.mark.gpu
def test_real_te_trains_like_the_torch_backend(trainer_runs) -> None:
    """The Trainer with ``model.backend=te`` (bf16): the loss curve of the torch backend,
    step by step, from the same init and batches, and it learns."""
    _, plain = trainer_runs("torch-bf16", {"model.backend": "torch"})
    trainer, te = trainer_runs("te-bf16", {"model.backend": "te"})
    assert trainer.model.backend.name == "te"
    assert_real_engines_ran(trainer.model)
    assert max(deltas(te, plain)) <= BF16_LOSS_TOLERANCE, deltas(te, plain)
    assert te[-1] < te[0] - 0.5  # measured on CPU (torch, bf16): 6.96 -> 5.60


@needs_te
@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_real_te_fp8_tracks_te_bf16(trainer_runs, recipe: str) -> None:
    """fp8 through TE's recipes (``tensorwise`` = Float8CurrentScaling, ``delayed`` =
    DelayedScaling): every TE linear ran in fp8 and the loss tracks TE's bf16 curve."""
    _, bf16 = trainer_runs("te-bf16", {"model.backend": "te"})
    trainer, fp8 = trainer_runs(f"te-fp8-{recipe}", {
        "model.backend": "te", "mixed_precision.fp8": "true", "mixed_precision.fp8_recipe": recipe,
    })  # fmt: skip
    assert_fp8_ran(trainer.model, fp8, bf16)


def assert_fp8_ran(model: nn.Module, fp8: list[float], bf16: list[float]) -> None:
    te = real_te()
    assert_real_engines_ran(model)
    linears = [
        e.module for e in engines(model) if isinstance(e.module, (te.LayerNormLinear, te.Linear))
    ]
    # TE sets ``fp8`` on a module at each forward from the fp8_autocast around it.
    assert all(module.fp8 for module in linears)
    assert fp8 != bf16
    gaps = deltas(fp8, bf16)
    assert sum(gaps) / len(gaps) <= FP8_MEAN_TOLERANCE and max(gaps) <= FP8_MAX_TOLERANCE, gaps


@needs_te
@pytest.mark.gpu
def test_real_te_fp8_under_torch_compile_tracks_te_bf16(trainer_runs) -> None:
    """``training.compile=true`` with TE in fp8 (dynamo breaks the graph around each TE
    call): it trains, in fp8, along TE's eager bf16 curve."""
    _, bf16 = trainer_runs("te-bf16", {"model.backend": "te"})
    trainer, fp8 = trainer_runs("te-fp8-compiled", {
        "model.backend": "te", "mixed_precision.fp8": "true", "training.compile": "true",
    })  # fmt: skip
    assert trainer.forward_model is not trainer.dp_model  # the compiled wrapper ran the steps
    assert_fp8_ran(trainer.model, fp8, bf16)
