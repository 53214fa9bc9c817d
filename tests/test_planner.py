"""The layout planner (training/planning/): memory against the memory planner, FLOPs
against training/models/flops.py, its invariants, refusals and the CLI."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from megalith.config import load_config
from pipelines.cli import main
from training.memory.estimate import memory_report, resolve_layout
from training.models.flops import flops_per_token
from training.parallel.groups import ParallelSizes
from training.parallel.support import check_trainer_support
from training.planning.hardware import gpu_kind
from training.planning.layout import (
    Cluster,
    Layout,
    PlanError,
    SearchSpace,
    Shapes,
    memory,
    predict,
    search,
    step_time,
)

REPO = Path(__file__).resolve().parents[1]
LLAMA_1B = REPO / "configs" / "llama-1b.yaml"
MOE = REPO / "configs" / "moe-8x350m.yaml"
GIB = 1024**3
H100_NODE = Cluster(gpu_kind("h100"), 8, 8, 400.0)


@pytest.fixture(scope="module")
def llama():
    return load_config(LLAMA_1B)


def big(layers: int = 80):
    """A 70B-class shape (hidden 8192, 64 heads, 8 KV groups)."""
    return load_config(
        LLAMA_1B,
        [
            f"model.num_layers={layers}",
            "model.hidden_size=8192",
            "model.num_attention_heads=64",
            "model.ffn_hidden_size=28672",
        ],
    )


@pytest.mark.parametrize(
    "sets",
    [
        [],
        ["parallel.tensor=2", "parallel.sequence_parallel=true"],
        ["parallel.pipeline=2"],
        ["parallel.tensor=2", "parallel.pipeline=2"],
        ["model.activation_checkpointing=full", "parallel.tensor=4"],
    ],
)
def test_memory_per_gpu_is_the_memory_planners(sets):
    """The planner's arithmetic reproduces training.memory.estimate (real meta model)."""
    config = load_config(LLAMA_1B, sets)
    world = config.parallel.tensor * config.parallel.pipeline
    sizes = resolve_layout(config, world)
    expected = memory_report(config, sizes).total
    layout = Layout(
        tp=sizes.tp,
        cp=1,
        pp=sizes.pp,
        dp=1,
        sequence_parallel=config.parallel.sequence_parallel,
        recompute=config.model.activation_checkpointing,
        micro_batch_size=config.training.micro_batch_size,
    )
    m = config.training.global_batch_size // config.training.micro_batch_size
    planned = memory(config, Shapes.of(config, config.data.seq_length), layout, m).total
    assert planned == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("mode", ["distributed_optimizer", "fsdp"])
def test_expert_parallel_sharded_memory_is_the_memory_planners(mode):
    """EP=2 inside DP=4: ZeRO-1 and FSDP split the experts over their 2 expert-data
    ranks, the dense weights over all 4; the planner's rows reproduce training.memory."""
    config = load_config(MOE, ["parallel.expert=2", f"parallel.data_parallel_mode={mode}"])
    sizes = resolve_layout(config, 4)
    assert (sizes.dp, sizes.ep) == (4, 2)
    expected = memory_report(config, sizes)
    layout = Layout(
        tp=1,
        cp=1,
        pp=1,
        dp=4,
        ep=2,
        data_parallel_mode=mode,
        recompute=config.model.activation_checkpointing,
        micro_batch_size=config.training.micro_batch_size,
    )
    m = config.training.global_batch_size // (config.training.micro_batch_size * 4)
    planned = memory(config, Shapes.of(config, config.data.seq_length), layout, m)
    assert planned.optimizer == pytest.approx(expected.static.optimizer, rel=0.02)
    assert planned.parameters == pytest.approx(expected.static.parameters, rel=0.02)


def test_fsdp_over_pipeline_stages_memory_is_the_memory_planners():
    """FSDP over stages (PP=2 × DP=2), which the search now proposes: the planner's
    per-stage rows, divided over the data-parallel ranks, reproduce training.memory."""
    config = load_config(LLAMA_1B, ["parallel.pipeline=2", "parallel.data_parallel_mode=fsdp"])
    sizes = resolve_layout(config, 4)
    assert (sizes.pp, sizes.dp) == (2, 2)
    expected = memory_report(config, sizes).total
    layout = Layout(
        tp=1,
        cp=1,
        pp=2,
        dp=2,
        data_parallel_mode="fsdp",
        recompute=config.model.activation_checkpointing,
        micro_batch_size=config.training.micro_batch_size,
    )
    m = config.training.global_batch_size // (config.training.micro_batch_size * 2)
    planned = memory(config, Shapes.of(config, config.data.seq_length), layout, m).total
    assert planned == pytest.approx(expected, rel=0.02)
    ddp = memory(config, Shapes.of(config, config.data.seq_length), Layout(
        tp=1, cp=1, pp=2, dp=2, recompute=layout.recompute,
        micro_batch_size=layout.micro_batch_size,
    ), m).total  # fmt: skip
    assert planned < ddp


@pytest.mark.parametrize("recipe", [LLAMA_1B, MOE])
def test_flops_per_token_is_flops_module(recipe):
    config = load_config(recipe)
    shapes = Shapes.of(config, config.data.seq_length)
    assert shapes.flops_per_token() == flops_per_token(
        config.model, config.data.seq_length, include_output_head=True
    )


def test_more_tensor_parallelism_lowers_memory_per_gpu():
    config = big()
    shapes = Shapes.of(config, 4096)
    totals = [
        memory(config, shapes, Layout(tp, 1, 4, 1, sequence_parallel=tp > 1), 32).total
        for tp in (1, 2, 4, 8)
    ]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


def test_more_expert_parallelism_lowers_memory_per_gpu():
    config = load_config(MOE)
    shapes = Shapes.of(config, 2048)
    totals = [memory(config, shapes, Layout(1, 1, 1, 8, ep=ep), 32).total for ep in (1, 2, 4, 8)]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4


@pytest.mark.parametrize("pp,vpp,m", [(2, 1, 8), (4, 1, 16), (8, 1, 64)])
def test_pipeline_bubble_is_p_minus_1_over_m(llama, pp, vpp, m):
    shapes = Shapes.of(llama, 2048)
    layout = Layout(1, 1, pp, 1, vpp=vpp, micro_batch_size=1)
    time, micro_batches = step_time(shapes, layout, replace(H100_NODE, gpus=pp), global_batch=m)
    assert micro_batches == m
    assert time.pipeline_bubble / time.compute == pytest.approx((pp - 1) / (vpp * m))


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 8), (4, 2, 16), (2, 4, 16)])
def test_an_interleaved_bubble_runs_at_the_slowest_virtual_stages_pace(llama, pp, vpp, m):
    """Interleaved, the last virtual stage also holds the output layer: the bubble is
    (p - 1)/(v·m) of the step at that stage's pace, more than at the mean stage's, and the
    same as theory once the output layer costs nothing."""
    shapes = Shapes.of(llama, 2048)
    layout = Layout(1, 1, pp, 1, vpp=vpp, micro_batch_size=1)
    cluster = replace(H100_NODE, gpus=pp)
    theory = (pp - 1) / (vpp * m)
    time, _ = step_time(shapes, layout, cluster, global_batch=m)
    assert time.pipeline_bubble / time.compute > 1.05 * theory
    headless, _ = step_time(replace(shapes, vocab=0), layout, cluster, global_batch=m)
    assert headless.pipeline_bubble / headless.compute == pytest.approx(theory)


def test_data_parallel_scaling_never_exceeds_linear(llama):
    shapes = Shapes.of(llama, 2048)
    per_replica = 64  # sequences per replica per step: weak scaling
    one = predict(llama, shapes, Layout(1, 1, 1, 1, micro_batch_size=8), H100_NODE, per_replica)
    for dp in (2, 8, 64, 1024):
        cluster = replace(H100_NODE, gpus=dp)
        layout = Layout(1, 1, 1, dp, micro_batch_size=8)
        many = predict(llama, shapes, layout, cluster, per_replica * dp)
        assert many.tokens_per_s <= dp * one.tokens_per_s
        assert many.tokens_per_s > 0.5 * dp * one.tokens_per_s  # and DP stays useful


def test_search_refuses_what_does_not_fit_and_names_why():
    config = big()
    result = search(config, H100_NODE, global_batch=64, seq=4096)
    assert result.best == [] and result.refused  # 70B on one node of 80 GB GPUs
    reason = result.refused[0].reason
    assert reason.startswith("out of memory: needs ") and "usable on h100" in reason
    assert result.refused_by_reason == {"out of memory": result.considered}

    bigger = search(config, replace(H100_NODE, gpus=64), global_batch=64, seq=4096, top=3)
    assert len(bigger.best) == 3
    assert all(p.memory.total <= bigger.usable_bytes for p in bigger.best)
    assert all(r.needed_bytes > bigger.usable_bytes for r in bigger.refused)
    speeds = [p.tokens_per_s for p in bigger.best]
    assert speeds == sorted(speeds, reverse=True)
    sizes = [
        (p.layout.tp, p.layout.cp, p.layout.pp, p.layout.dp, p.layout.vpp) for p in bigger.best
    ]
    assert len(set(sizes)) == len(sizes), "one row per set of parallel sizes"


def test_the_plan_never_proposes_what_the_trainer_refuses():
    """An MoE recipe with async TP on a node: the trainer refuses async TP without tensor
    parallelism (training.parallel.support), so the search lists those layouts as refused
    with the trainer's reason and ranks only what trains (MoE under TP + SP included)."""
    config = load_config(MOE, ["parallel.async_tensor_parallel=true", "training.compile=true"])
    result = search(config, H100_NODE, global_batch=64, seq=2048, top=50)
    assert result.best and all(p.layout.tp > 1 for p in result.best)
    for prediction in result.best:
        lo = prediction.layout
        sizes = ParallelSizes(tp=lo.tp, cp=lo.cp, pp=lo.pp, dp=lo.dp, ep=lo.ep, vpp=lo.vpp)
        trained = load_config(MOE, lo.overrides())
        trained.parallel.async_tensor_parallel, trained.training.compile = True, True
        check_trainer_support(trained, sizes)  # raises if the trainer would refuse it
    reasons = [r.reason for r in result.refused if r.reason.startswith("the trainer refuses")]
    assert any("async_tensor_parallel needs parallel.tensor > 1" in r for r in reasons), reasons[:3]


def test_pinned_search_space_keeps_the_pinned_sizes(llama):
    space = SearchSpace(tp=(2,), pp=(2,), cp=(1,))
    result = search(llama, H100_NODE, global_batch=256, seq=2048, top=4, space=space)
    assert result.best and all(
        (p.layout.tp, p.layout.pp, p.layout.dp) == (2, 2, 2) for p in result.best
    )


def test_cli_prints_a_table_and_json(capsys):
    argv = ["plan", "--model", str(LLAMA_1B), "--gpus", "16", "--gpu", "h100", "--top", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "16 x h100 (2 node(s) of 8" in lines[0]
    assert lines[1].split()[:3] == ["#", "layout", "dp"]
    assert [line.split()[0] for line in lines[2:5]] == ["1", "2", "3"]
    assert lines[5].startswith("train the first: --set parallel.tensor=")
    # What it prints is a layout the trainer accepts with this recipe (compile included).
    sets = [arg for arg in lines[5].removeprefix("train the first:").split() if arg != "--set"]
    planned = load_config(LLAMA_1B, sets)
    sizes = planned.parallel
    tp, cp, pp = sizes.tensor, sizes.context, sizes.pipeline
    check_trainer_support(planned, ParallelSizes(tp=tp, cp=cp, pp=pp, dp=16 // (tp * cp * pp)))

    assert main([*argv, "--json", "--nodes", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"]["gpus_per_node"] == 4 and len(data["best"]) == 3
    first = data["best"][0]
    assert 0 < first["mfu"] < 1 and first["memory_gib"]["total"] < data["usable_gib"]
    assert first["tokens_per_s"] == pytest.approx(
        data["global_batch"] * data["seq"] / first["step_time_s"]["total"]
    )


def test_cli_says_why_nothing_fits(capsys):
    shape = [
        "model.num_layers=80",
        "model.hidden_size=8192",
        "model.num_attention_heads=64",
        "model.ffn_hidden_size=28672",
    ]
    sets = [arg for value in shape for arg in ("--set", value)]
    argv = [
        "plan",
        "--model",
        str(LLAMA_1B),
        "--gpus",
        "8",
        "--seq",
        "4096",
        "--global-batch",
        "64",
    ]
    argv += sets
    assert main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "no layout fits; the closest:"
    closest = lines[2:5]
    assert all("out of memory: needs " in line and "usable on h100" in line for line in closest)
    assert len(set(closest)) == 3


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "configs/nope.yaml", "--gpus", "8"], "nope.yaml"),
        (["--model", str(LLAMA_1B), "--gpus", "12"], "not a whole number of nodes"),
        (["--model", str(LLAMA_1B), "--gpus", "7"], "no layout of 7 GPUs"),
        (["--model", str(LLAMA_1B), "--gpus", "8", "--gpu", "v100"], "unknown GPU kind"),
        (["--model", str(LLAMA_1B), "--gpus", "16", "--nodes", "3"], "does not split evenly"),
        (["--model", "configs/t5-base.yaml", "--gpus", "8"], "model.family 't5'"),
    ],
)
def test_impossible_requests_fail_with_one_line(capsys, args, message):
    assert main(["plan", *args]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_plan_error_is_a_megalith_error():
    with pytest.raises(PlanError, match="--gpus must be >= 1"):
        search(load_config(LLAMA_1B), replace(H100_NODE, gpus=0), global_batch=8, seq=2048)
