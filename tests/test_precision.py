"""fp16 loss scaling over several ranks: an overflow on one rank (or in one FSDP shard)
skips the step everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from parallel_helpers import run_torchrun_worker

from megalith.config import MixedPrecisionConfig
from training.precision.mixed import resolve_precision


def test_one_process_uses_the_plain_scaler() -> None:
    precision = resolve_precision(MixedPrecisionConfig(dtype="fp16"), torch.device("cpu"))
    assert type(precision.scaler) is torch.amp.GradScaler


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    run_torchrun_worker("scaler_worker.py", {"out": str(tmp_path)}, tmp_path, 2, "fp16 scaler")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert {r["agreed_class"] for r in ranks} == {"AgreedGradScaler"}
    for rank, result in enumerate(ranks):
        assert not result["agreed"]["moved"], f"rank {rank} stepped past rank 1's overflow"
        assert result["agreed"]["scale"] == 512.0, f"rank {rank} kept scale {result}"
    # Without agreement the ranks drift apart: the reason for the agreed scaler.
    assert ranks[0]["local"] == {"moved": True, "scale": 1024.0}
    assert ranks[1]["local"] == {"moved": False, "scale": 512.0}
    # FSDP's row shards (DTensor gradients): rank 1's inf skips the step on both ranks
    # (the DTensor unscale already reduces the check over the shards; agreement holds too).
    for rank, result in enumerate(ranks):
        for scaler in ("agreed_fsdp", "local_fsdp"):
            assert result[scaler] == {"moved": False, "scale": 512.0}, (rank, scaler, result)
