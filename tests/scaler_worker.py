"""A torchrun worker for tests/test_precision.py (not a test module itself).

Every rank holds its own weight (as tensor-parallel ranks hold different shards), then
FSDP row shards of one weight; rank 1's gradient overflows. Writes, per rank and scaler kind, whether the weight
moved and the loss scale after the step.

    torchrun --nproc-per-node 2 tests/scaler_worker.py SPEC.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megalith.config import MixedPrecisionConfig
from training.precision.mixed import resolve_precision


def one_step(scaler: torch.amp.GradScaler, rank: int) -> dict:
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    loss = (weight * torch.arange(4.0)).sum()
    scaler.scale(loss).backward()
    if rank == 1:
        weight.grad[0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    return {"moved": not torch.equal(weight.detach(), torch.ones(4)), "scale": scaler.get_scale()}


def one_fsdp_step(scaler: torch.amp.GradScaler, rank: int) -> dict:
    """The same with FSDP2 over both ranks: the gradient is a DTensor of row shards, and
    only rank 1's rows overflow."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(4, 4, bias=False)
    torch.nn.init.ones_(model.weight)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.arange(4.0)).sum()
    scaler.scale(loss).backward()
    if rank == 1:
        model.weight.grad.to_local()[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    whole = model.weight.full_tensor()
    return {"moved": not torch.equal(whole, torch.ones(4, 4)), "scale": scaler.get_scale()}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = MixedPrecisionConfig(dtype="fp16", initial_loss_scale=1024.0)
    agreed = resolve_precision(config, torch.device("cpu")).scaler
    local = torch.amp.GradScaler("cpu", init_scale=1024.0)
    result = {
        "agreed_class": type(agreed).__name__,
        "agreed": one_step(agreed, rank),
        "local": one_step(local, rank),
        "agreed_fsdp": one_fsdp_step(resolve_precision(config, torch.device("cpu")).scaler, rank),
        "local_fsdp": one_fsdp_step(torch.amp.GradScaler("cpu", init_scale=1024.0), rank),
    }
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(result))
    # Both ranks done before either tears gloo down: under load a rank leaving first
    # made the other abort in its teardown ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
