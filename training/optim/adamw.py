"""AdamW with decoupled weight decay, fused on CUDA."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megalith.config import OptimizerConfig
from training.models.flops import param_groups
from training.optim import multi_tensor_adamw


def build_optimizer(
    model: torch.nn.Module, config: OptimizerConfig, device: torch.device
) -> tuple[torch.optim.AdamW, list[str]]:
    """Return the optimizer and the parameter names in its state order (for checkpoints)."""
    groups = param_groups(model, config.weight_decay)
    names_by_param = {id(p): name for name, p in model.named_parameters()}
    ordered_names = [names_by_param[id(p)] for group in groups for p in group["params"]]
    return adamw(groups, config, device), ordered_names


def adamw(groups: list[dict], config: OptimizerConfig, device: torch.device) -> torch.optim.AdamW:
    """On CUDA, the fused step as one Triton launch a group (``optimizer.multi_tensor``;
    by default where every parameter is a plain fp32 CUDA tensor), else torch's fused
    AdamW (``optimizer.fused``); torch's default step elsewhere."""
    fused = config.fused if config.fused is not None else device.type == "cuda"
    hyper = {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps}
    multi_tensor = config.multi_tensor
    if multi_tensor is None:
        multi_tensor = fused and multi_tensor_adamw.eligible(
            [p for group in groups for p in group["params"]]
        )
    if multi_tensor:
        return multi_tensor_adamw.MultiTensorAdamW(groups, **hyper)
    return torch.optim.AdamW(groups, fused=fused or None, **hyper)


def zero_grads(optimizer: object, params: Iterable[torch.Tensor], *, resident: bool) -> None:
    """Drop the step's gradients; with ``resident``, zero them in place and give every
    trainable parameter one. CUDA graphs with gradient accumulation need that: a backward
    graph's gradients live in the graphs' memory, which the next micro-batch's replay
    overwrites, so AccumulateGrad must add them into ``.grad`` tensors outside it (it adds
    in place into an existing one)."""
    optimizer.zero_grad(set_to_none=not resident)
    if resident:
        for param in params:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)


def folds_clipping(optimizer: object) -> bool:
    """Whether ``optimizer``'s step can clip inside its kernel (a fused torch AdamW, or the
    multi-tensor one)."""
    if isinstance(optimizer, multi_tensor_adamw.MultiTensorAdamW):
        return True
    return isinstance(optimizer, torch.optim.AdamW) and bool(optimizer.defaults.get("fused"))


def step_with_clipping(optimizer: torch.optim.AdamW, norm: torch.Tensor, max_norm: float) -> None:
    """One optimizer step with the gradients clipped to ``max_norm``, inside the kernel.

    The fused AdamW kernel divides each gradient by ``grad_scale`` as it reads it (the
    hook ``torch.amp.GradScaler`` unscales through), so clipping costs no pass of its own
    over all gradients: ``clip_grad_norm_``'s coefficient ``min(1, max_norm / (norm +
    1e-6))`` applied as its reciprocal. ``norm`` stays on the device: no host sync.
    """
    if max_norm > 0:
        optimizer.grad_scale = ((norm.float() + 1e-6) / max_norm).clamp(min=1.0)
    try:
        optimizer.step()
    finally:
        optimizer.__dict__.pop("grad_scale", None)
