"""A torchrun worker for tests/test_moe.py (not a test module itself).

Runs each trainer case as tests/tp_trainer_worker.py does (``Trainer.fit``, then a
resume from the first checkpoint), then captures one step's gradients: the real
``Trainer.train_step`` with the optimizer's step skipped, experts gathered over the EP
group, written by rank 0 to OUT/grads/grads.safetensors.

    torchrun --nproc-per-node 2 tests/moe_trainer_worker.py SPEC.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tp_trainer_worker import config_of, run_case

from training.parallel import expert_parallel_training as ep
from training.runtime.distributed import distributed
from training.trainer import Trainer


def capture_grads(spec: dict, settings: dict, state) -> None:
    out = Path(spec["out"]) / "grads"
    trainer = Trainer(config_of(spec, settings), out, parallel_state=state)
    trainer.optimizer.step = lambda: None  # keep the weights: only the gradients matter
    trainer.train_step(trainer.train_batches())
    experts = ep.expert_parameters(trainer.model)
    grads = {}
    for name, param in trainer.model.named_parameters():
        grad = param.grad.detach()
        if name in experts and trainer.parallel.sizes.ep > 1:
            grad = ep._gather_experts(grad, trainer.parallel)
        grads[name] = grad.cpu().contiguous()
    if trainer.is_main:
        save_file(grads, str(out / "grads.safetensors"))


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    with distributed(spec["device"]):
        for name, settings in spec["cases"].items():
            run_case(spec, name, settings, None)  # each case's own layout (EP or not)
        capture_grads(spec, spec["grads"], None)


if __name__ == "__main__":
    main(sys.argv[1])
