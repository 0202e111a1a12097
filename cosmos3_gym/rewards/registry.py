"""Finding reward models by name: ``resolve_reward_model`` and ``register_reward_model``.

A string spec reads ``NAME[:ARGUMENT][?KEY=VALUE&KEY=VALUE]``, for example ``"classifier:runs/rm"``,
``"classifier:runs/rm?reduce=max"``, ``"goal_image:goal.png"`` or ``"goal_image:goal.png?space=latent"``. NAME is
looked up among the models registered in this process (the built-ins ``classifier`` and ``goal_image`` plus any
``register_reward_model`` call), then among the ``cosmos3_gym.reward_models`` entry points of installed packages
(tasks add theirs this way)::

    [project.entry-points."cosmos3_gym.reward_models"]
    my_rm = "my_package.rewards:make_reward_model"

A factory receives one ``RewardModelSpec`` (the parsed string plus the device and, from environments, the engine's
VAE) and returns a reward model (or a plain ``(frames, tasks) -> rewards`` callable, which gets wrapped).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InputError
from .base import RewardModel
from .callable import CallableRewardModel
from .classifier import ClassifierRewardModel
from .goal_image import GoalImageRewardModel

__all__ = [
    "ENTRY_POINT_GROUP",
    "RewardModelSpec",
    "available_reward_models",
    "register_reward_model",
    "resolve_reward_model",
]

ENTRY_POINT_GROUP = "cosmos3_gym.reward_models"
_NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_SYNTAX = "NAME[:ARGUMENT][?KEY=VALUE&...]"


@dataclass(frozen=True)
class RewardModelSpec:
    """What a reward-model factory is given: the parsed spec string and where the model will run."""

    text: str  # the whole spec string, for names and messages
    name: str
    argument: str | None  # after the ':' (typically a path); None when absent or empty
    options: Mapping[str, str] = field(default_factory=dict)  # the ?KEY=VALUE pairs, values as written
    device: torch.device = torch.device("cpu")
    vae: Any = None  # a Cosmos3VAE when the caller has one (environments pass their engine's)

    def check_options(self, allowed: set[str]) -> None:
        """``InputError`` if an option outside ``allowed`` was given (typos must not be silently ignored)."""
        unknown = sorted(set(self.options) - allowed)
        if unknown:
            raise InputError(
                f"reward_model {self.text!r}: unknown option(s) {unknown}; {self.name!r} accepts {sorted(allowed)}"
            )

    def require_argument(self, what: str) -> str:
        if not self.argument:
            raise InputError(f"reward_model {self.text!r}: expected '{self.name}:{what}'")
        return self.argument

    def float_option(self, key: str, default: float) -> float:
        if key not in self.options:
            return default
        try:
            value = float(self.options[key])
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise InputError(f"reward_model {self.text!r}: option {key}: expected a number, got {self.options[key]!r}")
        return value


RewardModelFactory = Callable[[RewardModelSpec], Any]


def _classifier_factory(spec: RewardModelSpec) -> ClassifierRewardModel:
    spec.check_options({"reduce"})
    path = spec.require_argument("PATH (a directory written by ClassifierRewardModel.save)")
    return ClassifierRewardModel.load(path, device=spec.device, reduce=spec.options.get("reduce"), name=spec.text)


def _goal_image_factory(spec: RewardModelSpec) -> GoalImageRewardModel:
    spec.check_options({"space", "scale"})
    path = spec.require_argument("PATH (an image file)")
    return GoalImageRewardModel(
        path,
        space=spec.options.get("space", "pixel"),
        scale=spec.float_option("scale", 0.05),
        vae=spec.vae,
        device=spec.device,
        name=spec.text,
    )


_FACTORIES: dict[str, RewardModelFactory] = {
    "classifier": _classifier_factory,
    "goal_image": _goal_image_factory,
}


def register_reward_model(name: str, factory: RewardModelFactory, *, replace: bool = False) -> None:
    """Make ``name`` resolvable in this process: ``factory(spec: RewardModelSpec)`` builds the model.

    Registered names take precedence over entry points of the same name; registering a taken name needs
    ``replace=True``.
    """
    if not isinstance(name, str) or not _NAME_PATTERN.fullmatch(name):
        raise InputError(f"name: expected a reward model name matching {_NAME_PATTERN.pattern}, got {name!r}")
    if not callable(factory):
        raise InputError(f"factory: expected a callable (spec) -> reward model, got {type(factory).__name__}")
    if name in _FACTORIES and not replace:
        raise InputError(f"name: reward model {name!r} is already registered; pass replace=True to replace it")
    _FACTORIES[name] = factory


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {entry_point.name: entry_point for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def available_reward_models() -> list[str]:
    """Every name a spec string can use: registered in-process (built-ins included) and from entry points."""
    return sorted(set(_FACTORIES) | set(_entry_points()))


def resolve_reward_model(spec: Any, device: torch.device | str = "cpu", *, vae: Any = None) -> RewardModel | None:
    """Turn ``spec`` into a reward model on ``device``, or ``None`` for ``None``.

    ``spec``: ``None``; a reward model (anything callable with a ``to`` method); a plain callable
    ``(frames, tasks) -> rewards`` (wrapped in ``CallableRewardModel``); or a string
    ``NAME[:ARGUMENT][?KEY=VALUE&...]`` (see the module docstring). ``vae`` is handed to factories that need it
    (``goal_image`` with ``space=latent``).
    """
    if spec is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise InputError(f"device: expected a torch device such as 'cpu' or 'cuda:0', got {device!r}") from error
    if isinstance(spec, str):
        parsed = _parse(spec, device, vae)
        factory = _find_factory(parsed.name)
        try:
            built = factory(parsed)
        except InputError as error:
            if str(error).startswith(f"reward_model {spec!r}"):
                raise
            raise type(error)(f"reward_model {spec!r}: {error}") from error
        model = _as_reward_model(built, device)
        if model is None:
            raise InputError(
                f"reward_model {spec!r}: the factory of {parsed.name!r} returned {type(built).__name__}, "
                "not a reward model or a callable (frames, tasks) -> rewards"
            )
        return model
    if isinstance(spec, type):
        raise InputError(f"reward_model: got the class {spec.__name__}; pass an instance")
    model = _as_reward_model(spec, device)
    if model is None:
        raise InputError(
            f"reward_model: expected None, a spec string ({_SYNTAX}), a reward model or a callable "
            f"(frames, tasks) -> rewards; got {type(spec).__name__}"
        )
    return model


def _parse(text: str, device: torch.device, vae: Any) -> RewardModelSpec:
    argument: str | None
    head, colon, argument = text.partition(":")
    query = None
    if not colon:
        head, question, query_text = head.partition("?")
        argument, query = None, (query_text if question else None)
    elif "?" in argument and not os.path.exists(argument):  # a path with a '?' in it is kept whole
        argument, query = argument.rsplit("?", 1)
    if not _NAME_PATTERN.fullmatch(head):
        raise InputError(
            f"reward_model: cannot parse {text!r}; expected {_SYNTAX} with NAME one of {available_reward_models()}"
        )
    options: dict[str, str] = {}
    if query:
        try:
            pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True)
        except ValueError as error:
            raise InputError(f"reward_model {text!r}: options must read KEY=VALUE&KEY=VALUE ({error})") from error
        for key, value in pairs:
            if key in options:
                raise InputError(f"reward_model {text!r}: option {key!r} given twice")
            options[key] = value
    return RewardModelSpec(text, head, argument or None, options, device, vae)


def _find_factory(name: str) -> RewardModelFactory:
    if name in _FACTORIES:
        return _FACTORIES[name]
    entry_points = _entry_points()
    if name not in entry_points:
        raise InputError(
            f"reward_model: unknown reward model {name!r}; known: {available_reward_models()} (register one with "
            f"register_reward_model or the {ENTRY_POINT_GROUP!r} entry-point group)"
        )
    entry_point = entry_points[name]
    try:
        factory = entry_point.load()
    except Exception as error:  # importing third-party code can fail in any way
        raise InputError(
            f"reward_model: entry point {name!r} ({entry_point.value}) failed to load: {error!r}"
        ) from error
    if not callable(factory):
        raise InputError(f"reward_model: entry point {name!r} ({entry_point.value}) is not callable")
    return factory


def _as_reward_model(candidate: Any, device: torch.device) -> RewardModel | None:
    """``candidate`` on ``device``: a reward model as is, a plain callable wrapped; ``None`` for anything else."""
    if isinstance(candidate, type):
        return None
    if isinstance(candidate, RewardModel):
        moved = candidate.to(device)
        return candidate if moved is None else moved
    if callable(candidate):
        return CallableRewardModel(candidate).to(device)
    return None
