"""What the trainer can run today. Torch-free, so ``megalith train --nproc-per-node``
refuses a layout before it starts any process.

Integration hook: when a parallelism lands in the trainer, drop it from ``PENDING``.
"""

from __future__ import annotations

from training.config import MegalithConfig
from training.errors import MegalithError
from training.parallel.groups import ParallelSizes

# parallel.<key> -> the ParallelSizes field; each must stay 1 until integrated.
PENDING = {"pipeline": "pp", "expert": "ep"}


def check_trainer_support(config: MegalithConfig, sizes: ParallelSizes) -> None:
    """Raise, naming every setting the trainer cannot run yet."""
    problems = [
        f"parallel.{key}={getattr(sizes, field)}"
        for key, field in PENDING.items()
        if getattr(sizes, field) > 1
    ]
    if problems:
        problems[-1] += (
            ": not integrated into the trainer yet (it runs data parallelism: ddp, "
            "distributed_optimizer, fsdp; tensor parallelism with ddp or "
            "distributed_optimizer; and context parallelism)"
        )
    mode = config.parallel.data_parallel_mode
    if mode == "fsdp" and sizes.tp > 1:
        problems.append(
            f"parallel.data_parallel_mode=fsdp with parallel.tensor={sizes.tp}: FSDP over "
            "tensor-parallel shards is not integrated yet; use ddp or distributed_optimizer"
        )
    if mode == "fsdp" and config.mixed_precision.dtype == "fp16":
        problems.append(
            "parallel.data_parallel_mode=fsdp with mixed_precision.dtype=fp16: the loss scaler "
            "does not handle sharded gradients; use bf16"
        )
    if problems:
        raise MegalithError("; ".join(problems))
