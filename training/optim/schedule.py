"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay, or constant."""

from __future__ import annotations

import math

from megalith.config import OptimizerConfig, SchedulerConfig


def learning_rate(
    step: int, schedule: SchedulerConfig, optimizer: OptimizerConfig, train_iters: int
) -> float:
    """The learning rate for optimizer step ``step`` (0-based)."""
    peak, floor = optimizer.lr, optimizer.min_lr
    warmup = schedule.warmup_iters
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule.name == "constant":
        return peak
    total = schedule.decay_iters or train_iters
    if schedule.name == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
    # Warmup-stable-decay: hold the peak, then decay linearly over the last fraction.
    decay_start = total - int(schedule.wsd_decay_fraction * total)
    if step < decay_start:
        return peak
    progress = min(1.0, (step - decay_start) / max(1, total - decay_start))
    return peak - (peak - floor) * progress
