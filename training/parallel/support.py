"""What the trainer can run today. Torch-free, so ``megalith train --nproc-per-node``
refuses a layout before it starts any process.

Integration hook: when a parallelism lands in the trainer, drop it from ``PENDING``.
"""

from __future__ import annotations

from training.config import MegalithConfig
from training.errors import MegalithError
from training.parallel.groups import ParallelSizes

# parallel.<key> -> the ParallelSizes field; each must stay 1 until integrated.
PENDING = {"expert": "ep"}


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
            "distributed_optimizer, fsdp; tensor and pipeline parallelism with ddp or "
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
    problems += _pipeline_problems(config, sizes)
    if problems:
        raise MegalithError("; ".join(problems))


def _pipeline_problems(config: MegalithConfig, sizes: ParallelSizes) -> list[str]:
    """What pipeline stages (training.parallel.pipeline) do not run with yet."""
    if sizes.pp == 1:
        return []
    problems = []
    if config.parallel.data_parallel_mode == "fsdp":
        problems.append(
            f"parallel.data_parallel_mode=fsdp with parallel.pipeline={sizes.pp}: FSDP over "
            "pipeline stages is not integrated; use ddp or distributed_optimizer"
        )
    if config.mixed_precision.dtype == "fp16":
        problems.append(
            f"mixed_precision.dtype=fp16 with parallel.pipeline={sizes.pp}: the loss scaler's "
            "inf checks are not coordinated over pipeline stages; use bf16"
        )
    if sizes.cp > 1:
        problems.append(
            f"parallel.context={sizes.cp} with parallel.pipeline={sizes.pp}: context-parallel "
            "pipeline stages are not integrated; use tensor or data parallelism beside CP"
        )
    if config.training.compile:
        problems.append(
            f"training.compile with parallel.pipeline={sizes.pp}: compiling pipeline stages is "
            "not integrated; set training.compile=false"
        )
    return problems
