"""A torchrun worker for tests/test_pipeline_parallel.py (not a test module itself).

- ``cases``: as tests/tp_trainer_worker.py, ``Trainer.fit`` over the whole run, then a
  second trainer resumes from the checkpoint of ``resume_step`` (copied to NAME-resumed)
  to the end.
- ``grad_cases``: one training step's gradients through the pipeline schedule (after the
  data-parallel average and the tied-embedding sum, before clipping), gathered to whole
  single-process tensors; rank 0 writes OUT/NAME/grads.safetensors.
- ``resume_cases``: resume from a checkpoint written by another layout (the
  single-process run) and train to the end.

    torchrun --nproc-per-node 2 tests/pp_worker.py SPEC.json
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from tp_trainer_worker import config_of, run_case

from training.distributed import distributed
from training.trainer import Trainer


def gradients(spec: dict, name: str, settings: dict) -> None:
    out = Path(spec["out"]) / name
    trainer = Trainer(config_of(spec, settings), out)
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.pipeline.forward_backward(trainer.train_batches())
    grads = trainer.pipeline.gather_grads()
    if trainer.is_main:
        save_file({n: g.contiguous() for n, g in grads.items()}, str(out / "grads.safetensors"))
    dist.barrier()


def resume(spec: dict, name: str, settings: dict) -> None:
    out = Path(spec["out"]) / name
    step = f"step-{spec['resume_step']:08d}"
    if dist.get_rank() == 0:
        shutil.copytree(Path(spec["checkpoint_root"]) / step, out / "checkpoints" / step)
    dist.barrier()
    config = config_of(spec, settings)
    config.checkpoint.directory = str(out / "checkpoints")
    trainer = Trainer(config, out)
    assert trainer.resume(), "no checkpoint to resume from"
    trainer.fit(show_progress=False)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    with distributed(spec["device"]):
        # A fresh ParallelState per case: the cases differ in virtual_pipeline.
        for name, settings in spec.get("cases", {}).items():
            run_case(spec, name, settings, None)
        for name, settings in spec.get("grad_cases", {}).items():
            gradients(spec, name, settings)
        for name, settings in spec.get("resume_cases", {}).items():
            resume(spec, name, settings)


if __name__ == "__main__":
    main(sys.argv[1])
