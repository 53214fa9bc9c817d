"""The combinations of parallelism and settings the trainer refuses. Torch-free, so
``megalith train --nproc-per-node`` refuses a layout before it starts any process.

Every parallelism runs in the trainer (data, tensor, sequence, context, pipeline,
expert); what is listed here are pairings that are not integrated, each refused with
the keys that conflict.
"""

from __future__ import annotations

from collections.abc import Callable

from megalith.config import MegalithConfig
from megalith.errors import MegalithError
from training.parallel.groups import ParallelSizes


def check_trainer_support(config: MegalithConfig, sizes: ParallelSizes) -> None:
    """Raise, naming every setting the trainer cannot run yet."""
    problems = expert_problems(config, sizes)
    problems += _pipeline_problems(config, sizes)
    problems += fp8_problems(config, sizes)
    problems += async_tp_problems(config, sizes)
    problems += comm_overlap_problems(config, sizes)
    problems += family_problems(config, sizes)
    problems += compile_mode_problems(config, sizes)
    if problems:
        raise MegalithError("; ".join(problems))


def _pipeline_problems(config: MegalithConfig, sizes: ParallelSizes) -> list[str]:
    """What pipeline stages (training.parallel.pipeline) do not run with yet."""
    if sizes.pp == 1:
        return []
    problems = []
    if config.training.compile and config.parallel.pipeline_schedule == "zero-bubble":
        problems.append(
            "training.compile with parallel.pipeline_schedule=zero-bubble: its split backward "
            "(input gradients first, weight gradients later) is not run through compiled "
            "blocks; use 1f1b or interleaved"
        )
    return problems


# Settings a model family's trainer does not run with yet, by model.family (as data:
# this module stays torch-free for the launcher): {key: (refused?, what is missing)}.
FAMILY_UNSUPPORTED: dict[
    str, dict[str, tuple[Callable[[MegalithConfig, ParallelSizes], bool], str]]
] = {
    "gpt": {},
    "t5": {  # data, tensor/sequence, context parallelism, pipeline stages and chat run
        "parallel.tp_comm_overlap": (
            lambda config, sizes: config.parallel.tp_comm_overlap,
            "TE's userbuffers have one shape; encoder and decoder sequences differ in length",
        ),
    },
}


def family_problems(config: MegalithConfig, sizes: ParallelSizes) -> list[str]:
    """What model.family does not train with yet (:data:`FAMILY_UNSUPPORTED`)."""
    family = config.model.family
    return [
        f"{key} with model.family={family}: not integrated yet ({what})"
        for key, (refused, what) in FAMILY_UNSUPPORTED[family].items()
        if refused(config, sizes)
    ]


def expert_problems(config: MegalithConfig, sizes: ParallelSizes) -> list[str]:
    """What mixture-of-experts and expert parallelism cannot run with (each names its keys)."""
    experts = config.model.num_experts or 0
    problems = []
    if experts and sizes.tp > 1:
        problems += _moe_tensor_parallel_problems(config, sizes)
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
    return problems


def _moe_tensor_parallel_problems(config: MegalithConfig, sizes: ParallelSizes) -> list[str]:
    """MoE under TP: each TP rank routes its sequence shard through whole experts."""
    moe = f"model.num_experts={config.model.num_experts} with parallel.tensor={sizes.tp}"
    if config.parallel.sequence_parallel:
        return []
    return [
        f"{moe} needs parallel.sequence_parallel=true: each tensor-parallel rank routes "
        "its own part of the sequence (as Megatron-core requires)"
    ]


def async_tp_problems(config: MegalithConfig, sizes: ParallelSizes) -> list[str]:
    """Async TP is an Inductor pass over the sequence-parallel collectives of our TP linears."""
    if not config.parallel.async_tensor_parallel:
        return []
    needs = {
        f"parallel.tensor > 1 (it is {sizes.tp})": sizes.tp > 1,
        "parallel.sequence_parallel=true": config.parallel.sequence_parallel,
        "training.compile=true": config.training.compile,
        "training.compile_backend inductor": config.training.compile_backend == "inductor",
        "training.device cuda or auto (symmetric memory)": config.training.device != "cpu",
        "model.backend torch (TE overlaps its own TP communication)": (
            config.model.backend != "te"
        ),
    }
    return _unmet("parallel.async_tensor_parallel", needs)


def compile_mode_problems(config: MegalithConfig, sizes: ParallelSizes) -> list[str]:
    """CUDA graphs (``training.compile_mode=reduce-overhead``) run one GPU's compiled step
    with the torch kernels, in bf16 or torchao's fp8 (its scales are computed inside the
    graphs each step: no state lives outside them), with or without gradient
    accumulation; over collectives, pipeline schedules and Transformer Engine's modules
    (their own graph breaks, delayed scaling's amax history) they are neither integrated
    nor measured."""
    training = config.training
    if training.compile_mode == "default":
        return []
    needs = {
        "training.compile=true": training.compile,
        "training.compile_backend inductor": training.compile_backend == "inductor",
        "model.backend torch or auto": config.model.backend != "te",
        # auto may pick TE's fp8 (models.backend.kernel_backend_name); torch is torchao's.
        "model.backend torch with mixed_precision.fp8": (
            not config.mixed_precision.fp8 or config.model.backend == "torch"
        ),
    }
    layout = {"data": sizes.dp, "tensor": sizes.tp, "pipeline": sizes.pp, "context": sizes.cp}
    for name, size in {**layout, "expert": sizes.ep}.items():
        needs[f"parallel.{name} = 1 (it is {size})"] = size == 1
    return _unmet(f"training.compile_mode={training.compile_mode}", needs)


def comm_overlap_problems(config: MegalithConfig, sizes: ParallelSizes) -> list[str]:
    """TE's userbuffers overlap the sequence-parallel collectives of TE's TP linears."""
    gemms = config.parallel.tp_comm_overlap_config
    if not config.parallel.tp_comm_overlap:
        if not gemms:
            return []
        named = ", ".join(gemms)
        return [f"parallel.tp_comm_overlap_config ({named}) needs parallel.tp_comm_overlap=true"]
    needs = {
        f"parallel.tensor > 1 (it is {sizes.tp})": sizes.tp > 1,
        "parallel.sequence_parallel=true": config.parallel.sequence_parallel,
        "model.backend=te (TE's userbuffers)": config.model.backend == "te",
        "training.device cuda or auto (CUDA IPC buffers)": config.training.device != "cpu",
    }
    return _unmet("parallel.tp_comm_overlap", needs) + _userbuffer_problems(gemms)


def _userbuffer_problems(gemms: dict) -> list[str]:
    """TE's rule for ``ub_cfgs``: a dgrad that reduce-scatters (any method but bulk) takes
    over its wgrad's buffer, so the wgrad cannot be configured too."""
    problems = []
    for dgrad in ("qkv_dgrad", "fc1_dgrad"):
        method = gemms[dgrad].method if dgrad in gemms else None
        wgrad = dgrad.replace("dgrad", "wgrad")
        if method not in (None, "bulk") and wgrad in gemms:
            problems.append(
                f"parallel.tp_comm_overlap_config: {dgrad} with method {method} overlaps its "
                f"reduce-scatter through {wgrad}'s buffer; leave {wgrad} out"
            )
    return problems


def _unmet(key: str, needs: dict[str, bool]) -> list[str]:
    """One problem naming every need of ``key`` that is not met (none when all are)."""
    missing = [need for need, met in needs.items() if not met]
    return [f"{key} needs {', '.join(missing)}"] if missing else []


def fp8_problems(config: MegalithConfig, sizes: ParallelSizes) -> list[str]:
    """What ``mixed_precision.fp8`` (training.precision.fp8) does not run with yet."""
    if not config.mixed_precision.fp8:
        return []
    problems = []
    micro, length = config.training.micro_batch_size, config.data.seq_length
    tokens = micro * length // sizes.cp
    if tokens % 16:  # cuBLASLt float8 GEMMs: every dimension a multiple of 16
        problems.append(
            f"mixed_precision.fp8 with training.micro_batch_size={micro} and data.seq_length="
            f"{length} (over parallel.context={sizes.cp}): {tokens} tokens per micro-batch, but "
            "the float8 weight-gradient GEMMs reduce over the tokens, which must be a multiple "
            "of 16"
        )
    return problems
