"""AdamW with decoupled weight decay, fused on CUDA."""

from __future__ import annotations

import torch

from training.config import OptimizerConfig
from training.models.flops import param_groups


def build_optimizer(
    model: torch.nn.Module, config: OptimizerConfig, device: torch.device
) -> tuple[torch.optim.AdamW, list[str]]:
    """Return the optimizer and the parameter names in its state order (for checkpoints)."""
    groups = param_groups(model, config.weight_decay)
    names_by_param = {id(p): name for name, p in model.named_parameters()}
    ordered_names = [names_by_param[id(p)] for group in groups for p in group["params"]]
    fused = config.fused if config.fused is not None else device.type == "cuda"
    optimizer = torch.optim.AdamW(
        groups,
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        fused=fused or None,
    )
    return optimizer, ordered_names
