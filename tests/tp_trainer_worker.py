"""A torchrun worker for tests/test_trainer_parallel.py (not a test module itself).

For each case: ``Trainer.fit`` over the whole run (metrics, checkpoints every
``checkpoint.interval`` steps, the model package), then rank 0 copies the first
checkpoint into a fresh directory and a second trainer resumes from it to the end.
Cases of one layout share its process groups; a case of another layout builds its own.

    torchrun --nproc-per-node 2 tests/tp_trainer_worker.py SPEC.json
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megalith.config import load_config
from training.parallel.groups import validate_layout
from training.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from training.runtime.distributed import distributed
from training.trainer import Trainer


def config_of(spec: dict, settings: dict):
    return load_config(spec["recipe"], [f"{k}={v}" for k, v in settings.items()])


def run_case(spec: dict, name: str, settings: dict, state) -> object:
    """Fit, then resume a copy of the checkpoint of ``resume_step`` to the end."""
    config = config_of(spec, settings)
    out = Path(spec["out"]) / name
    if state is not None and validate_layout(config, state.sizes.world) != state.sizes:
        state = None  # another layout: its own process groups
    trainer = Trainer(config, out, parallel_state=state)
    trainer.fit(show_progress=False)
    if trainer.finetune is not None:  # what this rank read of the base to load it
        reads = dataclasses.asdict(trainer.finetune.load_stats)
        (out / f"base_reads_rank{dist.get_rank()}.json").write_text(json.dumps(reads))
    if trainer.is_main:  # which tensor-parallel linears ran a float8 matmul
        linears = {
            name: module.matmul is not None
            for name, module in trainer.model.named_modules()
            if isinstance(module, ColumnParallelLinear | RowParallelLinear)
        }
        (out / "tensor_parallel_float8.json").write_text(json.dumps(linears))

    resumed_out = Path(spec["out"]) / f"{name}-resumed"
    first = f"step-{spec['resume_step']:08d}"
    if trainer.is_main:
        shutil.copytree(out / "checkpoints" / first, resumed_out / "checkpoints" / first)
    dist.barrier()
    config.checkpoint.directory = str(resumed_out / "checkpoints")
    resumed = Trainer(config, resumed_out, parallel_state=trainer.parallel)
    assert resumed.resume(), "no checkpoint to resume from"
    resumed.fit(show_progress=False)
    return trainer.parallel


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    with distributed(spec["device"]):
        state = None
        for name, settings in spec["cases"].items():
            state = run_case(spec, name, settings, state)


if __name__ == "__main__":
    main(sys.argv[1])
