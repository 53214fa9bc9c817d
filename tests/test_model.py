"""The GPT model, its backend, FLOP counts, parameter groups and model packages."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from saved_tensors_probe import saved_for_backward, total_bytes

from megalith.config import ConfigError, ModelConfig, load_config
from training.models import (
    BackendError,
    GPTModel,
    TorchBackend,
    build_model,
    layers,
    resolve_backend,
)
from training.models import backend as backend_module
from training.models.flops import flops_per_token, matmul_params, param_groups, total_params
from training.models.package import (
    PackageChecksumError,
    PackageConfigError,
    PackageFileError,
    PackageTensorError,
    load_model_package,
    save_model_package,
    sha256_file,
)

REPO = Path(__file__).resolve().parents[1]
VOCAB = 96
SEQ = 16


def tiny(style: str = "llama", **overrides) -> ModelConfig:
    values = {
        "style": style,
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_query_groups": 2 if style == "llama" else None,
        "vocab_size": VOCAB,
        "max_position_embeddings": 32,
    }
    return ModelConfig(**{**values, **overrides})


def build(config: ModelConfig, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config)


def tokens(batch: int = 2, length: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


STYLES = ["llama", "gpt2"]


@pytest.mark.parametrize("style", STYLES)
def test_shapes_and_dtypes(style):
    model = build(tiny(style))
    x = tokens()
    logits = model(x)
    assert logits.shape == (2, SEQ, VOCAB) and logits.dtype == torch.float32
    loss = model(x, x)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert model(x, x, loss_reduction="none").shape == (2, SEQ)


@pytest.mark.parametrize("style", STYLES)
def test_style_fills_architecture(style):
    names = dict(build(tiny(style)).named_parameters())
    if style == "llama":
        assert "embedding.position.weight" not in names
        assert not any(n.endswith(".bias") for n in names)
        assert names["layers.0.mlp.fc1.linear.weight"].shape == (2 * 128, 32)  # [gate; up]
        assert "output.weight" in names  # untied
    else:
        assert names["embedding.position.weight"].shape == (32, 32)
        assert "layers.0.attention.qkv.linear.bias" in names
        assert "layers.0.attention.qkv.norm.bias" in names
        assert "output.weight" not in names  # tied: listed once, as the embedding


@pytest.mark.parametrize("style", STYLES)
def test_causal(style):
    model = build(tiny(style)).eval()
    x = tokens()
    changed = x.clone()
    changed[:, 10] = (changed[:, 10] + 1) % VOCAB
    a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("style", STYLES)
def test_loss_matches_cross_entropy(style):
    model = build(tiny(style))
    x = tokens()
    labels = tokens(seed=2)
    labels[0, :5] = -100
    logits = model(x)
    expected = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)
    torch.testing.assert_close(model(x, labels), expected)
    per_token = model(x, labels, loss_reduction="none")
    assert torch.all(per_token[0, :5] == 0)
    torch.testing.assert_close(per_token.sum() / (labels != -100).sum(), expected)


def _mha_qkv_from_gqa(weight: torch.Tensor, heads: int, groups: int, dim: int) -> torch.Tensor:
    """Grouped [q.. k v] per KV group -> one group per head, KV repeated."""
    per_group = heads // groups
    grouped = weight.view(groups, per_group + 2, dim, -1)
    rows = []
    for h in range(heads):
        g = h // per_group
        rows += [grouped[g, h % per_group], grouped[g, per_group], grouped[g, per_group + 1]]
    return torch.cat(rows)


@pytest.mark.parametrize("first", ["cudnn", "flash", "efficient", "math"])
def test_attention_backend_order_gives_the_same_model(first):
    """Each SDPA kernel order computes the same logits and gradients; here (CPU) the
    kernels that cannot run fall through to one that can. On a GPU the choice is measured
    in benchmarks/train_throughput.py."""
    from training.models.layers import attention_kernels

    assert attention_kernels("auto") is None
    model, x = build(tiny("llama")), tokens()
    reference = model(x, labels=x)
    reference.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with attention_kernels(first)():
        loss = model(x, labels=x)
    loss.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    for got, expected in zip([p.grad for p in model.parameters()], want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_gqa_equals_mha_with_repeated_kv():
    gqa = build(tiny("llama", num_query_groups=2)).eval()
    mha = build(tiny("llama", num_query_groups=4)).eval()
    state = gqa.state_dict()
    for i in range(2):
        key = f"layers.{i}.attention.qkv.linear.weight"
        state[key] = _mha_qkv_from_gqa(state[key], heads=4, groups=2, dim=8)
    mha.load_state_dict(state)
    x = tokens()
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style,groups", [("llama", 2), ("llama", 1), ("gpt2", None)])
def test_kv_cache_decoding_matches_full_forward(style, groups):
    model = build(tiny(style, num_query_groups=groups)).eval()
    x = tokens(length=20)
    full = model(x)
    with torch.no_grad():
        cache = model.new_kv_cache(batch_size=2, max_length=24)
        steps = [model(x[:, :6], kv_cache=cache)]  # prefill
        steps += [model(x[:, i : i + 1], kv_cache=cache, start_pos=i) for i in range(6, 12)]
        steps.append(model(x[:, 12:], kv_cache=cache, start_pos=12))  # a chunk after a prefix
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_kv_cache_and_position_bounds():
    model = build(tiny())
    cache = model.new_kv_cache(batch_size=2, max_length=8)
    with pytest.raises(ValueError, match="KV cache"):
        model(tokens(length=4), kv_cache=cache, start_pos=6)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(tokens(length=33))
    with pytest.raises(ValueError, match="kv_cache"):
        model(tokens(length=4), start_pos=2)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.new_kv_cache(batch_size=1, max_length=64)


def test_tied_embeddings_share_storage():
    tied = build(tiny("llama", tie_embeddings=True))
    assert tied.output.weight is tied.embedding.word.weight
    assert tied.output.weight.data_ptr() == tied.embedding.word.weight.data_ptr()
    assert tied.tied_weights == {"output.weight": "embedding.word.weight"}
    tied(tokens(), tokens(seed=3)).backward()
    assert tied.embedding.word.weight.grad is not None
    untied = build(tiny("llama", tie_embeddings=False))
    assert untied.output.weight.data_ptr() != untied.embedding.word.weight.data_ptr()
    assert untied.tied_weights == {}


@pytest.mark.parametrize("style", STYLES)
def test_initialisation(style):
    config = tiny(style, num_layers=8, hidden_size=256, num_query_groups=None, init_std=0.02)
    model = build(config)
    scaled = 0.02 / math.sqrt(2 * 8)
    for name, param in model.named_parameters():
        if name.endswith(("attention.proj.weight", "mlp.fc2.weight")):
            assert param.std().item() == pytest.approx(scaled, rel=0.05), name
        elif name.endswith("norm.weight"):
            assert torch.all(param == 1), name
        elif name.endswith(".bias"):
            assert torch.all(param == 0), name
        else:  # qkv, fc1, embeddings, output head
            assert param.std().item() == pytest.approx(0.02, rel=0.05), name
            assert abs(param.mean().item()) < 2e-3, name


def test_meta_device_build_then_init():
    with torch.device("meta"):
        model = GPTModel(tiny("gpt2", hidden_size=256))
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights()
    assert model.output.weight is model.embedding.word.weight
    assert model.embedding.word.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch.all(model.final_norm.weight == 1) and torch.all(model.final_norm.bias == 0)
    assert torch.isfinite(model(tokens())).all()


def test_gpt2_124m_counts():
    config = load_config(REPO / "configs/gpt2-124m.yaml").model
    exact = config.model_copy(update={"vocab_size": 50257})
    with torch.device("meta"):
        model = GPTModel(exact)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808  # GPT-2 small
    assert total_params(exact) == 124_439_808
    assert matmul_params(config) == 84_934_656  # 12 · 12 · 768²
    assert flops_per_token(config, 1024) == 6 * 84_934_656 + 12 * 12 * 768 * 1024
    head = 50304 * 768
    assert flops_per_token(config, 1024, include_output_head=True) == (
        6 * (84_934_656 + head) + 12 * 12 * 768 * 1024
    )


def test_llama_1b_counts():
    config = load_config(REPO / "configs/llama-1b.yaml").model
    with torch.device("meta"):
        model = GPTModel(config)
    per_layer = 2048 * 3072 + 2048 * 2048 + 3 * 2048 * 8192
    assert matmul_params(config) == 16 * per_layer == 973_078_528
    assert sum(p.numel() for p in model.parameters()) == total_params(config)
    assert total_params(config) == 16 * (per_layer + 2 * 2048) + 2048 + 2 * 32000 * 2048


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_is_exact(style, mode):
    """Same loss and gradients as no checkpointing (dropout masks replayed), while the
    blocks' activations are really not kept: autograd saves under a third of the bytes
    (measured: ~1/7; a model ignoring the setting saves all of them)."""

    def loss_and_grads(checkpointing):
        model = build(tiny(style, dropout=0.1, activation_checkpointing=checkpointing))
        torch.manual_seed(7)  # dropout masks
        with saved_for_backward() as saved:
            loss = model(tokens(), tokens(seed=3))
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        return loss.detach(), grads, total_bytes(saved)

    base_loss, base_grads, base_bytes = loss_and_grads("none")
    loss, grads, saved_bytes = loss_and_grads(mode)
    assert saved_bytes < base_bytes / 3, (mode, saved_bytes, base_bytes)
    assert torch.equal(loss, base_loss)
    for name, grad in base_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("tied", [True, False])
def test_param_groups(tied):
    model = build(tiny("gpt2", tie_embeddings=tied))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    not_decayed = {names[id(p)] for p in no_decay["params"]}
    assert decayed.isdisjoint(not_decayed)
    assert decayed | not_decayed == set(names.values())
    assert {
        "embedding.word.weight",
        "embedding.position.weight",
        "final_norm.weight",
    } <= not_decayed
    assert all(
        n.endswith((".bias", "norm.weight")) or n.startswith("embedding.") for n in not_decayed
    )
    assert all(n.endswith("weight") and "norm" not in n for n in decayed)
    assert ("output.weight" in decayed) == (not tied)
    torch.optim.AdamW([decay, no_decay], lr=1e-3)  # accepted as given


def test_backend_resolution(monkeypatch):
    assert isinstance(resolve_backend("torch"), TorchBackend)
    monkeypatch.setattr(backend_module, "transformer_engine_available", lambda: False)
    assert isinstance(resolve_backend("auto"), TorchBackend)
    with pytest.raises(BackendError, match="transformer_engine is not importable"):
        resolve_backend("te")
    with pytest.raises(BackendError, match="unknown"):
        resolve_backend("nope")


def test_model_needs_vocab_and_positions():
    with pytest.raises(ConfigError, match="vocab_size"):
        GPTModel(ModelConfig(max_position_embeddings=8))


def test_loss_falls_when_overfitting_one_batch():
    model = build(tiny("llama"))
    optimizer = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-2)
    x = tokens(batch=4, length=SEQ + 1)
    inputs, labels = x[:, :-1], x[:, 1:]
    losses = []
    for _ in range(30):
        loss = model(inputs, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.1)
    assert losses[-1] < 0.3 * losses[0]


@pytest.mark.parametrize("name", ["tiny-cpu", "gpt2-124m", "gpt2-350m", "llama-1b"])
def test_recipes_validate_and_build(name):
    config = load_config(REPO / f"configs/{name}.yaml")
    assert config.model.max_position_embeddings >= config.data.seq_length
    with torch.device("meta"):
        GPTModel(config.model)


# Model packages.


@pytest.fixture
def tokenizer_file(tmp_path) -> Path:
    path = tmp_path / "tok.model"
    path.write_bytes(b"not really a sentencepiece model")
    return path


def _package(tmp_path, tokenizer_file, style="gpt2") -> tuple[GPTModel, Path]:
    model = build(tiny(style))
    return model, save_model_package(model, model.config, tokenizer_file, tmp_path / "pkg")


@pytest.mark.parametrize("style", STYLES)
def test_package_round_trip(tmp_path, tokenizer_file, style):
    model, path = _package(tmp_path, tokenizer_file, style)
    assert sorted(p.name for p in path.iterdir()) == [
        "checksums.json", "config.json", "model.safetensors", "tokenizer.model",
    ]  # fmt: skip
    meta = json.loads((path / "config.json").read_text())
    assert meta["tokenizer"]["id"] == sha256_file(tokenizer_file)
    assert ("output.weight" in load_file(path / "model.safetensors")) == (style == "llama")

    loaded, config, tokenizer = load_model_package(path)
    assert config == model.config and tokenizer == path / "tokenizer.model"
    assert not loaded.training
    if config.tie_embeddings:
        assert loaded.output.weight is loaded.embedding.word.weight
    x = tokens()
    assert torch.equal(loaded(x), model.eval()(x))
    assert not list(tmp_path.glob(".pkg.*"))  # no temporary directory left behind


def test_package_refuses_existing_dir_unless_overwrite(tmp_path, tokenizer_file):
    model, path = _package(tmp_path, tokenizer_file)
    with pytest.raises(PackageFileError, match="already exists"):
        save_model_package(model, model.config, tokenizer_file, path)
    save_model_package(model, model.config, tokenizer_file, path, overwrite=True)
    load_model_package(path)


def test_package_flipped_byte_is_refused(tmp_path, tokenizer_file):
    _, path = _package(tmp_path, tokenizer_file)
    weights = path / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(PackageChecksumError, match="model.safetensors"):
        load_model_package(path)


def test_package_missing_file_is_refused(tmp_path, tokenizer_file):
    _, path = _package(tmp_path, tokenizer_file)
    (path / "tokenizer.model").unlink()
    with pytest.raises(PackageFileError, match="tokenizer.model"):
        load_model_package(path)
    (path / "checksums.json").unlink()
    with pytest.raises(PackageFileError, match="checksums.json"):
        load_model_package(path)


def _rewrite_checksums(path: Path) -> None:
    files = {
        n: sha256_file(path / n) for n in ("model.safetensors", "config.json", "tokenizer.model")
    }
    (path / "checksums.json").write_text(json.dumps({"files": files}))


def test_package_wrong_shape_is_refused(tmp_path, tokenizer_file):
    _, path = _package(tmp_path, tokenizer_file)
    tensors = load_file(path / "model.safetensors")
    tensors["final_norm.weight"] = torch.ones(31)
    save_file(tensors, path / "model.safetensors")
    _rewrite_checksums(path)  # consistent hashes: the shape check itself must catch it
    with pytest.raises(PackageTensorError, match=r"model.safetensors: tensor final_norm.weight"):
        load_model_package(path)


def test_package_wrong_names_and_config_are_refused(tmp_path, tokenizer_file):
    _, path = _package(tmp_path, tokenizer_file)
    tensors = load_file(path / "model.safetensors")
    tensors["extra"] = tensors.pop("final_norm.bias")
    save_file(tensors, path / "model.safetensors")
    _rewrite_checksums(path)
    with pytest.raises(
        PackageTensorError, match=r"missing \['final_norm.bias'\].*unexpected \['extra'\]"
    ):
        load_model_package(path)

    meta = json.loads((path / "config.json").read_text())
    meta["model"]["num_layers"] = 0
    (path / "config.json").write_text(json.dumps(meta))
    _rewrite_checksums(path)
    with pytest.raises(PackageConfigError, match="(?s)config.json.*num_layers"):
        load_model_package(path)


def test_package_checksums_cannot_name_outside_files(tmp_path, tokenizer_file):
    _, path = _package(tmp_path, tokenizer_file)
    checksums = json.loads((path / "checksums.json").read_text())
    checksums["files"]["../outside"] = "0" * 64
    (path / "checksums.json").write_text(json.dumps(checksums))
    with pytest.raises(PackageConfigError, match="not a plain file name"):
        load_model_package(path)


RESIDUAL_FAMILIES = {
    "gpt": {},
    "t5": {"family": "t5", "num_decoder_layers": 2, "backend": "torch"},
}


@pytest.mark.parametrize("family", sorted(RESIDUAL_FAMILIES))
def test_the_residual_stream_runs_in_the_autocast_dtype_unless_fp32_residual(family) -> None:
    """Under bf16 autocast every block receives the residual stream in bf16 by default and
    in fp32 (the embedding's dtype) with ``model.fp32_residual: true``; the two losses
    agree to bf16 rounding and the bf16 stream gives every parameter a finite gradient."""
    losses = {}
    for fp32 in (True, False):
        config = tiny(**RESIDUAL_FAMILIES[family], fp32_residual=fp32)
        torch.manual_seed(0)
        model = build_model(config)
        seen = []
        for block in model.transformer_blocks():
            block.register_forward_pre_hook(lambda _, args, seen=seen: seen.append(args[0].dtype))
        x = tokens()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, x, x) if family == "t5" else model(x, x)
        loss.backward()
        assert set(seen) == {torch.float32 if fp32 else torch.bfloat16}
        assert len(seen) == len(model.transformer_blocks())
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        losses[fp32] = loss.item()
    assert losses[False] == pytest.approx(losses[True], rel=2e-2)


def test_rmsnorm_takes_a_bf16_input_with_its_fp32_weight_through_the_fused_kernel() -> None:
    """torch's fused RMSNorm needs input and weight of one dtype and otherwise warns and
    runs the op's composite form; ours casts the weight to the bf16 stream's dtype, so it
    neither warns nor differs from the fused kernel fed the cast weight."""
    norm = layers.RMSNorm(32, eps=1e-6)
    x = torch.randn(4, 32).bfloat16()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = norm(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, F.rms_norm(x, (32,), norm.weight.bfloat16(), 1e-6))
    with pytest.warns(UserWarning, match="fused implementation"):
        torch.nn.RMSNorm(32, eps=1e-6)(x)  # the plain module: the slow path
