"""A torchrun worker for tests/test_pipeline_parallel.py (not a test module itself).

- ``cases``: as tests/tp_trainer_worker.py, ``Trainer.fit`` over the whole run, then a
  second trainer resumes from the checkpoint of ``resume_step`` (copied to NAME-resumed)
  to the end.
- ``grad_cases``: one training step's gradients through the pipeline schedule (after the
  data-parallel average and the tied-embedding sum, before clipping), gathered to whole
  single-process tensors; rank 0 writes OUT/NAME/grads.safetensors.
- ``resume_cases``: resume from a checkpoint written by another layout (the
  single-process run, or the sharded checkpoint of an 8-process run) and train to the
  end; each rank writes OUT/NAME/reads-rank{r}.json: the files and bytes it read on
  resume, the bytes it holds, and where its checkpoint boxes (``shard_specs``) differ
  from what the older ``shard_loaded`` load paths cut out of a whole tensor.
  ``resume_from`` may name, per resume case, a fit case of the same job to resume from,
  ``resume_roots`` a checkpoint folder other than ``checkpoint_root``.
- ``fit_cases``: ``Trainer.fit`` only (no resume), with the same boxes check.

    torchrun --nproc-per-node 2 tests/pp_worker.py SPEC.json
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from tp_trainer_worker import config_of, run_case

from training.runtime.distributed import distributed
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


def check_boxes(trainer: Trainer) -> list[str]:
    """Where this rank's checkpoint boxes, cut out of a whole tensor, differ from the
    existing load paths (TP/EP ``shard_loaded``, the pipeline's, FSDP's ``_like``)."""
    from torch.distributed.tensor import DTensor

    from training.checkpoint.format import _like
    from training.parallel import expert_parallel_training as ep
    from training.parallel.shard_specs import assemble, model_specs, reshard_fsdp

    reshard_fsdp(trainer.model)
    pipeline = trainer.pipeline
    owner = pipeline.owner_stage if pipeline is not None else None
    specs = model_specs(trainer.model, trainer.parallel, owner)
    problems = []
    for name, param in trainer.model.named_parameters():
        box_spec = specs[name]
        whole = torch.arange(math.prod(box_spec.shape), dtype=torch.float32)
        whole = whole.reshape(box_spec.shape)
        got = assemble(box_spec, whole, param)
        want = ep.shard_loaded(name, whole, trainer.model_config, trainer.parallel)
        if isinstance(param, DTensor):  # FSDP rows of the TP/EP shard
            want = _like(param, want).to_local().cpu()
        if got.shape != want.shape or not torch.equal(got, want):
            problems.append(f"rank {dist.get_rank()}: {name} boxes {box_spec.pieces}")
    return problems


def held_bytes(trainer: Trainer) -> int:
    """Bytes of this rank's parameters and AdamW state (what a resume must read)."""
    from training.parallel.dtensor import local_tensor

    total = 0
    for param in trainer.model.parameters():
        total += local_tensor(param).numel() * param.element_size()
        for key, value in trainer.optimizer.state.get(param, {}).items():
            value = local_tensor(value)
            total += value.numel() * (4 if key == "step" else value.element_size())
    return total


def record_reads(trainer: Trainer, out: Path) -> None:
    stats = trainer.checkpoint_read_stats
    record = {**stats, "held_bytes": held_bytes(trainer), "box_problems": check_boxes(trainer)}
    (out / f"reads-rank{dist.get_rank()}.json").write_text(json.dumps(record))


def fit(spec: dict, name: str, settings: dict) -> None:
    out = Path(spec["out"]) / name
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(config_of(spec, settings), out)
    problems = check_boxes(trainer)
    (out / f"boxes-rank{dist.get_rank()}.json").write_text(json.dumps(problems))
    trainer.fit(show_progress=False)


def resume(spec: dict, name: str, settings: dict) -> None:
    out = Path(spec["out"]) / name
    step = f"step-{spec['resume_step']:08d}"
    source = spec.get("resume_from", {}).get(name)  # a fit case of this job
    root = Path(spec.get("resume_roots", {}).get(name, spec.get("checkpoint_root", "")))
    if source:
        root = Path(spec["out"]) / source / "checkpoints"
    if dist.get_rank() == 0:
        shutil.copytree(root / step, out / "checkpoints" / step)
    dist.barrier()
    config = config_of(spec, settings)
    config.checkpoint.directory = str(out / "checkpoints")
    trainer = Trainer(config, out)
    assert trainer.resume(), "no checkpoint to resume from"
    if trainer.checkpoint_read_stats:  # a sharded checkpoint
        record_reads(trainer, out)
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
        for name, settings in spec.get("fit_cases", {}).items():
            fit(spec, name, settings)
        for name, settings in spec.get("resume_cases", {}).items():
            resume(spec, name, settings)


if __name__ == "__main__":
    main(sys.argv[1])
