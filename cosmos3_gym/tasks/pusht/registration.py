"""The PushT task's entry point (group ``cosmos3_gym.tasks``): the ``cosmos3_gym/PushT-v0`` id and the built-in
model ``pusht`` (``checkpoint="pusht"`` / ``"builtin:pusht"``). No torch at import: the package import runs it."""

from __future__ import annotations

from pathlib import Path

from ...policy_specs import PolicyKind, register_policy_kind
from ...registration import BuiltinModel, builtin_model, register_builtin_model, register_env

__all__ = ["ASSETS_ENV_VAR", "PUSHT_ENV_ID", "builtin_max_episode_steps", "register"]

PUSHT_ENV_ID = "cosmos3_gym/PushT-v0"
ASSETS_ENV_VAR = "COSMOS3_GYM_PUSHT_ASSETS"  # another folder of the built-in model's layout (env.py)
ENV_MODULE = "cosmos3_gym.tasks.pusht.env"
PUSHT_MODEL = BuiltinModel(
    name="pusht",
    package_dir=Path(__file__).resolve().parent / "assets",
    env_var=ASSETS_ENV_VAR,
    env_entry_point=f"{ENV_MODULE}:make_pusht_env",
    vector_entry_point=f"{ENV_MODULE}:make_pusht_vector_env",
)


def builtin_max_episode_steps() -> int | None:
    """The built-in PushT checkpoint's episode length (its meta.json ``max_episode_steps``); None if not installed."""
    return PUSHT_MODEL.max_episode_steps()


SIMULATOR_ONLY = "in gym-pusht only (`cosmos3-gym eval-real`): it reads the simulator's true state"
FRAME_PUSHER = (
    "in `cosmos3-gym eval-real` and the simulator comparisons (tasks.pusht.compare), which give it the "
    "checkpoint's action statistics"
)
POLICY_KINDS = (
    PolicyKind("scripted", "NOISE", frame_agent=None, runs_where=SIMULATOR_ONLY),
    PolicyKind("scripted-frames", "NOISE", f"{__package__}.frame_pusher:make_frame_pusher", FRAME_PUSHER),
    PolicyKind("scripted-physics", "NOISE", f"{__package__}.frame_pusher:make_frame_pusher", FRAME_PUSHER),
)


def register() -> None:
    """Register the built-in model (the default of ``WorldModel-v0``), the scripted policy specs and
    ``cosmos3_gym/PushT-v0`` (idempotent)."""
    if builtin_model(PUSHT_MODEL.name) is None:
        register_builtin_model(PUSHT_MODEL, default=True)
    for kind in POLICY_KINDS:
        register_policy_kind(kind)
    try:
        import gymnasium  # noqa: F401
    except ImportError:
        return
    register_env(
        PUSHT_ENV_ID,
        PUSHT_MODEL.env_entry_point,
        PUSHT_MODEL.vector_entry_point,
        max_episode_steps=builtin_max_episode_steps(),
    )
