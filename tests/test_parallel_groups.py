"""Rank layouts against Megatron's order, and every bad combination's message."""

from __future__ import annotations

import itertools
import re

import pytest

from megalith.config import MegalithConfig, ParallelConfig
from training.parallel.groups import (
    ParallelLayoutError,
    ParallelSizes,
    coords_of,
    derive_sizes,
    group_ranks,
    rank_of,
    single_process_state,
    validate_layout,
)


def megatron_groups(tp: int, cp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """Groups as Megatron's initialize_model_parallel enumerates them (order tp-cp-dp-pp)."""
    world = tp * cp * pp * dp
    per_stage = world // pp
    groups: dict[str, list[list[int]]] = {"tp": [], "pp": [], "dp": [], "cp": [], "dp_cp": []}
    for start in range(0, world, tp):
        groups["tp"].append(list(range(start, start + tp)))
    for i in range(per_stage):
        groups["pp"].append(list(range(i, world, per_stage)))
    for p in range(pp):
        base = p * per_stage
        for c in range(cp):
            for t in range(tp):
                groups["dp"].append([base + (d * cp + c) * tp + t for d in range(dp)])
        for d in range(dp):
            for t in range(tp):
                groups["cp"].append([base + (d * cp + c) * tp + t for c in range(cp)])
        for t in range(tp):
            groups["dp_cp"].append(list(range(base + t, base + per_stage, tp)))
    return {k: sorted(v) for k, v in groups.items()}


LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (2, 1, 4, 2), (1, 2, 1, 2), (2, 2, 2, 2), (4, 1, 2, 1)]


@pytest.mark.parametrize(("tp", "cp", "pp", "dp"), LAYOUTS)
def test_groups_match_megatron_order(tp: int, cp: int, pp: int, dp: int) -> None:
    sizes = ParallelSizes(tp=tp, cp=cp, pp=pp, dp=dp)
    want = megatron_groups(tp, cp, pp, dp)
    for kind, groups in want.items():
        assert group_ranks(sizes, kind) == groups, f"{kind} groups for {sizes.describe()}"


def test_megatron_docstring_example() -> None:
    # Megatron's example: 16 GPUs, TP=2, PP=4, DP=2.
    sizes = ParallelSizes(tp=2, pp=4, dp=2)
    assert group_ranks(sizes, "tp")[:2] == [[0, 1], [2, 3]]
    assert group_ranks(sizes, "dp")[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(sizes, "pp")[:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]
    assert group_ranks(sizes, "embedding")[0] == [0, 12]


@pytest.mark.parametrize(("tp", "cp", "pp", "dp"), LAYOUTS)
def test_rank_formula_round_trips(tp: int, cp: int, pp: int, dp: int) -> None:
    sizes = ParallelSizes(tp=tp, cp=cp, pp=pp, dp=dp)
    for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        rank = rank_of(sizes, tp=t, cp=c, dp=d, pp=p)
        assert rank == ((p * dp + d) * cp + c) * tp + t
        co = coords_of(sizes, rank)
        assert (co.tp, co.cp, co.dp, co.pp) == (t, c, d, p)


def test_every_kind_partitions_the_world() -> None:
    sizes = ParallelSizes(tp=2, cp=2, pp=2, dp=2, ep=2)
    for kind in ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp"):
        flat = sorted(r for g in group_ranks(sizes, kind) for r in g)
        assert flat == list(range(sizes.world)), kind


def test_expert_groups_are_carved_out_of_dp_cp() -> None:
    sizes = ParallelSizes(tp=2, cp=1, pp=1, dp=4, ep=2)
    # Megatron expert order tp-ep-dp-pp: EP peers are consecutive DP ranks at a TP stride.
    assert group_ranks(sizes, "ep") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(sizes, "edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    dp_cp = group_ranks(sizes, "dp_cp")
    for group in group_ranks(sizes, "ep") + group_ranks(sizes, "edp"):
        assert any(set(group) <= set(g) for g in dp_cp)


def test_dp_is_derived_from_the_world() -> None:
    sizes = derive_sizes(ParallelConfig(tensor=2, pipeline=2), 16)
    assert (sizes.tp, sizes.pp, sizes.dp, sizes.world) == (2, 2, 4, 16)


def test_single_process_default() -> None:
    state = single_process_state()
    assert state.world_size == 1 and not state.distributed
    assert state.tp_group is None and state.dp_cp_group is None and state.ep_group is None
    assert state.is_first_stage and state.is_last_stage


def config(**parallel) -> MegalithConfig:
    return MegalithConfig.model_validate(
        {
            "model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4},
            "data": {"seq_length": 32},
            "training": {"micro_batch_size": 1, "global_batch_size": 8},
            "parallel": parallel,
        }
    )


BAD = [
    (
        {"tensor": 2, "pipeline": 2},
        6,
        r"world size 6 is not divisible by tensor 2 · context 1 · "
        r"pipeline 2 = 4",
    ),
    (
        {"tensor": 2},
        1,
        r"world size 1 is not divisible by tensor 2 · context 1 · pipeline 1 = 2 \(one "
        r"process: launch 2 with `megalith train --nproc-per-node 2`\)",
    ),
    ({"tensor": 8}, 8, r"num_attention_heads 4 is not divisible by tensor 8"),
    ({"pipeline": 3}, 3, r"num_layers 4 is not divisible by pipeline 3 · virtual_pipeline 1"),
    (
        {"pipeline": 2, "virtual_pipeline": 4, "pipeline_schedule": "interleaved"},
        2,
        r"num_layers 4 is not divisible by pipeline 2 · virtual_pipeline 4 = 8",
    ),
    ({"context": 32}, 32, r"seq_length 32 is not divisible by 2 · context 32 = 64"),
    ({"expert": 3}, 4, r"expert 3 does not divide data 4 · context 1 = 4"),
    ({"virtual_pipeline": 2}, 1, r"virtual_pipeline 2 needs pipeline > 1"),
    ({"sequence_parallel": True}, 1, r"sequence_parallel needs tensor > 1"),
    (
        {"pipeline": 2, "pipeline_schedule": "interleaved"},
        2,
        r"interleaved needs virtual_pipeline >= 2",
    ),
    ({}, 3, r"global_batch_size 8 is not divisible by micro_batch_size 1 · data 3 = 3"),
]


@pytest.mark.parametrize(("parallel", "world", "message"), BAD)
def test_bad_combinations_name_the_sizes(parallel: dict, world: int, message: str) -> None:
    with pytest.raises(ParallelLayoutError, match=message):
        validate_layout(config(**parallel), world)


def test_kv_groups_and_sequence_parallel_messages() -> None:
    cfg = MegalithConfig.model_validate(
        {
            "model": {
                "num_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_query_groups": 1,
            },
            "data": {"seq_length": 18},
            "training": {"micro_batch_size": 1, "global_batch_size": 1},
            "parallel": {"tensor": 4, "sequence_parallel": True},
        }
    )
    with pytest.raises(ParallelLayoutError) as err:
        validate_layout(cfg, 4)
    text = str(err.value)
    assert "num_query_groups (KV groups) 1 is not divisible by tensor 4" in text
    assert "seq_length 18 is not divisible by tensor 4 · context 1 = 4" in text
    assert re.search(r"world 4 = tensor 4 · context 1 · pipeline 1 · data 1", text)


def test_good_layout_passes() -> None:
    sizes = validate_layout(config(tensor=2, pipeline=2, context=2, sequence_parallel=True), 16)
    assert sizes.dp == 2 and sizes.world == 16


@pytest.mark.slow
def test_device_mesh_groups_match_the_layout_on_four_processes() -> None:
    """The groups torch.distributed builds hold exactly the ranks the helpers compute."""
    import os
    import sys
    from pathlib import Path

    from servers import run_group

    worker = Path(__file__).parent / "groups_worker.py"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", "4", "--max-restarts", "0", str(worker),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGALITH_DIST_TIMEOUT_S": "60"}
    done = run_group(command, env, timeout_s=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
