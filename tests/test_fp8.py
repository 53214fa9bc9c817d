"""FP8 training (training/precision/fp8.py) on CPU through the real path: torchao 0.18's float8
training with torch's CPU ``_scaled_mm`` (no emulation), in the real Trainer.

The model is tests/parallel_helpers.py's tiny one (hidden 32, every block linear a
multiple of 16 wide). Tolerance: over the first steps the fp8 loss stays within
``LOSS_TOLERANCE`` of the bf16 run's, step by step (measured: max 4e-4 over 30 steps,
tensorwise and rowwise). Checkpoints, the model package, exact resume, compile with
selective checkpointing, DDP, FSDP2 and pipeline stages (torchrun, gloo) are checked in
fp8 too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_helpers import tiny_settings
from safetensors.torch import load_file
from torch import nn

from megalith.config import ConfigError, load_config
from megalith.errors import MegalithError
from training.checkpoint.sharded_reader import read_global_tensors
from training.finetune.lora import LoRAAdapter
from training.models import GPTModel
from training.models.package import load_model_package
from training.parallel.groups import ParallelSizes
from training.parallel.support import check_trainer_support
from training.precision.fp8 import FP8Error, convert_linears, fp8_eligible, prepare_fp8
from training.precision.mixed import resolve_precision
from training.trainer import Trainer

pytest.importorskip("torchao.float8", reason="torchao (megalith[gpu] / [test]) is not installed")

STEPS = 6
LOSS_TOLERANCE = 0.01  # |fp8 loss - bf16 loss| at every step of the tiny run


def config(shards: Path, values: dict[str, Any] | None = None):
    settings = tiny_settings(
        shards,
        {
            "mixed_precision.dtype": "bf16",
            "training.train_iters": STEPS,
            "training.eval_interval": 0,
            **(values or {}),
        },
    )
    return load_config(None, [f"{key}={value}" for key, value in settings.items()])


def train(shards: Path, output: Path, values: dict[str, Any] | None = None) -> list[float]:
    result = Trainer(config(shards, values), output).fit(show_progress=False)
    return [record["loss"] for record in result.metrics]


def test_fp8_loss_tracks_bf16_and_keeps_the_whole_tensor_format(
    shards: Path, tmp_path: Path
) -> None:
    bf16 = train(shards, tmp_path / "bf16")
    fp8 = train(shards, tmp_path / "fp8", {"mixed_precision.fp8": "true"})
    assert len(fp8) == len(bf16) == STEPS
    assert fp8 != bf16  # float8 matmuls did run
    assert max(abs(a - b) for a, b in zip(fp8, bf16, strict=True)) < LOSS_TOLERANCE

    # The package and the checkpoint hold the plain model's names, shapes and dtypes.
    plain = load_file(str(tmp_path / "bf16" / "model" / "model.safetensors"))
    packaged = load_file(str(tmp_path / "fp8" / "model" / "model.safetensors"))
    assert {n: (t.shape, t.dtype) for n, t in packaged.items()} == {
        n: (t.shape, t.dtype) for n, t in plain.items()
    }
    model, _, _ = load_model_package(tmp_path / "fp8" / "model")
    assert not any("Float8" in type(m).__name__ for m in model.modules())
    checkpoint = read_global_tensors(tmp_path / "fp8" / "checkpoints" / f"step-{STEPS:08d}")
    for name, tensor in plain.items():
        assert (checkpoint[name].shape, checkpoint[name].dtype) == (tensor.shape, tensor.dtype)


def test_fp8_checkpoint_resume_continues_the_same_curve(shards: Path, tmp_path: Path) -> None:
    values = {"mixed_precision.fp8": "true", "mixed_precision.fp8_recipe": "rowwise"}
    whole = Trainer(config(shards, values), tmp_path / "whole")
    batches = whole.train_batches()
    expected = [whole.train_step(batches)["loss"] for _ in range(4)]

    first = Trainer(config(shards, values), tmp_path / "resumed")
    batches = first.train_batches()
    head = [first.train_step(batches)["loss"] for _ in range(2)]
    first.save()
    first.wait_for_save()
    second = Trainer(config(shards, values), tmp_path / "resumed")  # fresh weights
    assert second.resume() and second.step == 2
    batches = second.train_batches()
    tail = [second.train_step(batches)["loss"] for _ in range(2)]
    assert head + tail == expected


def test_conversion_skips_the_head_and_dims_not_multiple_of_16() -> None:
    model_config = config_model(hidden=48, ffn=40)  # fc1 48->80, fc2 40->48: 40 is no multiple
    model = GPTModel(model_config)
    names_before = [(n, p) for n, p in model.named_parameters()]
    converted = convert_linears(model, "tensorwise")
    assert "layers.0.mlp.fc2" not in converted  # in_features 40
    assert "layers.0.attention.proj" in converted
    assert "layers.0.mlp.fc1.linear" in converted
    assert not any(name.startswith("output") for name in converted)
    assert type(model.layers[0].mlp.fc2) is not type(model.layers[0].attention.proj)
    # The same Parameter objects under the same names: optimizer and checkpoints unchanged.
    assert [(n, id(p)) for n, p in model.named_parameters()] == [
        (n, id(p)) for n, p in names_before
    ]
    assert not fp8_eligible(nn.Linear(16, 8), "x")
    assert fp8_eligible(nn.Linear(16, 32), "layers.0.attention.proj")


def _loss_and_grads(model: nn.Module, tokens: torch.Tensor, forward=None):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = (model if forward is None else forward)(tokens[:, :-1], labels=tokens[:, 1:])
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_weights_cast_once_a_step_give_torchaos_bits() -> None:
    """``mixed_precision.fp8_weight_cache``: the cached float8 weights give torchao's own
    loss and gradients to the bit, eager and traced by torch.compile, once refreshed after
    the weights change; a stale cache would not (the matmuls read it)."""
    from training.precision import float8_weights

    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPTModel(config_model(hidden=32, ffn=64)))
        convert_linears(models[-1], "tensorwise")
    plain, cached = models
    cache = float8_weights.cache_weights(cached, compiled=False)
    assert len(cache.linears) == 4  # qkv, proj, fc1, fc2 of the one block
    assert "weight_float8" not in cached.state_dict()  # checkpoints unchanged
    cache.refresh()
    want = _loss_and_grads(plain, tokens)
    compiled = torch.compile(cached, backend="aot_eager")
    for forward in (cached, compiled):
        got = _loss_and_grads(cached, tokens, forward)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))

    with torch.no_grad():  # an optimizer step, in both models
        for a, b in zip(plain.parameters(), cached.parameters(), strict=True):
            a.mul_(1.5)
            b.mul_(1.5)
    want = _loss_and_grads(plain, tokens)
    assert not torch.equal(_loss_and_grads(cached, tokens)[0], want[0])  # stale
    cache.refresh()
    assert torch.equal(_loss_and_grads(cached, tokens, compiled)[0], want[0])


def test_the_trainer_refreshes_cached_float8_weights(shards: Path, tmp_path: Path) -> None:
    """The Trainer with the cache trains and evaluates exactly as without it: it refreshes
    before every step and every evaluation. (Batches are loaded in the process: once, in a
    full suite run, a DataLoader worker exited with code 1 during this test's evaluation;
    the same exits show as warnings in other tests of this file; cause not found.)"""
    fp8 = {
        "mixed_precision.fp8": "true",
        "training.eval_interval": 3,
        "training.eval_iters": 2,
        "training.num_workers": 0,
    }
    plain_config = config(shards, {**fp8, "mixed_precision.fp8_weight_cache": "false"})
    plain = Trainer(plain_config, tmp_path / "plain").fit(show_progress=False)
    cached_config = config(shards, {**fp8, "mixed_precision.fp8_weight_cache": "true"})
    cached_trainer = Trainer(cached_config, tmp_path / "cached")
    assert cached_trainer.precision.refresh_fp8_weights is not None
    cached = cached_trainer.fit(show_progress=False)
    assert [r["loss"] for r in cached.metrics] == [r["loss"] for r in plain.metrics]
    valid = [r["val_loss"] for r in plain.metrics if "val_loss" in r]
    assert valid and valid == [r["val_loss"] for r in cached.metrics if "val_loss" in r]


def config_model(hidden: int, ffn: int):
    return load_config(
        None,
        [
            f"model.hidden_size={hidden}",
            f"model.ffn_hidden_size={ffn}",
            "model.num_layers=1",
            f"model.num_attention_heads={hidden // 16}",
            "model.vocab_size=64",
            "model.max_position_embeddings=16",
        ],
    ).model


def test_config_errors_name_the_keys(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for dtype in ("fp16", "fp32"):
        with pytest.raises(ConfigError, match=f"mixed_precision.*fp8 needs bf16.*{dtype}"):
            load_config(None, ["mixed_precision.fp8=true", f"mixed_precision.dtype={dtype}"])
    # auto is bf16 with fp8, on CPU too.
    auto = load_config(None, ["mixed_precision.fp8=true"]).mixed_precision
    assert resolve_precision(auto, torch.device("cpu")).name == "bf16"

    with pytest.raises(FP8Error, match="fp8_recipe=delayed.*Transformer Engine"):
        delayed = {"mixed_precision.fp8": "true", "mixed_precision.fp8_recipe": "delayed"}
        Trainer(config(shards, delayed), tmp_path)

    from training.parallel.groups import ParallelSizes
    from training.parallel.support import check_trainer_support

    fp8 = load_config(None, ["mixed_precision.fp8=true", "model.num_query_groups=2"])
    check_trainer_support(fp8, ParallelSizes(tp=2))  # float8 tensor-parallel linears do train
    check_trainer_support(fp8, ParallelSizes(pp=2))  # float8 pipeline stages do train
    odd = load_config(None, ["mixed_precision.fp8=true", "training.micro_batch_size=1",
                             "training.global_batch_size=1", "data.seq_length=1000"])  # fmt: skip
    with pytest.raises(MegalithError, match=r"1000 tokens per micro-batch.*multiple of 16"):
        check_trainer_support(odd, ParallelSizes())
    lora = load_config(None, ["mixed_precision.fp8=true", "finetune.base=some/package",
                              "finetune.lora.rank=4"])  # fmt: skip
    check_trainer_support(lora, ParallelSizes())  # LoRA over float8 linears trains
    plain = load_config(None, []).mixed_precision  # the same layout without fp8 is fine
    check_trainer_support(odd.model_copy(update={"mixed_precision": plain}), ParallelSizes())

    # torchao missing: the error names the extra to install.
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    model = GPTModel(config_model(hidden=32, ffn=64))
    precision = resolve_precision(fp8.mixed_precision, torch.device("cpu"))
    with pytest.raises(FP8Error, match=r"megalith\[gpu\]"):
        prepare_fp8(model, fp8.mixed_precision, precision)


def test_lora_fine_tunes_beside_float8_base_linears(shards: Path, tmp_path: Path) -> None:
    """LoRA x fp8: the base's linears run in float8 (torchao), each with its adapter beside
    it in bf16. The adapters train, the base weights stay the base's, and the losses track
    the same LoRA fine-tune in bf16 step by step."""
    train(shards, tmp_path / "base")
    lora = {"finetune.base": str(tmp_path / "base" / "model"), "finetune.lora.rank": 4,
            "finetune.lora.alpha": 8, "finetune.lora.dropout": 0.0}  # fmt: skip
    bf16 = train(shards, tmp_path / "lora-bf16", lora)
    trainer = Trainer(config(shards, {**lora, "mixed_precision.fp8": "true"}), tmp_path / "fp8")
    float8 = {
        n: m for n, m in trainer.model.named_modules() if type(m).__name__.endswith("Float8Linear")
    }
    adapted = {n for n, m in trainer.model.named_modules() if isinstance(m, LoRAAdapter)}
    assert float8 and {f"{name}.lora" for name in float8} <= adapted
    base = load_file(tmp_path / "base" / "model" / "model.safetensors")
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    fp8 = [record["loss"] for record in trainer.fit(show_progress=False).metrics]
    assert len(fp8) == len(bf16) == STEPS
    for step, (got, want) in enumerate(zip(fp8, bf16, strict=True)):
        assert abs(got - want) < LOSS_TOLERANCE, (step, fp8, bf16)
    params = dict(trainer.model.named_parameters())
    for name in float8:
        assert torch.equal(params[f"{name}.weight"].detach().cpu(), base[f"{name}.weight"])
        assert not torch.equal(params[f"{name}.lora.a"], start[f"{name}.lora.a"])


def test_compile_and_selective_checkpointing_trace_the_float8_linears() -> None:
    """torch.compile (aot_eager: dynamo and AOT autograd, without inductor's slow CPU
    codegen; the Trainer's inductor path was run by hand, see the module docstring of
    training/precision/fp8.py) over a converted model with selective checkpointing gives the eager
    loss and gradients."""
    from training.models.gpt import SELECTIVE_SAVED_OPS

    assert torch.ops.aten._scaled_mm.default in SELECTIVE_SAVED_OPS
    model_config = config_model(hidden=32, ffn=64).model_copy(
        update={"activation_checkpointing": "selective"}
    )
    torch.manual_seed(0)
    model = GPTModel(model_config)
    convert_linears(model, "tensorwise")
    tokens = torch.randint(0, 64, (2, 12))
    results = []
    for forward in (model, torch.compile(model, backend="aot_eager")):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward(tokens[:, :-1], labels=tokens[:, 1:])
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    (eager, eager_grads), (compiled, compiled_grads) = results
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b)


def _benchmark(name: str):
    import importlib

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module(name)


def test_benchmark_variants_resolve_to_valid_configs(shards: Path) -> None:
    throughput = _benchmark("train_throughput")
    assert throughput.variant_settings("ours-compile@mixed_precision.fp8=true") == [
        "mixed_precision.fp8=true"
    ]
    assert throughput.variant_settings("ours-compile-fp8-rowwise@model.loss_chunk_tokens=64") == [
        "mixed_precision.fp8=true",
        "mixed_precision.fp8_recipe=rowwise",
        "model.loss_chunk_tokens=64",
    ]
    fp8_variants = ("ours-fp8", "ours-compile-fp8", "ours-compile-fp8-rowwise")
    for variant in (*fp8_variants, "ours-compile-fp8-cudagraphs"):
        expanded = throughput.expand_variant(variant)
        config = throughput.load_shape(
            "tiny", str(shards), 2, expanded.startswith("ours-compile"), 2,
            throughput.variant_settings(variant),
        )  # fmt: skip
        assert config.mixed_precision.fp8 and config.model.hidden_size == 64
        check_trainer_support(config, ParallelSizes())  # runs as the trainer would take it

    convergence = _benchmark("fp8_convergence")
    args = convergence.main.__globals__["argparse"].Namespace(
        shape="tiny", shards=str(shards), steps=20, compile=False, seed=1, micro_batch=2, set=[]
    )
    for variant in convergence.VARIANTS:
        config = convergence.build_config(args, variant)
        assert config.mixed_precision.fp8 == ("fp8" in variant)
        assert config.model.backend == ("te" if variant.startswith("te") else "torch")
        assert config.scheduler.warmup_iters == 2 and config.training.global_batch_size == 2
    verdict = convergence.compare([3.0, 2.0, 1.0], [3.1, 2.0, 1.02], tolerance=0.05)
    assert verdict["passed"] and verdict["window"] == 3
    assert verdict["max_abs_delta"] == pytest.approx(0.1)
    assert not convergence.compare([1.0], [1.2], tolerance=0.05)["passed"]


def test_every_parallelism_trains_in_fp8_like_one_process(shards: Path, tmp_path: Path) -> None:
    """DDP, FSDP2, two pipeline stages and TP=2 (with and without sequence parallelism)
    over 2 gloo processes (real torchrun, one job) with float8 linears: the curve of one
    process in fp8, every tensor-parallel linear in float8, and exact resumes."""
    from parallel_helpers import (
        TP_FP8_GRAD_RTOL,
        TP_FP8_LOSS_ATOL,
        assert_metrics_match,
        assert_resume_exact,
        fit_one_process,
        metrics,
        run_trainer_worker,
        trainer_settings,
    )

    fp8 = {"mixed_precision.dtype": "bf16", "mixed_precision.fp8": "true"}
    tp = {**fp8, "parallel.tensor": 2}
    cases = {
        "ddp": trainer_settings(shards, fp8),
        "fsdp": trainer_settings(shards, {**fp8, "parallel.data_parallel_mode": "fsdp"}),
        "pp2": trainer_settings(shards, {**fp8, "parallel.pipeline": 2}),
        "tp2": trainer_settings(shards, tp),
        "tp2-sp": trainer_settings(shards, {**tp, "parallel.sequence_parallel": "true"}),
    }
    (tmp_path / "runs").mkdir()
    runs = run_trainer_worker(tmp_path / "runs", cases, 2, "fp8 parallel")
    want = metrics(fit_one_process(trainer_settings(shards, fp8), tmp_path / "one"))
    for case in cases:
        got = metrics(runs / case)
        if case.startswith("tp"):
            linears = json.loads((runs / case / "tensor_parallel_float8.json").read_text())
            assert linears and all(linears.values()), f"{case}: not every TP linear in float8"
            assert_metrics_match(
                got, want, f"fp8 {case}", loss_atol=TP_FP8_LOSS_ATOL, grad_rtol=TP_FP8_GRAD_RTOL
            )
        else:  # measured: DDP equal to the bit, FSDP and PP within the default tolerances
            assert_metrics_match(got, want, f"fp8 {case}")
        assert_resume_exact(runs / case, runs / f"{case}-resumed", f"fp8 {case}")


CUDA_COMPILED = {
    "model.backend": "torch",  # torchao, even where auto would pick Transformer Engine
    "training.device": "cuda",
    "training.compile": "true",
    "training.train_iters": 30,
    "model.hidden_size": 256,
    "model.num_attention_heads": 8,
    "model.ffn_hidden_size": 512,
}


@pytest.fixture(scope="module")
def cuda_compiled_bf16(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The compiled bf16 curve both fp8 recipes are compared with, trained once."""
    return train(shards, tmp_path_factory.mktemp("bf16-cuda"), CUDA_COMPILED)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_on_cuda_with_compile_tracks_bf16(
    shards: Path, tmp_path: Path, cuda_compiled_bf16: list[float], recipe: str
) -> None:
    """On a float8 GPU (sm_89+): the compiled Trainer in fp8 (torchao, cuBLASLt float8
    GEMMs) tracks the compiled bf16 run over 30 steps of a hidden-256 model, within
    benchmarks/fp8_convergence.py's tolerance (mean 0.05, max 0.15). Last passed:
    2026-11-25, one H100 80GB, torch 2.11.0+cu130, torchao 0.18.0: max / mean gap
    0.0038 / 0.0014 (tensorwise), 0.0038 / 0.0017 (rowwise); benchmarks/RESULTS.md."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 GEMMs need compute capability 8.9+")
    bf16 = cuda_compiled_bf16
    fp8_settings = {"mixed_precision.fp8": "true", "mixed_precision.fp8_recipe": recipe}
    fp8 = train(shards, tmp_path / "fp8", {**CUDA_COMPILED, **fp8_settings})
    deltas = [abs(a - b) for a, b in zip(fp8, bf16, strict=True)]
    print(
        f"fp8 {recipe} vs bf16, compiled: max {max(deltas):.4f}, mean {sum(deltas) / len(deltas):.4f}"
    )
    assert fp8 != bf16
    assert sum(deltas) / len(deltas) <= 0.05 and max(deltas) <= 0.15, deltas


@pytest.mark.gpu
def test_on_cuda_compiled_the_cached_float8_weights_train_as_torchao(
    shards: Path, tmp_path: Path
) -> None:
    """The compiled CUDA Trainer with ``mixed_precision.fp8_weight_cache`` follows the
    curve of torchao's own casts: the refresh casts as the compiled step did."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 GEMMs need compute capability 8.9+")
    fp8 = {**CUDA_COMPILED, "mixed_precision.fp8": "true", "training.train_iters": 10}
    plain = train(shards, tmp_path / "plain", {**fp8, "mixed_precision.fp8_weight_cache": "false"})
    cached = train(shards, tmp_path / "cached", fp8)  # the default
    worst = max(abs(a - b) / abs(b) for a, b in zip(cached, plain, strict=True))
    print(f"cached float8 weights vs torchao's casts, compiled: worst relative {worst:.2e}")
    assert worst <= 1e-3, (cached, plain)
