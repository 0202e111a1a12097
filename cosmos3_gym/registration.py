"""Registering env ids and named built-in models without importing the envs (torch, diffusers).

``import cosmos3_gym`` calls ``register_envs()``: it registers ``cosmos3_gym/WorldModel-v0`` (any checkpoint) and
then runs every entry point of the ``cosmos3_gym.tasks`` group. A task (a bundled one in ``cosmos3_gym.tasks``, or a
user's own package) registers its env ids with Gymnasium and its shipped models with ``register_builtin_model`` there,
so the generic layers reach a task only through this registry::

    [project.entry-points."cosmos3_gym.tasks"]
    my_robot = "my_package.registration:register"

A built-in model is a folder ``ROOT/checkpoint`` (a checkpoint with its ``meta.json``) that ``checkpoint="NAME"`` or
``"builtin:NAME"`` names wherever a checkpoint is accepted; ``WorldModel-v0`` with such a checkpoint builds the env with
the task's own factory, so it is the same env as the task's id.

Ids registered with ``register_env`` (``WorldModel-v0`` and the tasks' ids) build their batched vector env through
``vector_entry_point``, and ``gym.make_vec(ID, num_envs=N, vector_kwargs={"autoreset_mode": ...})`` works as for
Gymnasium's own vector envs: Gymnasium itself refuses ``vector_kwargs`` for any env with a ``vector_entry_point``
("Custom vector environment can be passed arguments only through kwargs", its PR 952), so ``register_env`` wraps
``gymnasium.make_vec`` once to hand them to the vector env as keywords, for these ids only (every other id, and
``vectorization_mode="sync"`` / ``"async"``, goes to Gymnasium unchanged). ``gym.make_vec(ID, num_envs=N,
autoreset_mode=...)`` is the same env.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ENV_ID",
    "TASK_ENTRY_POINT_GROUP",
    "BuiltinModel",
    "builtin_model",
    "builtin_models",
    "default_builtin_model",
    "register_builtin_model",
    "register_env",
    "register_envs",
]

ENV_ID = "cosmos3_gym/WorldModel-v0"
TASK_ENTRY_POINT_GROUP = "cosmos3_gym.tasks"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltinModel:
    """A model a task ships: ``assets_dir/checkpoint`` is its checkpoint. ``env_entry_point`` and
    ``vector_entry_point`` ("module:function") build its env and vector env from ``WorldModelEnv`` keywords;
    ``env_var`` names an environment variable that points to another folder of the same layout."""

    name: str
    package_dir: Path
    env_entry_point: str
    vector_entry_point: str
    env_var: str | None = None

    @property
    def assets_dir(self) -> Path:
        override = os.environ.get(self.env_var) if self.env_var else None
        return Path(override).expanduser() if override else self.package_dir

    @property
    def checkpoint_dir(self) -> Path:
        return self.assets_dir / "checkpoint"

    def max_episode_steps(self) -> int | None:
        """The checkpoint's meta.json ``max_episode_steps``, for the Gymnasium spec; None when absent or unreadable."""
        try:
            value = json.loads((self.checkpoint_dir / "meta.json").read_text()).get("max_episode_steps")
        except (OSError, ValueError, AttributeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


_BUILTIN_MODELS: dict[str, BuiltinModel] = {}
_DEFAULT_MODEL: list[str] = []  # the model WorldModel-v0 runs without a checkpoint: the first registered as default


def register_builtin_model(model: BuiltinModel, *, default: bool = False) -> None:
    """Make ``checkpoint="NAME"`` / ``"builtin:NAME"`` name ``model`` (idempotent for the same model)."""
    _BUILTIN_MODELS[model.name] = model
    if default and not _DEFAULT_MODEL:
        _DEFAULT_MODEL.append(model.name)


def builtin_model(name: str) -> BuiltinModel | None:
    return _BUILTIN_MODELS.get(name)


def builtin_models() -> list[str]:
    return sorted(_BUILTIN_MODELS)


def default_builtin_model() -> BuiltinModel | None:
    """The built-in model ``WorldModel-v0`` runs when given neither a checkpoint nor an engine, if one is installed."""
    if not _DEFAULT_MODEL:
        return None
    model = _BUILTIN_MODELS[_DEFAULT_MODEL[0]]
    return model if (model.checkpoint_dir / "model_index.json").is_file() else None


_TASKS_LOADED: list[bool] = []


def register_envs() -> None:
    """Register ``cosmos3_gym/WorldModel-v0`` and every task of the ``cosmos3_gym.tasks`` entry-point group
    (idempotent). Gymnasium's ``OrderEnforcing`` is off: the envs check the order of calls themselves.

    ``gym.make(ENV_ID, checkpoint=..., ...)`` builds a ``WorldModelEnv`` and ``gym.make_vec(ENV_ID, num_envs=N, ...)``
    a ``WorldModelVectorEnv`` (through ``vector_entry_point``; ``autoreset_mode=`` and ``group_size=`` go to it);
    ``gym.make(max_episode_steps=...)`` adds a ``TimeLimit``, ``make_vec`` hands it to the vector env (per slot)."""
    try:
        import gymnasium  # noqa: F401 (only whether it imports)
    except ImportError:  # `cosmos3-gym infer` works without Gymnasium
        has_gymnasium = False
    else:
        has_gymnasium = True
    if has_gymnasium:
        register_env(ENV_ID, "cosmos3_gym.envs:make_world_model_env", "cosmos3_gym.envs:make_world_model_vector_env")
    if _TASKS_LOADED:
        return
    _TASKS_LOADED.append(True)
    for entry_point in sorted(importlib.metadata.entry_points(group=TASK_ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            entry_point.load()()
        except Exception as error:  # a broken third-party task must not break `import cosmos3_gym`
            logger.warning(
                "cosmos3_gym: task entry point %r (%s) failed: %s", entry_point.name, entry_point.value, error
            )


# Ids whose vector env takes gym.make_vec's vector_kwargs as keywords (register_env).
_VECTOR_KWARGS_IDS: set[str] = set()


def register_env(env_id: str, entry_point: str, vector_entry_point: str, **kwargs: Any) -> None:
    """Register ``env_id`` with Gymnasium (idempotent; ``order_enforce=False``: the envs check the order of calls
    themselves; ``kwargs`` as ``gymnasium.register``, e.g. ``max_episode_steps``) with a batched
    ``vector_entry_point`` that also takes ``gym.make_vec``'s ``vector_kwargs`` (module docstring). Needs Gymnasium."""
    import gymnasium

    if env_id not in gymnasium.registry:
        gymnasium.register(
            id=env_id, entry_point=entry_point, vector_entry_point=vector_entry_point, order_enforce=False, **kwargs
        )
    _VECTOR_KWARGS_IDS.add(env_id)
    _accept_vector_kwargs()


def _accept_vector_kwargs() -> None:
    """Wrap ``gymnasium.make_vec`` (once) so that for the ids of ``register_env`` built through their
    ``vector_entry_point`` (Gymnasium's default for them), ``vector_kwargs`` become keywords of the vector env."""
    import gymnasium
    from gymnasium.envs import registration

    original = registration.make_vec
    if getattr(original, "_cosmos3_gym_vector_kwargs", False):
        return

    @functools.wraps(original)
    def make_vec(id, num_envs=1, vectorization_mode=None, vector_kwargs=None, wrappers=None, **kwargs):
        if vector_kwargs and _vector_env_takes_vector_kwargs(id, vectorization_mode):
            both = sorted(set(vector_kwargs) & set(kwargs))
            if both:
                raise gymnasium.error.Error(f"{both}: given both in vector_kwargs and as keywords; give them once")
            kwargs, vector_kwargs = {**kwargs, **vector_kwargs}, None
        return original(
            id,
            num_envs=num_envs,
            vectorization_mode=vectorization_mode,
            vector_kwargs=vector_kwargs,
            wrappers=wrappers,
            **kwargs,
        )

    make_vec._cosmos3_gym_vector_kwargs = True  # type: ignore[attr-defined]
    for module in (gymnasium, gymnasium.envs, registration):
        if getattr(module, "make_vec", None) is original:
            module.make_vec = make_vec  # type: ignore[attr-defined]


def _vector_env_takes_vector_kwargs(env_id: Any, vectorization_mode: Any) -> bool:
    import gymnasium
    from gymnasium.envs.registration import EnvSpec, VectorizeMode

    try:
        if vectorization_mode is not None and VectorizeMode(vectorization_mode) != VectorizeMode.VECTOR_ENTRY_POINT:
            return False
        spec = env_id if isinstance(env_id, EnvSpec) else gymnasium.spec(env_id)
    except Exception:  # an unknown id or mode: Gymnasium's own error follows
        return False
    return spec.id in _VECTOR_KWARGS_IDS and spec.vector_entry_point is not None
