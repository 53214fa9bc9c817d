"""Context parallelism against one process.

Unit checks: the load-balanced split and its inverse; then two processes (gloo, file
rendezvous) run the CP attention and the whole model on their parts of the sequence
and compare with the single-device computation: attention output and the gradients
of q, k, v (GQA: 4 heads, 2 KV groups); the model's loss and the gradients of one
backward, averaged over CP as DDP does (this checks the loss scaling), for a Llama
(RoPE) and a GPT-2 (learned positions) model, and with full activation checkpointing.

Trainer checks (``Trainer.fit``, gloo via torchrun, or NCCL with
MEGALITH_TEST_DEVICE=cuda): CP=2 (ddp), CP=2 with selective activation checkpointing
(distributed_optimizer) and TP=2 × CP=2 (4 processes) against the single-process run
of the same config: losses, validation losses and grad norms per step, the whole
weights and AdamW moments of the last checkpoint, and an exact resume from step 2.
A slow test runs CP=2 under FSDP2 and TP=2 × CP=2 with sequence parallelism likewise.

Tolerances (fp32): attention outputs and q/k/v gradients rtol 1e-5 / atol 1e-6; model
losses rtol/atol 1e-5 and gradients rtol 1e-4 / atol 1e-6 (CP sums the loss and the
key gradients in another order). Trainer: as the TP parity tests (losses within 1e-5,
grad norms 1e-4 relative, tensors rtol 1e-4 / atol 1e-5).
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from parallel_helpers import (
    BACKEND,
    RECIPE,
    STEPS,
    assert_metrics_match,
    assert_resume_exact,
    assert_whole_checkpoint,
    fit_one_process,
    init_gloo,
    metrics,
    mismatch,
    run_trainer_worker,
    trainer_settings,
)

from megalith.config import ModelConfig, load_config
from megalith.errors import MegalithError
from training.models import GPTModel, TorchBackend
from training.models.layers import SDPAttention
from training.parallel import context_parallel as cp
from training.parallel.groups import ParallelLayoutError, ParallelSizes, validate_layout

CP = 2
SEQ = 16
VOCAB = 96
ATTENTION_TOL = {"rtol": 1e-5, "atol": 1e-6}
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL = {"rtol": 1e-4, "atol": 1e-6}
MODELS = {
    "llama": {"style": "llama", "num_query_groups": 2},
    "gpt2": {"style": "gpt2"},
    "llama+full-ckpt": {
        "style": "llama",
        "num_query_groups": 2,
        "activation_checkpointing": "full",
    },
}


# --- the split, no processes -------------------------------------------------------------


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_split_holds_chunks_r_and_mirror_and_merge_inverts_it(cp_size: int) -> None:
    x = torch.arange(2 * 16).view(2, 16)
    parts = [cp.split_sequence(x, cp_size, r) for r in range(cp_size)]
    chunk = 16 // (2 * cp_size)
    for r, part in enumerate(parts):
        expected = cp.positions(16, cp_size, r)
        assert torch.equal(part[0], expected), f"cp={cp_size} rank {r}: wrong chunks"
        assert set(expected[:chunk].div(chunk, rounding_mode="floor").tolist()) == {r}
        assert set(expected[chunk:].div(chunk, rounding_mode="floor").tolist()) == {
            2 * cp_size - 1 - r
        }
    assert torch.equal(cp.merge_sequence(parts), x)


def test_indivisible_sequence_is_refused() -> None:
    with pytest.raises(MegalithError, match="not divisible by 2 · context 2 = 4"):
        cp.split_sequence(torch.zeros(1, 18), 2, 0)
    config = load_config(RECIPE, ["data.seq_length=18", "parallel.context=2"])
    with pytest.raises(
        ParallelLayoutError, match="seq_length 18 is not divisible by 2 · context 2"
    ):
        validate_layout(config, 2)
    assert validate_layout(load_config(RECIPE, ["parallel.context=2"]), 2) == ParallelSizes(cp=2)


# --- two processes ------------------------------------------------------------------------


def _check_attention(group: dist.ProcessGroup) -> list[str]:
    rank = dist.get_rank(group)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, SEQ, 4, 8, generator=generator, requires_grad=True)
    k = torch.randn(2, SEQ, 2, 8, generator=generator, requires_grad=True)
    v = torch.randn(2, SEQ, 2, 8, generator=generator, requires_grad=True)
    upstream = torch.randn(2, SEQ, 32, generator=generator)
    full = SDPAttention(4, 2, 8)
    expected = full(q, k, v)
    expected.backward(upstream)

    parts = [cp.split_sequence(t.detach(), CP, rank).requires_grad_() for t in (q, k, v)]
    attention = cp.ContextParallelAttention(SDPAttention(4, 2, 8), group)
    out = attention(*parts)
    out.backward(cp.split_sequence(upstream, CP, rank))
    where = f"CP={CP} attention (GQA 4 heads / 2 groups) rank {rank}"
    failures = mismatch(
        f"{where}: output", out, cp.split_sequence(expected, CP, rank), ATTENTION_TOL
    )
    for name, part, whole in zip("qkv", parts, (q, k, v), strict=True):
        failures += mismatch(
            f"{where}: gradient of {name}",
            part.grad,
            cp.split_sequence(whole.grad, CP, rank),
            ATTENTION_TOL,
        )
    return failures


class _State:
    """The two fields of ParallelState that micro_batch_loss reads."""

    def __init__(self, group: dist.ProcessGroup):
        self.sizes = ParallelSizes(cp=dist.get_world_size(group))
        self.cp_rank = dist.get_rank(group)


def _check_model(name: str, group: dist.ProcessGroup) -> list[str]:
    """The loss and the gradients of one backward, averaged over CP as DDP averages them."""
    rank = dist.get_rank(group)
    config = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        **MODELS[name],
    )
    torch.manual_seed(0)
    full = GPTModel(config, TorchBackend())
    model = GPTModel(config, cp.ContextParallelBackend(TorchBackend(), group))
    model.load_state_dict(full.state_dict())
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels[0, :5] = -100  # uneven across the ranks' chunks
    labels[1, -2:] = -100

    expected = full(tokens, labels)
    expected.backward()
    loss = cp.micro_batch_loss(model, tokens, labels, _State(group))
    loss.backward()
    where = f"CP={CP} {name} rank {rank}"
    reported = loss.detach().clone()
    dist.all_reduce(reported, group=group)
    failures = mismatch(f"{where}: loss (mean over CP)", reported / CP, expected.detach(), LOSS_TOL)
    full_grads = dict(full.named_parameters())
    for param_name, param in model.named_parameters():
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)  # what DDP does over data × context: sum / CP
        failures += mismatch(
            f"{where}: gradient of {param_name} after one step",
            grad / CP,
            full_grads[param_name].grad,
            GRAD_TOL,
        )
    return failures


def _worker(rank: int, world: int, out_dir: str) -> None:
    init_gloo(rank, world, out_dir)
    cases = {"attention": lambda: _check_attention(dist.group.WORLD)}
    for name in MODELS:
        cases[name] = lambda name=name: _check_model(name, dist.group.WORLD)
    results: dict[str, Any] = {}
    try:
        for name, case in cases.items():
            try:
                results[name] = case()
            except Exception:
                results[name] = [f"rank {rank} raised:\n{traceback.format_exc()}"]
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[str]]]:
    out_dir = tmp_path_factory.mktemp("context_parallel")
    mp.spawn(_worker, args=(CP, str(out_dir)), nprocs=CP, join=True)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(CP)]


def _failures(results: list[dict[str, list[str]]], case: str) -> str:
    return "\n".join(message for by_case in results for message in by_case[case])


def test_attention_output_and_grads_match_full_attention(results) -> None:
    assert not (failures := _failures(results, "attention")), failures


@pytest.mark.parametrize("model", MODELS)
def test_loss_and_one_step_gradients_match_unsharded(results, model: str) -> None:
    assert not (failures := _failures(results, model)), failures


# --- the trainer ----------------------------------------------------------------------------

CASES = {
    "cp2": {"parallel.context": 2},
    "cp2-selective": {
        "parallel.context": 2,
        "parallel.data_parallel_mode": "distributed_optimizer",
        "model.activation_checkpointing": "selective",
    },
}
TP_CP_CASES = {"tp2-cp2": {"parallel.tensor": 2, "parallel.context": 2}}


def run_worker(out: Path, cases: dict[str, dict[str, Any]], world: int) -> Path:
    return run_trainer_worker(out, cases, world, f"CP ({world} processes)")


@pytest.fixture(scope="module")
def cp_runs(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cases = {name: trainer_settings(shards, extra) for name, extra in CASES.items()}
    return run_worker(tmp_path_factory.mktemp("cp-runs"), cases, CP)


@pytest.fixture(scope="module")
def tp_cp_runs(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    cases = {name: trainer_settings(shards, extra) for name, extra in TP_CP_CASES.items()}
    return run_worker(tmp_path_factory.mktemp("tp-cp-runs"), cases, 4)


@pytest.fixture(scope="module")
def reference(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fit_one_process(trainer_settings(shards), tmp_path_factory.mktemp("cp-reference"))


def check_matches_one_process(runs: Path, case: str, reference: Path, world: int) -> None:
    layout = f"{case} ({BACKEND}, {world} processes)"
    got = metrics(runs / case)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert_metrics_match(got, metrics(reference), layout)
    assert_whole_checkpoint(runs / case, reference, layout)
    assert_resume_exact(runs / case, runs / f"{case}-resumed", layout)


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_trainer_matches_one_process(
    case: str, cp_runs: Path, reference: Path
) -> None:
    check_matches_one_process(cp_runs, case, reference, CP)


def test_tensor_times_context_parallel_trainer_matches_one_process(
    tp_cp_runs: Path, reference: Path
) -> None:
    check_matches_one_process(tp_cp_runs, "tp2-cp2", reference, 4)


@pytest.mark.slow
def test_context_parallel_with_fsdp_and_with_sequence_parallelism(
    shards: Path, reference: Path, tmp_path: Path
) -> None:
    """CP=2 under FSDP2 (2 processes) and TP=2 × CP=2 with sequence parallelism (4)."""
    fsdp = {"cp2-fsdp": {"parallel.context": 2, "parallel.data_parallel_mode": "fsdp"}}
    sp = {
        "tp2-cp2-sp": {
            "parallel.tensor": 2,
            "parallel.context": 2,
            "parallel.sequence_parallel": "true",
        }
    }
    for cases, world in ((fsdp, 2), (sp, 4)):
        out = tmp_path / f"world{world}"
        out.mkdir()
        runs = run_worker(out, {n: trainer_settings(shards, e) for n, e in cases.items()}, world)
        for name in cases:
            check_matches_one_process(runs, name, reference, world)
