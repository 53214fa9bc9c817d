"""A torchrun worker for tests/test_parallel_groups.py (not a test module itself):
builds the process groups for several layouts and checks each group's members
against the pure layout helpers. Exits non-zero, naming the layout, on a mismatch.

    torchrun --nproc-per-node 4 tests/groups_worker.py
"""

from __future__ import annotations

import torch.distributed as dist

from megalith.config import MegalithConfig
from training.parallel.groups import build_parallel_state, group_ranks
from training.runtime.distributed import distributed

LAYOUTS = [
    {"tensor": 2, "expert": 2},  # tp 2 · dp 2, experts over the two DP ranks
    {"tensor": 2, "pipeline": 2},  # tp 2 · pp 2 (embedding group: first and last stage)
    {"context": 2},  # cp 2 · dp 2
]


def check(parallel: dict) -> None:
    config = MegalithConfig.model_validate(
        {
            "parallel": parallel,
            "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4},
            "data": {"seq_length": 16},
            "training": {"micro_batch_size": 1, "global_batch_size": 4},
        }
    )
    state = build_parallel_state(config)
    groups = {kind: getattr(state, f"{kind}_group") for kind in ("tp", "cp", "dp", "pp", "dp_cp")}
    if state.sizes.ep > 1:
        groups |= {"ep": state.ep_group, "edp": state.edp_group}
    if state.sizes.pp > 1:
        groups["embedding"] = state.embedding_group
    for kind, group in groups.items():
        members = dist.get_process_group_ranks(group)
        expected = next(g for g in group_ranks(state.sizes, kind) if state.rank in g)
        if members != expected:
            raise SystemExit(f"{parallel}: rank {state.rank} {kind} group {members} != {expected}")


def main() -> None:
    with distributed("cpu"):
        for parallel in LAYOUTS:
            check(parallel)


if __name__ == "__main__":
    main()
