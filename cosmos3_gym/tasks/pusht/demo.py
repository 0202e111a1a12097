"""``cosmos3-gym demo``: a few short episodes of the default world model, with their videos.

Without a checkpoint the demo runs the built-in PushT world model (its start frames, reward model and settings) and
adds ``side_by_side.mp4`` (the real simulator next to the world model where gym-pusht is installed); if the built-in
model is not installed, a tiny RANDOM-weight checkpoint (``testing.cached_tiny_checkpoint``) on the tabletop image.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...checkpoint import checkpoint_defaults
from ...errors import InputError
from ...evaluation import EvalReport, evaluate_checkpoint, evaluate_policy
from ...policy_specs import load_policy

__all__ = ["DEMO_IMAGE", "DEMO_TASK", "run_demo"]

# The demo's initial state ships inside the package (a copy of examples/assets/tabletop.png) so that the demo also
# runs from an installed wheel.
DEMO_IMAGE = Path(__file__).resolve().parents[2] / "assets" / "tabletop.png"
DEMO_TASK = "push the T-shaped block onto the target"
# What acts in side_by_side.mp4 (``episodes.side_by_side``), by its mode: not the episodes' ``policy``, which
# report.json's ``settings.policy`` names. Recorded in ``settings.side_by_side`` ("policy", "description").
SIDE_BY_SIDE_DRIVERS = {
    "side_by_side": {
        "policy": "scripted:0",
        "description": "the real simulator next to the world model, both driven by the simulator's scripted pusher "
        "(scripted:0), not the episodes' policy",
    },
    "world_model_only": {
        "policy": "agent",
        "description": "the world model alone, driven by the checkpoint's own policy (agent), not the episodes' "
        "policy (pip install gym-pusht for the simulator next to it)",
    },
}


def run_demo(
    out_dir: str | os.PathLike,
    *,
    checkpoint: str | os.PathLike | None = None,
    policy: str = "random",
    episodes: int = 2,
    steps_per_episode: int = 3,
    chunk: int | None = None,
    num_steps: int = 4,
    seed: int = 0,
    device: str | None = None,
    dtype: str | None = None,
    progress: bool = True,
) -> EvalReport:
    """A few short episodes with a ``"random"`` or ``"agent"`` policy; writes ``out_dir/report.json`` and one mp4 per
    episode (see the module docstring for the model it uses without ``checkpoint``)."""
    from .env import builtin_checkpoint_dir

    if policy not in ("random", "agent"):
        raise InputError(f"policy: the demo takes 'random' or 'agent', got {policy!r}.")
    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise InputError(f"episodes: expected an integer >= 1, got {episodes!r}.")
    if checkpoint is None and builtin_checkpoint_dir() is not None:
        if chunk is not None:  # the built-in model was trained on one chunk length; say so rather than ignore it
            raise InputError(
                f"chunk: the built-in PushT model runs at the chunk it was trained for; got {chunk!r}. Pass a "
                "checkpoint to choose the chunk."
            )
        return _pusht_demo(Path(out_dir), policy, episodes, steps_per_episode, num_steps, seed, device, dtype, progress)
    random_weights = checkpoint is None
    if checkpoint is None:
        from ...testing import cached_tiny_checkpoint  # only on request: production code does not need the factory

        checkpoint = cached_tiny_checkpoint()
    recorded = checkpoint_defaults(checkpoint)
    return evaluate_checkpoint(
        checkpoint,
        out_dir,
        policy=policy,
        episodes=episodes,
        num_envs=min(episodes, 8),
        initial_states=DEMO_IMAGE,
        task=DEMO_TASK,
        max_episode_steps=steps_per_episode,
        domain=recorded.get("domain", "pusht"),
        chunk=chunk if chunk is not None else recorded.get("chunk", 8),
        num_steps=num_steps,
        resolution_tier=256,
        device=device,
        dtype=dtype,
        seed=seed,
        max_videos=episodes,
        progress=progress,
        extra_settings={"random_weights": random_weights},
        log=lambda message: None,
    )


def _pusht_demo(out_dir: Path, policy, episodes, steps_per_episode, num_steps, seed, device, dtype, progress):
    """The built-in PushT world model: episodes in the vector env, then the side-by-side video on the same engine."""
    from .env import builtin_checkpoint_dir, make_pusht_vector_env
    from .episodes import side_by_side

    env = make_pusht_vector_env(
        num_envs=min(episodes, 8),
        max_episode_steps=steps_per_episode,
        num_steps=num_steps,
        return_frames=True,
        device=device,
        dtype=dtype,
    )
    try:
        agent = load_policy(policy, env, seed=seed)
        report = evaluate_policy(
            env,
            agent,
            episodes,
            seed=seed,
            video_dir=out_dir,
            max_videos=episodes,
            progress=progress,
            max_episode_steps=steps_per_episode,
            reward_bounds=(0.0, 1.0),
        )
        video = side_by_side(
            out_dir / "side_by_side.mp4",
            seed=seed,
            num_chunks=steps_per_episode,
            engine=env.engine,
            num_steps=num_steps,
        )
    finally:
        env.close()
    video.update(SIDE_BY_SIDE_DRIVERS[video["mode"]])  # what acts in it: the CLI prints this, report.json holds it
    report.settings.update(
        policy=policy, checkpoint=str(builtin_checkpoint_dir()), random_weights=False, side_by_side=video
    )
    report.to_json(out_dir / "report.json")
    return report
