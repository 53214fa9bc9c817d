"""A torchrun worker for tests/test_data_parallel.py (not a test module itself).

For each data-parallel mode: K train steps from the same seed, saving the gradients
of step 1 and the parameters after step K (every rank), the losses and grad norms
(rank 0), a checkpoint at step K, then two more steps; a second trainer resumes from
that checkpoint and takes the same two steps.

    torchrun --nproc-per-node 2 tests/dp_parity_worker.py SPEC.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from megalith.config import load_config
from training.runtime.distributed import distributed
from training.trainer import Trainer


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A plain copy; FSDP's sharded DTensors are gathered (collective)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().clone()


def run_mode(spec: dict, mode: str, state) -> object:
    settings = {**spec["settings"], "parallel.data_parallel_mode": mode}
    config = load_config(spec["recipe"], [f"{k}={v}" for k, v in settings.items()])
    out = Path(spec["out"]) / mode
    trainer = Trainer(config, out, parallel_state=state)
    rank = trainer.parallel.rank
    batches = trainer.train_batches()
    records = []
    for step in range(spec["steps"]):
        records.append(trainer.train_step(batches))
        if step == 0:
            grads = {n: whole(p.grad) for n, p in trainer.model.named_parameters()}
            save_file(grads, str(out / f"grads-rank{rank}.safetensors"))
    params = {n: whole(p) for n, p in trainer.model.named_parameters()}
    save_file(params, str(out / f"params-rank{rank}.safetensors"))
    trainer.save()
    after = [trainer.train_step(batches) for _ in range(2)]

    resumed = Trainer(config, out, parallel_state=trainer.parallel)
    assert resumed.resume(), "no checkpoint to resume from"
    resumed_batches = resumed.train_batches()
    again = [resumed.train_step(resumed_batches) for _ in range(2)]
    if rank == 0:
        result = {
            "records": records,
            "after": after,
            "resumed": again,
            "layout": trainer.parallel.layout(),
        }
        (out / "result.json").write_text(json.dumps(result))
    return trainer.parallel


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    with distributed(spec["settings"]["training.device"]):
        state = None
        for mode in spec["modes"]:
            state = run_mode(spec, mode, state)


if __name__ == "__main__":
    main(sys.argv[1])
