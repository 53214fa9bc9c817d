"""Pipeline parallelism through the real Trainer on CPU with gloo: 2 processes against one.

Each layout runs ``Trainer.fit`` for 4 steps (4 layers, 4 micro-batches per step) with
a checkpoint at step 2 and must match the single-process run with the same config,
seed and data: losses, validation losses and grad norms step by step, the whole
(gathered) weights and AdamW moments in the final checkpoint, and the logits of the
model package. Layouts: PP=2 with 1F1B; PP=2 interleaved (virtual_pipeline 2, one
layer per virtual stage) with selective activation checkpointing; PP=2 with an uneven
split ``pipeline_layers=[1, 3]``; PP=2 in bf16 with an untied output head (against a
single-process bf16 run). Resuming a PP checkpoint in the same layout is exact;
a PP=2 checkpoint resumes in one process and a single-process checkpoint at PP=2 (sharded,
and in the whole-tensor v1 format through the stages' own loader). One
step's gradients (gathered from the stages) equal the unsharded gradients. A slow
test runs TP=2 × PP=2 × DP=2 (8 processes). On GPUs: MEGALITH_TEST_DEVICE=cuda (NCCL).

Tolerance: pipeline stages run the same ops in the same order as one process, so
losses agree to float32 rounding (measured: identical on gloo); the grad norm is summed
per stage (measured 1e-6 relative). Losses within 1e-5 absolute, grad norms within
1e-4 relative, tensors, gradients and logits within rtol 1e-4 / atol 1e-5; TP × PP also
sums TP partial products in another order.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from parallel_helpers import (
    BACKEND,
    DEVICE,
    RECIPE,
    RESUME_STEP,
    STEPS,
    assert_close_tensors,
    assert_metrics_match,
    assert_one_process_resume,
    assert_package_logits_match,
    assert_resume_exact,
    assert_saved_in_row_halves,
    assert_whole_checkpoint,
    config_of,
    fit_one_process,
    last_checkpoint_state,
    metrics,
    one_step_gradients,
    run_torchrun_worker,
    trainer_settings,
)
from safetensors.torch import load_file

from megalith.errors import MegalithError
from training.checkpoint.format import save_checkpoint
from training.checkpoint.sharded_index import is_sharded, read_index
from training.parallel.groups import ParallelLayoutError, ParallelSizes, validate_layout
from training.parallel.pipeline_layout import (
    bubble_fraction,
    layer_counts,
    owner_of_parameter,
    stage_layers,
    virtual_stages_of,
)
from training.parallel.support import check_trainer_support
from training.trainer import Trainer

WORLD = 2
INTERLEAVED = {
    "parallel.pipeline": 2,
    "parallel.virtual_pipeline": 2,
    "parallel.pipeline_schedule": "interleaved",
}
CASES = {
    "pp2": {"parallel.pipeline": 2},
    "pp2-interleaved-selective": {**INTERLEAVED, "model.activation_checkpointing": "selective"},
    "pp2-layers-1-3": {"parallel.pipeline": 2, "parallel.pipeline_layers": "[1,3]"},
    "pp2-zero-bubble-v2": {
        **INTERLEAVED,
        "parallel.pipeline_schedule": "zero-bubble",
        "model.activation_checkpointing": "full",
    },
}
# Untied output head (its own weight on the last stage) in bf16 autocast, against a
# single-process run of the same settings.
BF16_UNTIED = {"mixed_precision.dtype": "bf16", "model.tie_embeddings": "false"}
# fp16 with a loss scale far too large at first: the scaled gradients overflow on some
# stage, every rank must skip those steps and halve the scale together, then grow it.
FP16 = {
    "mixed_precision.dtype": "fp16",
    "mixed_precision.initial_loss_scale": 2**30,
    "mixed_precision.loss_scale_growth_interval": 2,
}


# Mixture of experts in every block (4 experts, top 2, balance loss), and torchao float8
# linears over bf16 autocast: each against one process of the same settings.
MOE = {
    "model.num_experts": 4,
    "model.moe_top_k": 2,
    "model.moe_ffn_hidden_size": 32,
    "model.moe_aux_loss_coeff": 0.1,
}
FP8 = {"mixed_precision.dtype": "bf16", "mixed_precision.fp8": "true"}


def layout(case: str, world: int = WORLD) -> str:
    return f"{case} ({BACKEND}, {world} processes)"


def settings(shards: Path, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """4 layers, so that each of 2 stages (or 4 virtual stages) holds some."""
    return trainer_settings(shards, {"model.num_layers": 4, **(extra or {})})


@pytest.fixture(scope="module")
def reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process run of the same config."""
    return fit_one_process(settings(shards), tmp_path_factory.mktemp("pp-reference"))


def run_worker(out: Path, world: int, **parts: Any) -> Path:
    spec = {
        "recipe": str(RECIPE),
        "device": DEVICE,
        "resume_step": RESUME_STEP,
        "out": str(out),
        **parts,
    }
    return run_torchrun_worker("pp_worker.py", spec, out, world, f"PP ({world} processes)")


@pytest.fixture(scope="module")
def reference_v1(shards: Path, reference: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The single-process run's step-2 state as a whole-tensor (v1) checkpoint, the format
    the trainer wrote before sharded checkpoints: loaded from its sharded checkpoint (RNG
    included) and written again with ``save_checkpoint``; returns the checkpoints folder."""
    out = tmp_path_factory.mktemp("pp-reference-v1")
    step = f"step-{RESUME_STEP:08d}"
    shutil.copytree(reference / "checkpoints" / step, out / "sharded" / step)
    config = config_of(settings(shards))
    config.checkpoint.directory = str(out / "sharded")
    trainer = Trainer(config, out)
    assert trainer.resume() and trainer.step == RESUME_STEP
    state = {
        "consumed_samples": trainer.consumed_samples,
        "config": config.model_dump(mode="json"),
        "model_config": trainer.model_config.model_dump(mode="json"),
        "layout": trainer.parallel.layout(),
    }
    save_checkpoint(
        out / "v1", trainer.step, trainer.model, trainer.optimizer, trainer.param_names, state
    )
    assert not is_sharded(read_index(str(out / "v1" / step)))
    return out / "v1"


@pytest.fixture(scope="module")
def parallel_runs(
    shards: Path, reference: Path, reference_v1: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Every 2-process job at once (one start-up): the fits and resumes, one step's
    gradients at PP=2 (1F1B and interleaved), and PP=2 resuming the single-process
    checkpoint."""
    return run_worker(
        tmp_path_factory.mktemp("pp-runs"),
        WORLD,
        cases={
            **{name: settings(shards, extra) for name, extra in CASES.items()},
            "pp2-bf16-untied": settings(shards, {**CASES["pp2"], **BF16_UNTIED}),
            "pp2-fp16": settings(shards, {**CASES["pp2"], **FP16}),
            "dp2-fsdp-fp16": settings(shards, {**FP16, "parallel.data_parallel_mode": "fsdp"}),
        },
        grad_cases={
            f"grads-{name}": settings(shards, CASES[name])
            for name in ("pp2", "pp2-interleaved-selective", "pp2-zero-bubble-v2")
        },
        resume_cases={
            "pp2-from-one-process": settings(shards, CASES["pp2"]),
            "pp2-from-v1": settings(shards, CASES["pp2"]),
        },
        checkpoint_root=str(reference / "checkpoints"),
        resume_roots={"pp2-from-v1": str(reference_v1)},
    )


# --- through the trainer -------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_losses_match_one_process(case: str, parallel_runs: Path, reference: Path) -> None:
    got = metrics(parallel_runs / case)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_metrics_match(got, metrics(reference), layout(case))
    vpp = 2 if "-v2" in case or "interleaved" in case else 1
    for record in got:
        assert record["pipeline_bubble_theory"] == pytest.approx((2 - 1) / (vpp * 4))
        assert record["pipeline_bubble"] >= 0.0, f"{layout(case)}: bubble {record}"
        assert 0.0 <= record["pipeline_idle"] < 1.0, f"{layout(case)}: idle {record}"
        assert record["pipeline_imbalance"] >= 0.0, f"{layout(case)}: imbalance {record}"


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_holds_whole_single_process_tensors(
    case: str, parallel_runs: Path, reference: Path
) -> None:
    assert_whole_checkpoint(parallel_runs / case, reference, layout(case))
    assert last_checkpoint_state(parallel_runs / case)["layout"]["parallel.pipeline"] == WORLD


@pytest.mark.parametrize("case", CASES)
def test_resume_in_the_same_layout_is_exact(case: str, parallel_runs: Path) -> None:
    assert_resume_exact(parallel_runs / case, parallel_runs / f"{case}-resumed", layout(case))


@pytest.mark.parametrize("case", ["pp2", "pp2-interleaved-selective"])
def test_one_process_resumes_a_pipeline_checkpoint(
    case: str, parallel_runs: Path, shards: Path, tmp_path: Path
) -> None:
    assert_one_process_resume(parallel_runs / case, settings(shards), tmp_path, layout(case))


def test_pipeline_resumes_a_one_process_checkpoint(parallel_runs: Path, reference: Path) -> None:
    name = layout("pp2 resuming the single-process step-2 checkpoint")
    want = [r for r in metrics(reference) if r["step"] > RESUME_STEP]
    assert_metrics_match(metrics(parallel_runs / "pp2-from-one-process"), want, name)
    assert_whole_checkpoint(parallel_runs / "pp2-from-one-process", reference, name)


def test_pipeline_resumes_a_whole_tensor_checkpoint(parallel_runs: Path, reference: Path) -> None:
    """The v1 format (whole tensors, as the trainer wrote before sharded checkpoints) goes
    through the stages' own loader, with its optimizer groups checked as the other
    loaders check them: PP=2 continues the single-process run."""
    name = layout("pp2 resuming the single-process step-2 checkpoint in the v1 format")
    want = [r for r in metrics(reference) if r["step"] > RESUME_STEP]
    assert_metrics_match(metrics(parallel_runs / "pp2-from-v1"), want, name)
    assert_whole_checkpoint(parallel_runs / "pp2-from-v1", reference, name)


@pytest.mark.parametrize("case", ["pp2", "pp2-interleaved-selective", "pp2-zero-bubble-v2"])
def test_gradients_of_one_step_match_one_process(
    case: str, parallel_runs: Path, shards: Path, tmp_path: Path
) -> None:
    got = load_file(str(parallel_runs / f"grads-{case}" / "grads.safetensors"))
    trainer = Trainer(config_of(settings(shards)), tmp_path)
    want = one_step_gradients(trainer)
    assert_close_tensors(got, want, f"{layout(case)} step 1 gradients")


def test_bf16_with_untied_output_head_matches_one_process(
    parallel_runs: Path, shards: Path, tmp_path: Path
) -> None:
    case, name = "pp2-bf16-untied", layout("pp2 bf16 untied output head")
    fit_one_process(settings(shards, BF16_UNTIED), tmp_path)
    assert_metrics_match(metrics(parallel_runs / case), metrics(tmp_path), name)
    assert_whole_checkpoint(parallel_runs / case, tmp_path, name)
    assert_resume_exact(parallel_runs / case, parallel_runs / f"{case}-resumed", name)


@pytest.fixture(scope="module")
def fp16_reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit_one_process(settings(shards, FP16), tmp_path_factory.mktemp("fp16-one"))


@pytest.mark.parametrize("case", ["pp2-fp16", "dp2-fsdp-fp16"])
def test_fp16_loss_scaling_agrees_over_the_stages_and_fsdp_shards(
    case: str, parallel_runs: Path, fp16_reference: Path
) -> None:
    """fp16 under PP=2, and under FSDP over 2 data ranks (sharded gradients, unscaled and
    checked for infs shard by shard): the ranks skip the overflowing steps and move the
    loss scale together, as one process does (same scales step by step, same losses and
    grad norms), and resume exactly."""
    name = layout(f"{case} loss scaling")
    got, want = metrics(parallel_runs / case), metrics(fp16_reference)
    scales = [r["loss_scale"] for r in got]
    assert scales == [r["loss_scale"] for r in want], (scales, want)
    assert scales[0] < 2**30 and len(set(scales)) > 2  # overflows halved it, clean steps grew it
    # An overflowing step's gradient norm is inf or NaN on both; it is skipped on both.
    overflowed = [not math.isfinite(r["grad_norm"]) for r in want]
    assert [not math.isfinite(r["grad_norm"]) for r in got] == overflowed and any(overflowed)
    finite = [(g, w) for g, w, o in zip(got, want, overflowed, strict=True) if not o]
    assert_metrics_match([g for g, _ in finite], [w for _, w in finite], name)
    assert_resume_exact(parallel_runs / case, parallel_runs / f"{case}-resumed", name)


@pytest.mark.parametrize("case", CASES)
def test_model_package_loads_in_one_process(
    case: str, parallel_runs: Path, reference: Path
) -> None:
    assert_package_logits_match(parallel_runs / case, reference, layout(case))


# Traced with aot_eager: the stages' graphs (dynamo, AOT autograd) without Inductor's slow
# CPU code generation; Inductor itself: tests/test_trainer.py, and on GPUs
# benchmarks/RESULTS.md (compiled pipeline stages).
COMPILED = {"training.compile": "true", "training.compile_backend": "aot_eager"}


@pytest.fixture(scope="module")
def compiled_reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled single process (the FSDP × PP job runs a compiled case too)."""
    return fit_one_process(settings(shards, COMPILED), tmp_path_factory.mktemp("compiled-one"))


@pytest.mark.slow
def test_compiled_pipeline_stages_match_one_compiled_process(
    shards: Path, compiled_reference: Path, tmp_path: Path
) -> None:
    """``training.compile`` with PP=2 (1F1B, and interleaved with selective recomputation;
    PP=2 × DP=2 under FSDP runs in the FSDP job): each stage's blocks compiled in place
    give the compiled single process's losses and grad norms, whole checkpoint tensors,
    and resume exactly."""
    cases = {
        "pp2-compiled": settings(shards, {**CASES["pp2"], **COMPILED}),
        "pp2-interleaved-compiled": settings(
            shards, {**CASES["pp2-interleaved-selective"], **COMPILED}
        ),
    }
    runs = run_worker(tmp_path, WORLD, cases=cases)
    for case in cases:
        name = layout(case)
        assert_metrics_match(metrics(runs / case), metrics(compiled_reference), name)
        assert_whole_checkpoint(runs / case, compiled_reference, name)
        assert_resume_exact(runs / case, runs / f"{case}-resumed", name)


@pytest.mark.slow
def test_tensor_pipeline_data_parallel_matches_one_process(
    shards: Path, reference: Path, tmp_path: Path
) -> None:
    """TP=2 × PP=2 × DP=2 (8 processes) with sequence parallelism, with the distributed
    optimizer and with FSDP over the stages (rows of each rank's TP shard); and a
    mixture of experts with TP=2 + SP × EP=2 (of DP=2) × PP=2, each TP rank's EP group
    exchanging its sequence shard's tokens inside the stages: losses, grad norms, whole
    checkpoint tensors, an exact resume, the package's logits."""
    extra = {
        "parallel.tensor": 2,
        "parallel.pipeline": 2,
        "parallel.sequence_parallel": "true",
    }
    modes = {"tp2-pp2-dp2": "distributed_optimizer", "tp2-pp2-dp2-fsdp": "fsdp"}
    cases = {
        case: settings(shards, {**extra, "parallel.data_parallel_mode": mode})
        for case, mode in modes.items()
    }
    cases["tp2-pp2-ep2-moe"] = settings(shards, {**extra, **MOE, "parallel.expert": 2})
    runs = run_worker(tmp_path, 8, cases=cases)
    for case, mode in modes.items():
        name = layout(f"TP=2 x PP=2 x DP=2 {mode}", 8)
        assert_metrics_match(metrics(runs / case), metrics(reference), name)
        assert_resume_exact(runs / case, runs / f"{case}-resumed", name)
        assert_whole_checkpoint(runs / case, reference, name)
        assert_package_logits_match(runs / case, reference, name)
    moe = fit_one_process(settings(shards, MOE), tmp_path / "moe-reference")
    name = layout("MoE, TP=2 + SP x EP=2 x PP=2 (DP=2)", 8)
    assert_metrics_match(metrics(runs / "tp2-pp2-ep2-moe"), metrics(moe), name)
    assert_resume_exact(runs / "tp2-pp2-ep2-moe", runs / "tp2-pp2-ep2-moe-resumed", name)
    assert_whole_checkpoint(runs / "tp2-pp2-ep2-moe", moe, name)
    assert_package_logits_match(runs / "tp2-pp2-ep2-moe", moe, name)


# --- the layer split, the bubble and what is refused ----------------------------------------


def test_even_split_and_megatron_chunk_assignment() -> None:
    counts = layer_counts(8, pp=2, vpp=2)
    assert counts == [2, 2, 2, 2]
    ranges = stage_layers(counts)
    # Chunk c of rank r is virtual stage c * pp + r.
    assert virtual_stages_of(0, 2, 2) == [0, 2] and virtual_stages_of(1, 2, 2) == [1, 3]
    assert [list(ranges[s]) for s in virtual_stages_of(0, 2, 2)] == [[0, 1], [4, 5]]
    assert [list(ranges[s]) for s in virtual_stages_of(1, 2, 2)] == [[2, 3], [6, 7]]
    assert owner_of_parameter("layers.5.mlp.fc2.weight", counts, 2) == 0
    assert owner_of_parameter("layers.6.mlp.fc2.weight", counts, 2) == 1
    assert owner_of_parameter("embedding.word.weight", counts, 2) == 0
    assert owner_of_parameter("output.weight", counts, 2) == 1
    assert owner_of_parameter("final_norm.weight", counts, 2) == 1


def test_balanced_and_explicit_splits() -> None:
    # Embedding and output head count as a layer each: (6 + 2) / 4 = 2 per stage.
    assert layer_counts(6, pp=4, vpp=1, split="balanced") == [1, 2, 2, 1]
    assert layer_counts(10, pp=2, vpp=2, split="balanced") == [2, 3, 3, 2]
    assert layer_counts(4, pp=2, vpp=1, split=[1, 3]) == [1, 3]
    with pytest.raises(ValueError, match="sum to 5, num_layers is 4"):
        layer_counts(4, pp=2, vpp=1, split=[2, 3])
    with pytest.raises(ValueError, match="3 entries, needs pipeline 2 · virtual_pipeline 1"):
        layer_counts(4, pp=2, vpp=1, split=[1, 1, 2])
    with pytest.raises(ValueError, match="without layers"):
        layer_counts(4, pp=2, vpp=1, split=[0, 4])
    with pytest.raises(ValueError, match="balanced: num_layers 5 \\+ 2"):
        layer_counts(5, pp=2, vpp=1, split="balanced")


def test_schedules_need_enough_micro_batches(shards: Path) -> None:
    # global 8 / (micro 2 · data 2) = 2 micro-batches per step.
    few = {**settings(shards), "parallel.pipeline": 4}
    with pytest.raises(
        ParallelLayoutError, match="2 micro-batches per step .* fewer than pipeline 4"
    ):
        validate_layout(config_of(few), 8)
    interleaved = {**settings(shards), **INTERLEAVED, "training.global_batch_size": 6}
    with pytest.raises(
        ParallelLayoutError, match="3 micro-batches .* not a multiple of pipeline 2"
    ):
        validate_layout(config_of(interleaved), 2)
    # Zero bubble needs at least one micro-batch per stage too (2 < pipeline 4).
    zero_bubble = {**few, "parallel.pipeline_schedule": "zero-bubble"}
    with pytest.raises(ParallelLayoutError, match="do not suit pipeline_schedule zero-bubble"):
        validate_layout(config_of(zero_bubble), 8)


def test_bubble_fraction() -> None:
    assert bubble_fraction(pp=4, vpp=1, micro_batches=8) == pytest.approx(3 / 8)
    assert bubble_fraction(pp=4, vpp=2, micro_batches=8) == pytest.approx(3 / 16)
    assert bubble_fraction(pp=1, vpp=1, micro_batches=8) == 0.0


def test_layout_validation_names_the_split(shards: Path) -> None:
    config = config_of(
        {**settings(shards), "parallel.pipeline": 2, "parallel.pipeline_layers": "[1,2]"}
    )
    with pytest.raises(
        ParallelLayoutError, match=r"pipeline_layers \[1, 2\] sum to 3, num_layers is 4"
    ):
        validate_layout(config, 2)
    # Ignored without pipeline parallelism, so the same config resumes at PP=1.
    validate_layout(config_of({**settings(shards), "parallel.pipeline_layers": "[1,2]"}), 1)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {
                "training.compile": "true",
                **INTERLEAVED,
                "parallel.pipeline_schedule": "zero-bubble",
            },
            "training.compile with parallel.pipeline_schedule=zero-bubble",
        ),
    ],
)
def test_what_pipeline_parallelism_refuses(shards: Path, values: dict, message: str) -> None:
    config = config_of({**settings(shards), "parallel.pipeline": 2, **values})
    with pytest.raises(MegalithError, match=message):
        check_trainer_support(config, ParallelSizes(pp=2, dp=2))


@pytest.mark.slow
def test_fsdp_over_pipeline_stages_matches_one_process(
    shards: Path, reference: Path, compiled_reference: Path, tmp_path: Path
) -> None:
    """PP=2 × DP=2 with FSDP (4 processes): 1F1B, interleaved with selective
    recomputation, zero bubble with full recomputation, compiled stages, bf16 with an
    untied head, mixture-of-experts blocks and float8 linears (each against one process of
    its settings); and PP=2 × CP=2, FSDP over the context-parallel ranks. Each stage's
    blocks and chunks are sharded over the data-parallel ranks, gradients reduce-scattered
    once a step, the tied embedding's rows summed over its two stages. Losses, validation
    losses and grad norms, whole checkpoint tensors (sharded rows reassembled), an exact
    resume and the package's logits equal one process's."""
    fsdp = {"parallel.pipeline": 2, "parallel.data_parallel_mode": "fsdp"}
    cases = {
        "pp2-dp2-fsdp": settings(shards, fsdp),
        "pp2-dp2-fsdp-interleaved": settings(
            shards, {**CASES["pp2-interleaved-selective"], **fsdp}
        ),
        "pp2-dp2-fsdp-zero-bubble": settings(shards, {**CASES["pp2-zero-bubble-v2"], **fsdp}),
        "pp2-dp2-fsdp-compiled": settings(shards, {**fsdp, **COMPILED}),
        "pp2-dp2-fsdp-bf16-untied": settings(shards, {**fsdp, **BF16_UNTIED}),
        "pp2-dp2-fsdp-moe": settings(shards, {**fsdp, **MOE}),
        "pp2-dp2-fsdp-fp8": settings(shards, {**fsdp, **FP8}),
        "pp2-cp2-fsdp": settings(shards, {**fsdp, "parallel.context": 2}),
    }
    for case, values in cases.items():
        sizes = ParallelSizes(pp=2, cp=2) if "cp2" in case else ParallelSizes(pp=2, dp=2)
        check_trainer_support(config_of(values), sizes)
    (tmp_path / "runs").mkdir()
    runs = run_worker(tmp_path / "runs", 4, cases=cases)
    references = {
        name: fit_one_process(settings(shards, values), tmp_path / name)
        for name, values in (("bf16", BF16_UNTIED), ("moe", MOE), ("fp8", FP8))
    }
    references["compiled"] = compiled_reference
    for case in cases:
        name = layout(case, 4)
        one = next((references[k] for k in references if k in case), reference)
        assert_metrics_match(metrics(runs / case), metrics(one), name)
        assert_whole_checkpoint(runs / case, one, name)
        assert_resume_exact(runs / case, runs / f"{case}-resumed", name)
        assert_package_logits_match(runs / case, one, name)
        ran = last_checkpoint_state(runs / case)["layout"]
        want = (2, 1, 2) if "cp2" in case else (2, 2, 1)
        assert (ran["parallel.pipeline"], ran["parallel.data"], ran["parallel.context"]) == want
        assert_saved_in_row_halves(runs / case, name)  # over data x context


@pytest.mark.slow
def test_pipeline_with_context_parallelism_matches_one_process(
    shards: Path, reference: Path, tmp_path: Path
) -> None:
    """PP=2 × CP=2 (4 processes): each CP rank sends its load-balanced part of every
    sequence through the stages, with that part's positions; losses, grad norms and
    validation losses, whole checkpoint tensors and an exact resume equal one process's."""
    case = "pp2-cp2"
    extra = {"parallel.pipeline": 2, "parallel.context": 2}
    check_trainer_support(config_of(settings(shards, extra)), ParallelSizes(pp=2, cp=2))
    runs = run_worker(tmp_path, 4, cases={case: settings(shards, extra)})
    name = layout("PP=2 x CP=2", 4)
    assert_metrics_match(metrics(runs / case), metrics(reference), name)
    assert_whole_checkpoint(runs / case, reference, name)
    assert_resume_exact(runs / case, runs / f"{case}-resumed", name)
