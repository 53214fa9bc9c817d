"""What the trainer can run today. Torch-free, so ``megalith train --nproc-per-node``
refuses a layout before it starts any process.

Integration hook: when a parallelism lands in the trainer, drop it from ``PENDING``.
"""

from __future__ import annotations

from training.config import MegalithConfig
from training.errors import MegalithError
from training.parallel.groups import ParallelSizes

# parallel.<key> -> the ParallelSizes field; each must stay 1 until integrated.
PENDING = {"pipeline": "pp", "context": "cp"}


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
            "distributed_optimizer; expert parallelism with ddp)"
        )
    problems += expert_problems(config, sizes)
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


def expert_problems(config: MegalithConfig, sizes: ParallelSizes) -> list[str]:
    """What mixture-of-experts and expert parallelism cannot run with (each names its keys)."""
    experts, mode = config.model.num_experts or 0, config.parallel.data_parallel_mode
    problems = []
    if experts and sizes.tp > 1:
        problems.append(
            f"model.num_experts={experts} with parallel.tensor={sizes.tp}: MoE layers are not "
            "tensor-parallel yet; use parallel.expert instead"
        )
    if sizes.ep == 1:
        return problems
    if not experts:
        problems.append(
            f"parallel.expert={sizes.ep} needs model.num_experts (a dense model has no experts)"
        )
    elif experts % sizes.ep:
        problems.append(
            f"model.num_experts={experts} is not divisible by parallel.expert={sizes.ep}"
        )
    if mode != "ddp":
        problems.append(
            f"parallel.expert={sizes.ep} with parallel.data_parallel_mode={mode}: only ddp "
            "keeps expert gradients apart from the dense ones yet"
        )
    dp_cp = sizes.dp * sizes.cp
    if config.training.eval_iters % dp_cp:
        problems.append(
            f"training.eval_iters={config.training.eval_iters} is not a multiple of data · "
            f"context = {dp_cp} with parallel.expert={sizes.ep}: every rank must run as many "
            "validation forwards (each one an all-to-all over the expert-parallel ranks)"
        )
    return problems
