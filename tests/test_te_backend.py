"""The Transformer Engine backend (training/models/te_backend.py).

transformer_engine is not installable on the CPU machines that run CI, so most tests
drive the backend with ``StandInTE``: a few lines of torch shaped like TE 2.x's API
(``LayerNormLinear``/``Linear``/``DotProductAttention`` constructor arguments, TE's
parameter names, ``bshd`` attention), whose modules are built on the meta device and
compute with whatever parameters they are handed. That checks our side: that the model
keeps the torch backend's names, init and numbers, that the engines are fed (and
write gradients into) the model's own parameters under TE's names, and that nothing
of them reaches the state dict. The last tests run the real TE and skip without it.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from training.config import ModelConfig, load_config
from training.fp8 import FP8Error, prepare_fp8
from training.models import GPTModel, TorchBackend, resolve_backend
from training.models import backend as backend_module
from training.models.gpt import model_from_tensors
from training.models.package import load_model_package, save_model_package
from training.models.te_backend import TransformerEngineBackend, te_parameter_names
from training.precision import resolve_precision


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
        if self.normalization == "RMSNorm":
            x = F.rms_norm(x, x.shape[-1:], self.layer_norm_weight, self.eps)
        else:
            x = F.layer_norm(
                x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps
            )
        return F.linear(x, self.weight, self.bias)


class _Linear(nn.Module):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class _DotProductAttention(nn.Module):
    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None,
                 attention_dropout=0.0, qkv_format="sbhd", attn_mask_type="causal"):  # fmt: skip
        super().__init__()
        assert (qkv_format, attn_mask_type) == ("bshd", "causal")
        self.heads, self.groups = num_attention_heads, num_gqa_groups

    def forward(self, q, k, v):  # [b, s, h, d] -> [b, s, h*d]
        repeats = self.heads // self.groups
        k, v = (t.repeat_interleave(repeats, dim=2).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True)
        return out.transpose(1, 2).flatten(2)


StandInTE = types.SimpleNamespace(
    LayerNormLinear=_LayerNormLinear, Linear=_Linear, DotProductAttention=_DotProductAttention
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


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_same_names_init_numbers_and_gradients_as_the_torch_backend(style: str) -> None:
    plain, te = pair(config(style))
    assert list(plain.state_dict()) == list(te.state_dict())  # no TE state leaks in
    for (name, a), (_, b) in zip(plain.named_parameters(), te.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, 64, (2, 12))
    for model in (plain, te):
        model(tokens[:, :-1], labels=tokens[:, 1:]).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the attention engine runs in bf16
        bf16 = [model(tokens) for model in (plain, te)]
    torch.testing.assert_close(bf16[1], bf16[0])
    for (name, a), (_, b) in zip(plain.named_parameters(), te.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, msg=name)  # TE's backward reached ours

    # The engines ran with the model's own Parameter objects under TE's names.
    qkv = te.layers[0].attention.qkv
    assert qkv._engine.module.weight is qkv.linear.weight
    assert qkv._engine.module.layer_norm_weight is qkv.norm.weight
    assert te.layers[0].attention.proj._engine.module.weight is te.layers[0].attention.proj.weight


def test_name_map_from_the_module_tree() -> None:
    _, te = pair(config("gpt2"))
    names = te_parameter_names(te)
    assert names["layers.0.attention.qkv.norm.weight"] == "layers.0.attention.qkv.layer_norm_weight"
    assert names["layers.1.mlp.fc1.norm.bias"] == "layers.1.mlp.fc1.layer_norm_bias"
    assert names["layers.1.mlp.fc1.linear.bias"] == "layers.1.mlp.fc1.bias"
    assert names["layers.0.attention.proj.weight"] == "layers.0.attention.proj.weight"
    assert names["final_norm.weight"] == "final_norm.weight"
    te(torch.randint(0, 64, (1, 8)))
    # Every mapped name is where the engine really holds that parameter.
    params = dict(te.named_parameters())
    for ours, theirs in names.items():
        path, _, leaf = theirs.rpartition(".")
        owner = te.get_submodule(path)
        holder = owner._engine.module if "_engine" in owner.__dict__ else owner
        assert getattr(holder, leaf) is params[ours], ours


def test_layernorm_without_bias_runs_unfused() -> None:
    plain, te = pair(config("gpt2", bias=False))
    tokens = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(te(tokens), plain(tokens))
    assert list(plain.state_dict()) == list(te.state_dict())


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


def test_auto_picks_te_when_it_imports(monkeypatch) -> None:
    monkeypatch.setattr(backend_module, "BACKENDS", {"torch": TorchBackend})
    monkeypatch.setattr(backend_module, "transformer_engine_available", lambda: True)
    assert isinstance(resolve_backend("auto"), TransformerEngineBackend)
    assert isinstance(resolve_backend("te"), TransformerEngineBackend)
    monkeypatch.setattr(backend_module, "BACKENDS", {"torch": TorchBackend})
    monkeypatch.setattr(backend_module, "transformer_engine_available", lambda: False)
    assert isinstance(resolve_backend("auto"), TorchBackend)


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


needs_te = pytest.mark.skipif(
    not backend_module.transformer_engine_available() or not torch.cuda.is_available(),
    reason="needs transformer_engine and a CUDA GPU",
)


@needs_te
@pytest.mark.gpu
def test_real_transformer_engine_matches_the_torch_backend_and_runs_fp8() -> None:
    cfg = config(hidden_size=64, ffn_hidden_size=128)  # head_dim 16; fp8 GEMM dims % 16
    torch.manual_seed(0)
    plain = GPTModel(cfg, TorchBackend()).cuda()
    torch.manual_seed(0)
    te = GPTModel(cfg, TransformerEngineBackend()).cuda()
    tokens = torch.randint(0, 64, (2, 17), device="cuda")  # 2 x 16 inputs: fp8 GEMM dims % 16
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.testing.assert_close(te(tokens), plain(tokens), atol=2e-2, rtol=2e-2)
    precision_config = load_config(None, ["mixed_precision.fp8=true"]).mixed_precision
    precision = resolve_precision(precision_config, torch.device("cuda"))
    assert prepare_fp8(te, precision_config, precision) == ["te:tensorwise"]
    with precision.autocast():
        loss = te(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in te.parameters())
