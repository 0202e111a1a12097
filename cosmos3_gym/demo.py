"""``cosmos3-gym demo``: a few short episodes of the default world model, with their videos.

Without a checkpoint the demo runs the built-in PushT world model (its start frames, reward model and settings) and
adds ``side_by_side.mp4`` (the real simulator next to the world model where gym-pusht is installed); if the built-in
model is not installed, a tiny RANDOM-weight checkpoint (``cached_tiny_checkpoint``) on the tabletop image.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from .errors import CheckpointError, InputError
from .checkpoint import checkpoint_defaults
from .evaluation import EvalReport, evaluate_checkpoint, evaluate_policy
from .policy_specs import load_policy

__all__ = ["DEMO_IMAGE", "DEMO_TASK", "cached_tiny_checkpoint", "run_demo", "tiny_checkpoint_cache_dir"]

# The demo's initial state ships inside the package (a copy of examples/assets/tabletop.png) so that the demo also
# runs from an installed wheel.
DEMO_IMAGE = Path(__file__).parent / "assets" / "tabletop.png"
DEMO_TASK = "push the T-shaped block onto the target"


def tiny_checkpoint_cache_dir() -> Path:
    """Where ``cached_tiny_checkpoint`` keeps its checkpoint: ``$XDG_CACHE_HOME/cosmos3_gym`` (default
    ``~/.cache/cosmos3_gym``), one directory per package version."""
    from . import __version__

    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return root / "cosmos3_gym" / f"tiny-checkpoint-{__version__}"


def cached_tiny_checkpoint() -> Path:
    """The tiny RANDOM-weight checkpoint (``testing.build_tiny_checkpoint(seed=0)``), built once into
    ``tiny_checkpoint_cache_dir()`` and reused. Built in a temporary sibling folder and renamed into place, so an
    interrupted or concurrent build never leaves a half-written checkpoint behind."""
    from .checkpoint import validate_checkpoint
    from .testing import build_tiny_checkpoint

    target = tiny_checkpoint_cache_dir()
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
        try:
            build_tiny_checkpoint(building, seed=0)
            building.rename(target)
        except OSError:
            if not target.exists():  # not a concurrent build that got there first
                raise
        finally:
            if building.exists():
                shutil.rmtree(building, ignore_errors=True)
    try:
        validate_checkpoint(target)
    except CheckpointError as error:
        raise CheckpointError(f"{error}\nThe cached tiny checkpoint {target} is damaged; delete it to rebuild.") \
            from error
    return target


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
    from .envs.pusht import builtin_checkpoint_dir

    if policy not in ("random", "agent"):
        raise InputError(f"policy: the demo takes 'random' or 'agent', got {policy!r}.")
    if isinstance(episodes, bool) or not isinstance(episodes, int) or episodes < 1:
        raise InputError(f"episodes: expected an integer >= 1, got {episodes!r}.")
    if checkpoint is None and builtin_checkpoint_dir() is not None:
        return _pusht_demo(Path(out_dir), policy, episodes, steps_per_episode, num_steps, seed, device, dtype,
                           progress)
    random_weights = checkpoint is None
    checkpoint = cached_tiny_checkpoint() if checkpoint is None else checkpoint
    recorded = checkpoint_defaults(checkpoint)
    return evaluate_checkpoint(
        checkpoint, out_dir, policy=policy, episodes=episodes, num_envs=min(episodes, 8), initial_states=DEMO_IMAGE,
        task=DEMO_TASK, max_episode_steps=steps_per_episode, domain=recorded.get("domain", "pusht"),
        chunk=chunk if chunk is not None else recorded.get("chunk", 8), num_steps=num_steps, resolution_tier=256,
        device=device, dtype=dtype, seed=seed, max_videos=episodes, progress=progress,
        extra_settings={"random_weights": random_weights}, log=lambda message: None,
    )


def _pusht_demo(out_dir: Path, policy, episodes, steps_per_episode, num_steps, seed, device, dtype, progress):
    """The built-in PushT world model: episodes in the vector env, then the side-by-side video on the same engine."""
    from .envs.pusht import builtin_checkpoint_dir, make_pusht_vector_env
    from .sim.pusht import side_by_side

    env = make_pusht_vector_env(num_envs=min(episodes, 8), max_episode_steps=steps_per_episode, num_steps=num_steps,
                                return_frames=True, device=device, dtype=dtype)
    try:
        agent = load_policy(policy, env, seed=seed)
        report = evaluate_policy(env, agent, episodes, seed=seed, video_dir=out_dir, max_videos=episodes,
                                 progress=progress, max_episode_steps=steps_per_episode, reward_bounds=(0.0, 1.0))
        video = side_by_side(out_dir / "side_by_side.mp4", seed=seed, num_chunks=steps_per_episode,
                             engine=env.engine, num_steps=num_steps)
    finally:
        env.close()
    report.settings.update(policy=policy, checkpoint=str(builtin_checkpoint_dir()), random_weights=False,
                           side_by_side=video)
    report.to_json(out_dir / "report.json")
    return report
