"""The learning-rate schedule both trainers use (world model and VAE)."""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine")


def learning_rate(config, step: int) -> float:
    """Linear warmup over ``warmup_steps``, then constant or cosine decay to ``min_lr_ratio * lr`` at ``steps``.

    ``config`` has ``lr``, ``warmup_steps``, ``steps``, ``lr_schedule`` and ``min_lr_ratio``; ``step`` counts from 0.
    """
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.lr
    span = max(config.steps - config.warmup_steps, 1)
    progress = min(max(step - config.warmup_steps, 0) / span, 1.0)
    floor = config.min_lr_ratio * config.lr
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
