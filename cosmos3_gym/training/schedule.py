"""The learning-rate schedule the trainers use (world model, VAE, light decoder), and the checks of its settings."""

from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine")


def learning_rate(config, step: int, time_fraction: float = 0.0) -> float:
    """Linear warmup over ``warmup_steps``, then constant or cosine decay to ``min_lr_ratio * lr`` at ``steps``.

    ``config`` has ``lr``, ``warmup_steps``, ``steps``, ``lr_schedule`` and ``min_lr_ratio``; ``step`` counts from 0.
    ``time_fraction``: under a time budget, the share of it spent; the decay follows whichever is further along.
    """
    if config.warmup_steps and step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return config.lr
    span = max(config.steps - config.warmup_steps, 1)
    progress = min(max(max(step - config.warmup_steps, 0) / span, time_fraction), 1.0)
    floor = config.min_lr_ratio * config.lr
    return floor + (config.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_optimizer_settings(config, fail, non_negative: tuple[str, ...]) -> None:
    """The checks every trainer config shares: each of ``non_negative`` (``lr`` among them) a finite number >= 0,
    ``lr`` > 0, ``lr_schedule`` in ``LR_SCHEDULES`` and ``min_lr_ratio`` in [0, 1]; ``fail(name, expected)``
    raises the config's error."""
    for name in non_negative:
        value = getattr(config, name)
        if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            fail(name, "a finite number >= 0")
    if config.lr == 0:
        fail("lr", "a positive number")
    if config.lr_schedule not in LR_SCHEDULES:
        fail("lr_schedule", f"one of {list(LR_SCHEDULES)}")
    if not isinstance(config.min_lr_ratio, (int, float)) or not 0 <= config.min_lr_ratio <= 1:
        fail("min_lr_ratio", "a number in [0, 1]")
