"""The memory report (training/memory/estimate.py) against real tensors, and the planner and CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megalith.config import load_config
from pipelines.cli import main
from training.memory.estimate import (
    MemoryPlanError,
    memory_report,
    plan,
    resolve_layout,
    static_memory,
    usable_bytes,
)
from training.models import GPTModel
from training.models.moe import is_expert_param
from training.optim.adamw import build_optimizer
from training.parallel.tensor_parallel.sharding import shard_full_state_dict

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny-cpu.yaml"
LLAMA_1B = REPO / "configs" / "llama-1b.yaml"
GIB = 1024**3


def tiny(*sets: str):
    return load_config(TINY, ["mixed_precision.dtype=fp32", "model.backend=torch", *sets])


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.fixture(scope="module")
def stepped():
    """A real tiny model and its AdamW after one training step on CPU."""
    config = tiny("model.tie_embeddings=false")
    torch.manual_seed(0)
    model = GPTModel(config.model)
    optimizer, _ = build_optimizer(model, config.optimizer, torch.device("cpu"))
    tokens = torch.randint(0, config.model.vocab_size, (2, 16))
    model(tokens, labels=tokens).backward()
    optimizer.step()
    return config, model, optimizer


def test_static_bytes_equal_the_real_model_and_optimizer(stepped):
    config, model, optimizer = stepped
    estimate = static_memory(config, resolve_layout(config, 1))
    params = [p for _, p in model.named_parameters()]
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    assert estimate.parameters == tensor_bytes(params)
    assert estimate.gradients == tensor_bytes(p.grad for p in params)
    assert estimate.optimizer == tensor_bytes(state), "AdamW moments + step tensors"
    assert estimate.weight_copies == 0 and estimate.buffers == 0  # fp32, one process


def test_tied_embedding_is_counted_once():
    config = tiny()  # tie_embeddings: true
    model = GPTModel(config.model)
    estimate = static_memory(config, resolve_layout(config, 1))
    assert estimate.parameters == tensor_bytes(model.parameters())


def test_tensor_parallel_shards_match_the_real_split():
    config = tiny("parallel.tensor=2")
    model = GPTModel(config.model)
    estimate = static_memory(config, resolve_layout(config, 2))
    for rank in range(2):
        shard = shard_full_state_dict(model.state_dict(), config.model, rank, 2)
        # state_dict lists a tied output head twice; the rank holds it once
        unique = {k: v for k, v in shard.items() if k != "output.weight"}
        assert estimate.parameters == tensor_bytes(unique.values()), f"TP rank {rank}"


def test_fsdp_and_distributed_optimizer_shard_over_data_parallel(stepped):
    config, model, optimizer = stepped
    whole = static_memory(config, resolve_layout(config, 1))
    dp4 = ("model.tie_embeddings=false", "training.global_batch_size=32")
    fsdp = tiny(*dp4, "parallel.data_parallel_mode=fsdp")
    sharded = static_memory(fsdp, resolve_layout(fsdp, 4))
    # FSDP2 Shard(0): rank 0 holds torch.chunk's first rows of every parameter
    rows = [p.chunk(4, 0)[0] for p in model.parameters()]
    assert sharded.parameters == sharded.gradients == tensor_bytes(rows)
    assert sharded.optimizer == 2 * tensor_bytes(rows) + 4 * len(rows)
    zero1 = tiny(*dp4, "parallel.data_parallel_mode=distributed_optimizer")
    owner = static_memory(zero1, resolve_layout(zero1, 4))
    assert owner.parameters == whole.parameters and owner.gradients == whole.gradients
    largest = max(p.numel() for p in model.parameters()) * 8
    assert whole.optimizer / 4 <= owner.optimizer <= whole.optimizer / 4 + largest
    assert owner.buffers == whole.gradients  # DDP buckets


def test_fsdp_over_pipeline_stages_holds_the_whole_stage_gathered_until_the_reduction():
    """torch's PipelineStage leaves each micro-batch's backward unsharded and unreduced,
    so a stage's gathered parameters and their gradients stay until the step's one
    reduce-scatter: FSDP's buffers are two whole copies of the stage, not three units."""
    stage = load_config(LLAMA_1B, ["parallel.pipeline=2"])
    whole = static_memory(stage, resolve_layout(stage, 2))
    fsdp = load_config(LLAMA_1B, ["parallel.pipeline=2", "parallel.data_parallel_mode=fsdp"])
    sharded = static_memory(fsdp, resolve_layout(fsdp, 4))
    assert sharded.buffers == 2 * whole.parameters
    assert sharded.parameters == pytest.approx(whole.parameters / 2, rel=1e-3)


def test_fsdp_with_expert_parallelism_splits_experts_over_their_expert_data_ranks():
    """EP=2 inside DP=4 under FSDP: dense rows over the 4 data ranks, each EP rank's
    experts over its 2 expert-data ranks (as expert_parallel_training.shard_experts)."""
    sets = [
        "parallel.expert=2",
        "parallel.data_parallel_mode=fsdp",
        "training.global_batch_size=32",
    ]
    config = load_config(REPO / "configs" / "moe-tiny-cpu.yaml", sets)
    model = GPTModel(config.model)
    expected = sum(
        p.numel() / (2 * 2) if is_expert_param(name) else p.numel() / 4
        for name, p in model.named_parameters()
    )
    sharded = static_memory(config, resolve_layout(config, 4))
    assert sharded.params == pytest.approx(expected, rel=1e-3)


def test_activations_order_and_linearity():
    config = load_config(LLAMA_1B)
    sizes = resolve_layout(config, 1)
    acts = {
        mode: memory_report(config, sizes, micro_batch_size=2, recompute=mode).activations
        for mode in ("none", "selective", "full")
    }
    assert acts["none"] > acts["selective"] > acts["full"], acts
    one = memory_report(config, sizes, micro_batch_size=1, recompute="none")
    four = memory_report(config, sizes, micro_batch_size=4, recompute="none")
    assert abs(four.activations - 4 * one.activations) <= 4, (one.activations, four.activations)
    assert four.loss_buffer == 4 * one.loss_buffer
    sp = load_config(LLAMA_1B, ["parallel.tensor=2", "parallel.sequence_parallel=true"])
    halved = memory_report(sp, resolve_layout(sp, 2), micro_batch_size=4, recompute="none")
    assert abs(halved.activations - four.activations / 2) <= 4, "SP divides everything by TP"


def test_an_fp32_residual_stream_costs_two_more_bytes_per_norm_input():
    """The norm inputs a layer keeps (two per block, hidden wide, no recomputation) are the
    residual stream's: 2 bytes each in bf16 (the default), 4 with model.fp32_residual."""
    bf16 = load_config(LLAMA_1B)
    fp32 = load_config(LLAMA_1B, ["model.fp32_residual=true"])
    sizes = resolve_layout(bf16, 1)
    extra = (
        memory_report(fp32, sizes, micro_batch_size=1, recompute="none").activations
        - memory_report(bf16, sizes, micro_batch_size=1, recompute="none").activations
    )
    m = bf16.model
    assert abs(extra - 2 * 2 * m.hidden_size * bf16.data.seq_length * m.num_layers) <= 4, extra


def test_chunked_loss_holds_one_chunk_of_logits():
    """model.loss_chunk_tokens: one chunk's bf16 + fp32 logits and the fp32 output-weight
    gradient, instead of every token's logits (10 bytes each in bf16)."""
    plain = load_config(LLAMA_1B)
    chunked = load_config(LLAMA_1B, ["model.loss_chunk_tokens=4096"])
    sizes = resolve_layout(plain, 1)
    whole = memory_report(plain, sizes, micro_batch_size=8, recompute="none").loss_buffer
    fused = memory_report(chunked, sizes, micro_batch_size=8, recompute="none").loss_buffer
    vocab, hidden = plain.model.vocab_size, plain.model.hidden_size
    assert whole == 8 * 2048 * vocab * 10
    assert fused == 4096 * vocab * 6 + vocab * hidden * 4


@pytest.mark.parametrize("gib", [80, 24])
def test_planner_choice_fits_and_one_more_does_not(gib):
    config = load_config(LLAMA_1B)
    sizes = resolve_layout(config, 1)
    result = plan(config, sizes, gib * GIB)
    budget = usable_bytes(gib * GIB)
    assert result.recompute is not None, result.reason
    for mode, largest in result.largest.items():
        at = (
            0
            if largest == 0
            else memory_report(config, sizes, micro_batch_size=largest, recompute=mode).total
        )
        above = memory_report(config, sizes, micro_batch_size=largest + 1, recompute=mode).total
        assert at <= budget < above, (mode, largest, at, budget, above)
    chosen = memory_report(
        config, sizes, micro_batch_size=result.micro_batch_size, recompute=result.recompute
    )
    assert chosen.total <= budget
    if gib == 80:  # the 1B recipe's micro-batch 8 fits without recomputation
        assert (result.recompute, result.micro_batch_size) == ("none", 8)
    else:
        assert result.recompute != "none"


def test_cli_prints_the_table_and_json(capsys):
    assert main(["memory", "--config", str(LLAMA_1B), "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    for row in ("parameters", "gradients", "optimizer state", "activations", "total"):
        assert row in out, out
    assert "recommended: model.activation_checkpointing=none" in out
    argv = ["memory", "--config", str(LLAMA_1B), "--gpu-memory-gib", "80", "--json"]
    argv += ["--nproc-per-node", "4", "--set", "parallel.tensor=2"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["layout"]["dp"] == 2 and data["layout"]["tp"] == 2
    assert data["report"]["total"] > 0 and data["plan"]["largest"]["full"] > 0


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--gpu-memory-gib", "0"], "--gpu-memory-gib"),
        (["--gpu-memory-gib", "80", "--nproc-per-node", "3", "--set", "parallel.tensor=2"],
         "--nproc-per-node"),
    ],
)  # fmt: skip
def test_bad_input_is_a_clear_error(capsys, extra, named):
    assert main(["memory", "--config", str(LLAMA_1B), *extra]) == 1
    err = capsys.readouterr().err
    assert named in err, err


def test_layout_error_names_the_keys():
    config = load_config(LLAMA_1B, ["parallel.tensor=2"])
    with pytest.raises(
        MemoryPlanError, match="(?s)parallel.tensor 2.*world size 3 is not divisible"
    ):
        resolve_layout(config, 3)
