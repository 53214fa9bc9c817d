"""T5 pipeline parallelism through the real Trainer on CPU with gloo: 2 processes against one.

The encoder's then the decoder's layers (2 + 2) are split over the stages
(:mod:`training.parallel.pipeline_t5`). One torchrun job of 2 ranks runs every layout:
``Trainer.fit`` for 4 steps (4 micro-batches per step, validation and a checkpoint every
2), then a resume from the step-2 checkpoint; and one step's gradients, gathered from
the stages. Layouts:

- ``pp2``: 1F1B, the encoder on stage 0, the decoder on stage 1;
- ``pp2-layers-3-1``: stage 0 holds the encoder and the decoder's first layer (a stage
  that ends the encoder and starts the decoder), with RoPE instead of relative biases;
- ``pp2-interleaved``: 4 virtual stages of one layer (rank 0: encoder layer 0 and decoder
  layer 0; rank 1: encoder layer 1 and decoder layer 1), selective recomputation;
- ``pp2-zero-bubble``: ZB1P over the same 4 virtual stages.

Each must match the single-process run of the same settings: losses and validation
losses within 1e-5 absolute and grad norms within 1e-4 relative at every step, the
last checkpoint's whole weights and AdamW moments and one step's gradients within
rtol 1e-4 / atol 1e-5, the model package's logits, and an exact resume; one process
resumes the interleaved run's sharded checkpoint. A second job of 4 processes runs
TP=2 × PP=2 with sequence parallelism and PP=2 × DP=2 with the distributed optimizer
(fit only). Measured on gloo: losses within 9.6e-7 of one process, grad norms within
2e-6 relative (the stages run one process's ops; the norm is summed per stage).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from parallel_helpers import (
    BACKEND,
    DEVICE,
    RESUME_STEP,
    assert_close_tensors,
    assert_metrics_match,
    assert_resume_exact,
    assert_saved_in_row_halves,
    assert_whole_checkpoint,
    metrics,
    one_step_gradients,
    run_torchrun_worker,
)
from safetensors.torch import load_file
from t5_helpers import T5_RECIPE, t5_config, t5_settings, t5_shard_set

from training.models.package import load_model_package
from training.parallel.pipeline_layout import (
    layer_counts,
    owner_of_t5_parameter,
    pipelined_layers,
)
from training.trainer import Trainer

WORLD = 2
VIRTUAL = {"parallel.pipeline": 2, "parallel.virtual_pipeline": 2}
ROPE = {"model.position_embedding": "rope"}
CASES: dict[str, dict[str, Any]] = {
    "pp2": {"parallel.pipeline": 2},
    "pp2-layers-3-1": {"parallel.pipeline": 2, "parallel.pipeline_layers": "[3,1]", **ROPE},
    "pp2-interleaved": {
        **VIRTUAL,
        "parallel.pipeline_schedule": "interleaved",
        "model.activation_checkpointing": "selective",
    },
    "pp2-zero-bubble": {**VIRTUAL, "parallel.pipeline_schedule": "zero-bubble"},
}
# The single-process settings each layout is compared with (pipeline keys left out).
REFERENCES = {"relative": {}, "rope": ROPE}


def reference_of(case: str) -> str:
    return "rope" if CASES[case].get("model.position_embedding") == "rope" else "relative"


def layout(case: str) -> str:
    return f"T5 {case} ({BACKEND}, {WORLD} processes)"


@pytest.fixture(scope="module")
def t5_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return t5_shard_set(tmp_path_factory)


@pytest.fixture(scope="module")
def references(t5_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One process per position kind: fit the same 4 steps."""
    out = tmp_path_factory.mktemp("t5-pp-reference")
    for name, extra in REFERENCES.items():
        Trainer(t5_config(t5_settings(t5_shards, extra)), out / name).fit(show_progress=False)
    return {name: out / name for name in REFERENCES}


@pytest.fixture(scope="module")
def pipeline_runs(t5_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layout's fit and resume, and one step's gradients of each, in one job."""
    out = tmp_path_factory.mktemp("t5-pp-runs")
    spec = {
        "recipe": str(T5_RECIPE),
        "device": DEVICE,
        "resume_step": RESUME_STEP,
        "out": str(out),
        "cases": {name: t5_settings(t5_shards, extra) for name, extra in CASES.items()},
        "grad_cases": {
            f"grads-{name}": t5_settings(t5_shards, extra) for name, extra in CASES.items()
        },
    }
    return run_torchrun_worker("pp_worker.py", spec, out, WORLD, "T5 pipeline")


@pytest.mark.parametrize("case", CASES)
def test_t5_pipeline_matches_one_process(
    case: str, pipeline_runs: Path, references: dict[str, Path]
) -> None:
    reference = references[reference_of(case)]
    got = metrics(pipeline_runs / case)
    assert_metrics_match(got, metrics(reference), layout(case))
    assert all(r["pipeline_bubble_theory"] > 0 for r in got), layout(case)
    assert_whole_checkpoint(pipeline_runs / case, reference, layout(case))
    assert_resume_exact(pipeline_runs / case, pipeline_runs / f"{case}-resumed", layout(case))


@pytest.mark.parametrize("case", CASES)
def test_t5_pipeline_gradients_of_one_step_match_one_process(
    case: str, pipeline_runs: Path, t5_shards: Path, tmp_path: Path
) -> None:
    got = load_file(str(pipeline_runs / f"grads-{case}" / "grads.safetensors"))
    extra = REFERENCES[reference_of(case)]
    trainer = Trainer(t5_config(t5_settings(t5_shards, extra)), tmp_path)
    want = one_step_gradients(trainer)
    assert_close_tensors(got, want, f"{layout(case)} step 1 gradients")


def test_one_process_resumes_a_t5_pipeline_checkpoint(
    pipeline_runs: Path, t5_shards: Path, tmp_path: Path
) -> None:
    """The interleaved layout's sharded step-2 checkpoint, resumed by one process, gives
    the pipeline run's losses (within 1e-5) for the remaining steps."""
    step = f"step-{RESUME_STEP:08d}"
    shutil.copytree(pipeline_runs / "pp2-interleaved" / "checkpoints" / step, tmp_path / step)
    config = t5_config(t5_settings(t5_shards, {"checkpoint.directory": tmp_path}))
    trainer = Trainer(config, tmp_path / "run")
    assert trainer.resume() and trainer.step == RESUME_STEP
    trainer.fit(show_progress=False)
    straight = {r["step"]: r["loss"] for r in metrics(pipeline_runs / "pp2-interleaved")}
    for record in metrics(tmp_path / "run"):
        assert record["loss"] == pytest.approx(straight[record["step"]], abs=1e-5), (
            f"{layout('pp2-interleaved')} checkpoint resumed in one process: loss differs "
            f"at step {record['step']}"
        )


# 4 processes: pipeline beside tensor (sequence), data and context parallelism.
WIDE_CASES: dict[str, dict[str, Any]] = {
    "tp2-pp2-sp": {
        "parallel.tensor": 2,
        "parallel.pipeline": 2,
        "parallel.sequence_parallel": "true",
    },
    "pp2-dp2-distributed-optimizer": {
        "parallel.pipeline": 2,
        "parallel.data_parallel_mode": "distributed_optimizer",
    },
    "pp2-dp2-fsdp": {"parallel.pipeline": 2, "parallel.data_parallel_mode": "fsdp"},
    "pp2-v2-dp2-fsdp": {
        **CASES["pp2-interleaved"],
        "parallel.data_parallel_mode": "fsdp",
    },
    # Each stage builds its masks for the CP rank's rows (positions as keyword inputs),
    # and rotates by global positions.
    "cp2-pp2": {"parallel.context": 2, "parallel.pipeline": 2},
    "cp2-pp2-rope": {"parallel.context": 2, "parallel.pipeline": 2, **ROPE},
    # No stages: context-parallel attention around the tensor-parallel (SP) layers.
    "tp2-cp2-sp": {
        "parallel.tensor": 2,
        "parallel.context": 2,
        "parallel.sequence_parallel": "true",
    },
}


@pytest.fixture(scope="module")
def wide_runs(t5_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both 4-process layouts, fit only (the resume is tested at 2 processes), one job;
    the checkpoint boxes each rank writes are checked against the load paths."""
    out = tmp_path_factory.mktemp("t5-pp-wide")
    spec = {
        "recipe": str(T5_RECIPE),
        "device": DEVICE,
        "out": str(out),
        "fit_cases": {name: t5_settings(t5_shards, extra) for name, extra in WIDE_CASES.items()},
    }
    return run_torchrun_worker("pp_worker.py", spec, out, 4, "T5 pipeline (4 processes)")


@pytest.mark.parametrize("case", WIDE_CASES)
def test_t5_pipeline_beside_tensor_and_data_parallelism_matches_one_process(
    case: str, wide_runs: Path, references: dict[str, Path]
) -> None:
    name = f"T5 {case} ({BACKEND}, 4 processes)"
    reference = references["rope" if "rope" in case else "relative"]
    assert_metrics_match(metrics(wide_runs / case), metrics(reference), name)
    assert_whole_checkpoint(wide_runs / case, reference, name)
    for rank in range(4):
        boxes = json.loads((wide_runs / case / f"boxes-rank{rank}.json").read_text())
        assert boxes == [], f"{name}: checkpoint boxes differ from the load paths: {boxes}"
    if "fsdp" in case:  # the relative-bias tables stay whole on every stage
        assert_saved_in_row_halves(wide_runs / case, name, whole="relative_bias")


@pytest.mark.parametrize("case", ["pp2", "pp2-layers-3-1"])
def test_t5_pipeline_package_gives_one_process_logits(
    case: str, pipeline_runs: Path, references: dict[str, Path]
) -> None:
    model, config, _ = load_model_package(pipeline_runs / case / "model")
    want, _, _ = load_model_package(references[reference_of(case)] / "model")
    assert config.family == "t5"
    generator = torch.Generator().manual_seed(0)
    encoder = torch.randint(0, config.vocab_size, (2, 12), generator=generator)
    decoder = torch.randint(0, config.vocab_size, (2, 5), generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(
            model(encoder, decoder), want(encoder, decoder), rtol=1e-4, atol=1e-5,
            msg=lambda m: f"{layout(case)} package logits: {m}",
        )  # fmt: skip


@pytest.mark.slow
def test_compiled_t5_pipeline_stages_match_one_compiled_process(
    t5_shards: Path, tmp_path: Path
) -> None:
    """``training.compile`` with T5 stages (PP=2: encoder, then decoder): each encoder and
    decoder block compiled in place gives the compiled single process's losses and grad
    norms, whole checkpoint tensors, and resumes exactly. Traced with ``aot_eager`` (the
    stages' graphs without Inductor's slow CPU code generation; Inductor itself:
    tests/test_trainer.py)."""
    compiled = {"training.compile": "true", "training.compile_backend": "aot_eager"}
    compiled = t5_settings(t5_shards, compiled)
    one = tmp_path / "one"
    Trainer(t5_config(compiled), one).fit(show_progress=False)
    case = "pp2-compiled"
    spec = {
        "recipe": str(T5_RECIPE),
        "device": DEVICE,
        "resume_step": RESUME_STEP,
        "out": str(tmp_path),
        "cases": {case: {**compiled, "parallel.pipeline": 2}},
    }
    runs = run_torchrun_worker("pp_worker.py", spec, tmp_path, WORLD, "T5 compiled pipeline")
    name = f"T5 {case} ({BACKEND}, {WORLD} processes)"
    assert_metrics_match(metrics(runs / case), metrics(one), name)
    assert_whole_checkpoint(runs / case, one, name)
    assert_resume_exact(runs / case, runs / f"{case}-resumed", name)


def test_t5_split_counts_encoder_then_decoder_layers(t5_shards: Path) -> None:
    config = t5_config(t5_settings(t5_shards, {"model.num_decoder_layers": 3})).model
    assert pipelined_layers(config) == 5
    counts = layer_counts(5, pp=2, vpp=1, split=[3, 2])

    def owner(name: str) -> int:
        return owner_of_t5_parameter(name, counts, 2, encoder_layers=2)

    # Stage 0: encoder layers 0-1, decoder layer 0; stage 1: decoder layers 1-2.
    assert owner("embedding.word.weight") == 0
    assert owner("encoder.relative_bias.weight") == 0
    assert owner("encoder.layers.1.mlp.fc2.weight") == 0
    assert owner("encoder.final_norm.weight") == 0
    assert owner("decoder.relative_bias.weight") == 0
    assert owner("decoder.layers.0.cross_attention.kv.weight") == 0
    assert owner("decoder.layers.1.attention.proj.weight") == 1
    assert owner("decoder.final_norm.weight") == 1
    assert owner("output.weight") == 1
    counts = layer_counts(5, pp=2, vpp=1, split=[1, 4])
    assert owner_of_t5_parameter("encoder.final_norm.weight", counts, 2, encoder_layers=2) == 1
    with pytest.raises(ValueError, match="decoder.layers.7.mlp.fc2.weight: layer 9 is outside"):
        owner_of_t5_parameter("decoder.layers.7.mlp.fc2.weight", counts, 2, encoder_layers=2)
