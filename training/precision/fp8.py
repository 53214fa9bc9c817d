"""FP8 training: float8 matrix products in the transformer blocks (``mixed_precision.fp8``).

Two routes, picked by the model's layer backend (``model.backend``):

- **torch** → torchao's float8 training (``megalith[gpu]``, torchao 0.18): every
  eligible ``nn.Linear`` becomes a ``Float8Linear`` (``convert_to_float8_training``).
  A ``Float8Linear`` keeps its weight as the *same* plain bf16/fp32 ``Parameter`` and
  casts the matmul inputs (activation, weight, output gradient) to float8 with dynamic
  scales in every forward and backward, so parameter names, the optimizer, sharded
  checkpoints, the model package and exports are exactly as without fp8. The
  tensor-parallel linears (``ColumnParallelLinear``, ``RowParallelLinear``) keep their
  shard and collectives and get a :class:`Float8Matmul` instead (scales per shard). It composes
  with ``torch.compile`` (which fuses the casts), activation checkpointing (selective
  checkpointing keeps ``_scaled_mm`` outputs, :data:`training.models.gpt.SELECTIVE_SAVED_OPS`),
  DDP and FSDP2 (the conversion runs before either wraps the model).
- **te** → the Transformer Engine layers of :mod:`training.models.te_backend` run every
  forward under ``te.fp8_autocast`` with the recipe (through :attr:`Precision.fp8_context`).

Recipes (``mixed_precision.fp8_recipe``): ``tensorwise`` (torchao's tensorwise recipe;
TE's ``Float8CurrentScaling``), ``rowwise`` (torchao only: a scale per row, more
accurate, slower), ``delayed`` (TE only: ``DelayedScaling`` from an amax history).

Which linears are converted (:func:`fp8_eligible`):

- not the output head: it is no ``nn.Linear`` here (``OutputHead`` multiplies by its
  ``Parameter``, possibly the tied embedding, or fuses it with the loss), and the
  logits feed the softmax, the place float8 rounding hurts most; torchtitan, Megatron
  and TE recipes keep it in bf16 too;
- not a linear whose ``in_features`` or ``out_features`` is not a multiple of 16:
  ``torch._scaled_mm`` (cuBLASLt's float8 GEMM) needs both matrix dimensions divisible
  by 16 (a model with such a width keeps those linears in bf16 rather than failing).
  The MoE router (fp32 logits) and experts (stacked tensors) are no ``nn.Linear`` and
  stay as they are. The weight-gradient GEMMs reduce over the tokens, so the tokens of
  a micro-batch (``micro_batch_size · seq_length / context``) must be a multiple of 16
  too (:func:`training.parallel.support.fp8_problems` refuses other settings).

Float8 needs bf16 around it (config refuses fp16/fp32; ``auto`` means bf16 with fp8,
also on CPU, where torch's ``_scaled_mm`` runs float8 matmuls too, so the CPU tests take
the real path, no emulation; it is a slow reference kernel there, fine for hidden sizes
of a few dozen only). Measured on CPU (torch 2.13, torchao 0.18, hidden 32, 30 steps):
the loss of the Trainer in fp8 stays within 4e-4 of bf16's at every step, tensorwise,
rowwise, and tensorwise under ``training.compile`` (inductor) with selective checkpointing;
2-process DDP in fp8 equals one process to the bit, FSDP2 within 1e-6.

Gated MLPs (SwiGLU, GeGLU) then make their ``fc2``'s float8 input, and ``fc1``'s float8
output gradient, themselves in the tensorwise recipe (:mod:`training.precision.gated_fp8`):
the same float8 tensors torchao would cast, without writing the bf16 product or gradient.
And each weight is cast once a step, not in every forward and backward, where FSDP does
not shard it (:mod:`training.precision.float8_weights`, ``mixed_precision.fp8_weight_cache``).

torchao is imported only here and in :mod:`training.precision.gated_fp8`, and only when
fp8 is on.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
from torch import nn

from megalith.config import MixedPrecisionConfig
from megalith.errors import MegalithError
from training.models.backend import backend_name
from training.models.layers import to_autocast_dtype
from training.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from training.precision.mixed import Precision

logger = logging.getLogger(__name__)

FP8_DIM_MULTIPLE = 16  # torch._scaled_mm: both GEMM dimensions divisible by 16
MIN_CUDA_CAPABILITY = (8, 9)  # Ada, Hopper, Blackwell have float8 tensor cores


class FP8Error(MegalithError):
    """fp8 was asked for with settings or software that cannot provide it."""


def fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """Whether torchao converts ``module`` (see the module docstring for why)."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[0] == "output":
        return False
    return (
        module.in_features % FP8_DIM_MULTIPLE == 0 and module.out_features % FP8_DIM_MULTIPLE == 0
    )


def _torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError as exc:
        raise FP8Error(
            "mixed_precision.fp8 with model.backend torch needs torchao's float8 training: "
            f'pip install "megalith[gpu]" (torchao 0.18) ({exc})'
        ) from None
    return float8


def torchao_config(recipe: str):
    """torchao's ``Float8LinearConfig`` for ``mixed_precision.fp8_recipe``."""
    if recipe == "delayed":
        raise FP8Error(
            "mixed_precision.fp8_recipe=delayed is Transformer Engine's DelayedScaling; torchao "
            "(model.backend torch) has tensorwise or rowwise: set mixed_precision.fp8_recipe"
        )
    return _torchao_float8().Float8LinearConfig.from_recipe_name(recipe)


class Float8Matmul:
    """``x @ weight.T`` through torchao's float8 casts and scaled matmuls (what
    ``Float8Linear.forward`` runs), for the tensor-parallel linears, which keep their own
    weight shard and collectives. Scales are taken per shard: each rank scales its part
    of the weight (and, in a row-parallel linear, of the input) by that part's own amax,
    as torchao's tensor-parallel float8 does for local tensors; the partial products are
    then reduced in bf16, so TP changes only the rounding, not the reduction."""

    def __init__(self, config) -> None:
        float8 = _torchao_float8()
        # torchao builds its matmul settings in Float8Linear: take them from a shell.
        shell = float8.float8_linear.Float8Linear.from_float(
            nn.Linear(FP8_DIM_MULTIPLE, FP8_DIM_MULTIPLE, bias=False, device="meta"), config=config
        )
        self.config, self.mm_config = shell.config, shell.linear_mm_config
        self.apply = float8.float8_linear.matmul_with_hp_or_float8_args.apply

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        (x,) = to_autocast_dtype(x)  # as F.linear under autocast
        return self.apply(x, weight.t(), self.mm_config, self.config)


def _arm_tensor_parallel_linears(model: nn.Module, config) -> list[str]:
    """Give the eligible tensor-parallel linears a float8 matmul; returns their names."""
    armed, matmul = [], Float8Matmul(config)  # stateless: one for every linear
    for fqn, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        out_features, in_features = module.weight.shape  # this rank's shard
        if in_features % FP8_DIM_MULTIPLE == 0 and out_features % FP8_DIM_MULTIPLE == 0:
            module.matmul = matmul
            armed.append(fqn)
    return armed


def convert_linears(model: nn.Module, recipe: str) -> list[str]:
    """Swap the eligible ``nn.Linear`` modules of ``model`` for torchao ``Float8Linear``
    in place, and give the eligible tensor-parallel linears a float8 matmul; returns the
    converted modules' names. Parameters stay the same objects."""
    float8 = _torchao_float8()
    config = torchao_config(recipe)
    converted: list[str] = _arm_tensor_parallel_linears(model, config)

    def keep(module: nn.Module, fqn: str) -> bool:
        if fp8_eligible(module, fqn):
            converted.append(fqn)
            return True
        return False

    float8.convert_to_float8_training(model, module_filter_fn=keep, config=config)
    if not converted:
        raise FP8Error(
            "mixed_precision.fp8: no linear layer can run in float8 (each needs in and out "
            f"features divisible by {FP8_DIM_MULTIPLE}); check model.hidden_size and "
            "model.ffn_hidden_size, or set mixed_precision.fp8=false"
        )
    from training.precision import gated_fp8  # imports torchao, installed only with [gpu]

    armed = gated_fp8.arm_gated_mlps(model, config)
    logger.info(
        "fp8: %d gated MLPs make their own float8 casts (fc2's input, fc1's gradient)", len(armed)
    )
    return converted


def te_fp8_context(recipe: str) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of ``te.fp8_autocast`` contexts with the recipe (one recipe object, so
    delayed scaling keeps its amax history across steps)."""
    if recipe == "rowwise":
        raise FP8Error(
            "mixed_precision.fp8_recipe=rowwise is torchao's; with the Transformer Engine "
            "backend use tensorwise (Float8CurrentScaling) or delayed (DelayedScaling), or set "
            "model.backend=torch"
        )
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as te_recipe

    if recipe == "delayed":
        fp8_recipe = te_recipe.DelayedScaling(
            fp8_format=te_recipe.Format.HYBRID, amax_history_len=1024, amax_compute_algo="max"
        )
    else:
        fp8_recipe = te_recipe.Float8CurrentScaling(fp8_format=te_recipe.Format.HYBRID)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)


def check_device(device: torch.device) -> None:
    """Refuse a GPU without float8 tensor cores (the error would come from deep in cuBLAS)."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CUDA_CAPABILITY:
        raise FP8Error(
            f"mixed_precision.fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper, "
            f"Blackwell); {torch.cuda.get_device_name(device)} is "
            f"{capability[0]}.{capability[1]}: set mixed_precision.fp8=false"
        )


def prepare_fp8(
    model: nn.Module,
    config: MixedPrecisionConfig,
    precision: Precision,
    weights_stay_whole: bool = False,
) -> list[str]:
    """Make ``model`` (just built, not yet wrapped by DDP/FSDP/compile) train in fp8 as
    ``config`` says; a no-op returning ``[]`` when ``config.fp8`` is off. With
    ``weights_stay_whole`` (no FSDP will shard them) and ``config.fp8_weight_cache``, the
    float8 weights are cast once a step (``precision.refresh_fp8_weights``).

    Returns what runs in float8: the converted linears (torchao), or the TE recipe.
    """
    if not config.fp8:
        return []
    if precision.name != "bf16":
        raise FP8Error(
            f"mixed_precision.fp8 needs bf16 compute, but the run resolved to {precision.name}; "
            "set mixed_precision.dtype=bf16"
        )
    parameter = next(model.parameters(), None)
    if parameter is not None:
        check_device(parameter.device)
    if backend_name(model) == "te":
        if getattr(model, "activation_checkpointing", "none") != "none":
            raise FP8Error(
                "mixed_precision.fp8 on the Transformer Engine backend with "
                "model.activation_checkpointing: the recomputed forward would run outside "
                "te.fp8_autocast; set model.activation_checkpointing=none or model.backend=torch"
            )
        precision.fp8_context = te_fp8_context(config.fp8_recipe)
        logger.info("fp8: Transformer Engine layers under fp8_autocast (%s)", config.fp8_recipe)
        return [f"te:{config.fp8_recipe}"]
    converted = convert_linears(model, config.fp8_recipe)
    logger.info("fp8: %d linears in float8 (torchao %s)", len(converted), config.fp8_recipe)
    if config.fp8_weight_cache and weights_stay_whole:
        from training.precision import float8_weights  # imports torchao ([gpu] only)

        cache = float8_weights.cache_weights(
            model, compiled=parameter is not None and parameter.is_cuda
        )
        precision.refresh_fp8_weights = cache.refresh
        logger.info("fp8: %d linears cast their weight once a step", len(cache.linears))
    return converted


__all__ = [
    "FP8Error",
    "check_device",
    "convert_linears",
    "fp8_eligible",
    "prepare_fp8",
    "te_fp8_context",
    "torchao_config",
]
