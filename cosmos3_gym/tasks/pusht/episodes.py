"""PushT episodes from the real simulator (gym-pusht), for training and checking the built-in world model.

The simulator is ``gym_pusht``'s ``PushTEnv`` (optional extra ``sim``; imported only when a simulator is made): a
blue disc (the agent) pushes a grey T-shaped block onto a fixed green target pose on a 512 x 512 table. An action is
the agent's target position in table pixels, ``[x, y]`` in [0, 512] (a PD controller moves the agent towards it),
at 10 control steps per second. ``coverage`` is the fraction of the target covered by the block; the task counts as
solved above 0.95, as in gym-pusht.

``generate_pusht_dataset`` writes episodes in the episode dataset layout that ``cosmos3_gym.training`` reads::

    DATASET/
      meta.json    {"domain": "pusht", "raw_action_dim": 2, "fps": 10.0, "image_size": [H, W],
                    "action_normalization": "minmax", "num_episodes": N, "source": "gym_pusht/PushT-v0",
                    "policies": {policy: count}, "task": ..., "steps_per_episode": T, "seed": ...,
                    "success_rate": ..., "mean_final_coverage": ...}
      stats.json   {"action": {"min", "max", "mean", "std", "q01", "q99"}}  (ActionStats.from_json reads it)
      episodes/episode_000000.npz
                   frames uint8 [T+1, H, W, 3] (the frame before each action, then the final frame);
                   actions float32 [T, 2] (raw target positions); task (0-d str); rewards float32 [T] (gym-pusht's
                   reward after each action); coverage float32 [T+1] (of each frame); success bool (coverage > 0.95
                   at some frame); policy (0-d str); sim_seed int64 (``PushTSim.reset(sim_seed)`` restores frame 0);
                   sim_states float64 [T+1, 10]
                   (``PushTSim.restore(sim_states[t])`` restarts at frame t); goal_pose float64 [3] (only
                   ``scripted_random_goal`` episodes: the block pose that episode's pusher aimed for)

Episodes come from a mix of policies so that the model sees both success and failure: ``random`` (the agent
wanders between random waypoints, touching the block now and then), ``scripted`` (a pusher that walks around the
T and pushes it towards the target pose; its targets get Gaussian noise of a few levels), and ``replay`` (a
noise-free scripted episode replayed from the same start with noisy actions, so near-misses of good pushes).

``side_by_side`` renders the simulator and a world-model env from the same start under the same actions into one
video (a world-model-only video where gym-pusht is not installed).

This module is the PushT façade: the simulator (``pusht_sim``), the T's geometry (``pusht_geometry``), the reference
policies (``pusht_policies``), dataset generation (``pusht_dataset``) and frame metrics (``pusht_metrics``) live in
their own modules and are re-exported here under their old names; ``side_by_side`` lives here.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ...errors import InputError
from ...media import write_video
from .dataset import (  # noqa: F401  (re-exported)
    DEFAULT_POLICY_MIX,
    POLICIES,
    RANDOM_GOAL_HIGH,
    RANDOM_GOAL_LOW,
    _check_policy_mix,
    action_statistics,
    episode_policy,
    generate_pusht_dataset,
    parse_policy_mix,
    random_goal_pose,
    write_dataset_files,
)
from .geometry import (  # noqa: F401  (re-exported)
    AGENT_RADIUS,
    DOMAIN,
    GOAL_POSE,
    RAW_ACTION_DIM,
    SIM_ENV_ID,
    SIM_FPS,
    SUCCESS_COVERAGE,
    TABLE_SIZE,
    TASK,
    TEE_CENTER_OF_GRAVITY,
    TEE_OUTLINE,
    contact_candidates,
    distance_to_outline,
    rotation,
    tee_center,
    tee_outline,
    wrap_angle,
)
from .metrics import psnr  # noqa: F401  (re-exported)
from .policies import (  # noqa: F401  (re-exported)
    REPLAY_NOISE,
    SCRIPTED_NOISE_LEVELS,
    RandomWaypoints,
    Replay,
    ScriptedPusher,
)
from .sim import (  # noqa: F401  (re-exported)
    SIM_STATE_FIELDS,
    PushTSim,
    _check_image_size,
    drawn,
    has_gym_pusht,
    require_gym_pusht,
    rollout_episode,
)

__all__ = [
    "AGENT_RADIUS",
    "GOAL_POSE",
    "POLICIES",
    "SIM_ENV_ID",
    "SUCCESS_COVERAGE",
    "TASK",
    "PushTSim",
    "RandomWaypoints",
    "ScriptedPusher",
    "action_statistics",
    "contact_candidates",
    "generate_pusht_dataset",
    "require_gym_pusht",
    "rollout_episode",
    "side_by_side",
    "tee_center",
    "tee_outline",
    "write_dataset_files",
]


def side_by_side(
    path: str | os.PathLike,
    *,
    seed: int = 0,
    num_chunks: int = 6,
    assets_dir: str | os.PathLike | None = None,
    **env_kwargs: Any,
) -> dict[str, Any]:
    """Write a video of the PushT world model; where gym-pusht is installed, next to the real simulator.

    With gym-pusht, each video frame is ``[simulator | world model]``: the simulator starts from
    ``PushTSim.reset(seed)`` and the noise-free ``ScriptedPusher`` acts for ``num_chunks`` chunks; the world model
    starts from the same frame and steps through the same actions (normalised with the checkpoint's action
    statistics). Without it, the world model alone, from one of its start frames (drawn with ``seed``), driven by
    the checkpoint's own policy mode (``PolicyAgent``). ``assets_dir`` and ``env_kwargs`` go to ``make_pusht_env``
    (e.g. ``engine=`` to share a loaded model, ``device=``). An mp4 needs imageio-ffmpeg or OpenCV; without either a
    GIF is written next to ``path`` instead.

    Returns ``{"path", "mode": "side_by_side" | "world_model_only", "num_frames", "psnr_per_chunk" (dB, side by
    side only), "final_sim_coverage" (side by side only)}``.
    """
    from ...envs.world_model_env import WorldModelEnv
    from .env import pusht_env_arguments

    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise InputError(f"num_chunks: expected an integer >= 1, got {num_chunks!r}.")
    # return_frames: every generated frame, not only each chunk's last; render: the start frame at the model's size.
    arguments = {**pusht_env_arguments(assets_dir, **env_kwargs), "return_frames": True, "render_mode": "rgb_array"}
    env = WorldModelEnv(**arguments)
    try:
        if has_gym_pusht():
            result, frames = _simulator_and_model(env, seed, num_chunks)
        else:
            result, frames = _model_only(env, arguments, seed, num_chunks)
        fps = env.metadata["render_fps"]
    finally:
        env.close()
    result["path"] = str(write_video(path, frames, fps))
    result["num_frames"] = len(frames)
    return result


def _simulator_and_model(env, seed: int, num_chunks: int) -> tuple[dict[str, Any], np.ndarray]:
    if env.action_stats is None:
        raise InputError(
            "action_stats: the side-by-side video maps simulator actions into the model's space; the "
            "checkpoint has no action_stats.json and none was given."
        )
    chunk = env.action_space.shape[0]
    sim = PushTSim(env.image_size)
    try:
        pusher = ScriptedPusher(np.random.default_rng(seed))
        sim_frames = [drawn(sim.reset(seed))]
        chunks = []
        for _ in range(num_chunks):
            actions: list[np.ndarray] = []
            for _ in range(chunk):
                actions.append(pusher(sim.agent_xy, sim.block_pose))
                sim_frames.append(drawn(sim.step(actions[-1])))
            chunks.append(np.stack(actions))
        final_coverage = sim.coverage
    finally:
        sim.close()

    env.reset(seed=seed, options={"frames": sim_frames[0], "task": TASK})
    model_frames = [env.render()]
    for chunk_actions in chunks:
        normalised = np.clip(env.action_stats.normalize(chunk_actions.astype(np.float32)), -1.0, 1.0)
        info = env.step(normalised)[-1]
        model_frames.extend(info["frames"])
    sim_video, model_video = np.stack(sim_frames), np.stack(model_frames)
    psnr_per_chunk = [
        psnr(sim_video[1 + k * chunk : 1 + (k + 1) * chunk], model_video[1 + k * chunk : 1 + (k + 1) * chunk])
        for k in range(num_chunks)
    ]
    result = {"mode": "side_by_side", "psnr_per_chunk": psnr_per_chunk, "final_sim_coverage": final_coverage}
    return result, np.stack(
        [
            np.concatenate([_label(a, "simulator"), _gap(a), _label(b, "world model")], axis=1)
            for a, b in zip(sim_video, model_video)
        ]
    )


def _model_only(env, arguments: dict[str, Any], seed: int, num_chunks: int) -> tuple[dict[str, Any], np.ndarray]:
    from ...agents import PolicyAgent

    chunk, raw_action_dim = env.action_space.shape
    agent = PolicyAgent(
        env.engine,
        task=arguments.get("task") or TASK,
        domain=arguments["domain"],
        raw_action_dim=raw_action_dim,
        chunk=chunk,
        num_steps=arguments["num_steps"],
        guidance_scale=arguments["guidance_scale"],
        resolution_tier=arguments["resolution_tier"],
        fps=arguments["fps"],
        seed=seed,
    )
    env.reset(seed=seed)
    frames = [env.render()]
    for _ in range(num_chunks):
        info = env.step(agent.act(frames[-1]))[-1]
        frames.extend(info["frames"])
    return {"mode": "world_model_only"}, np.stack([_label(frame, "world model") for frame in frames])


def _label(frame: np.ndarray, text: str) -> np.ndarray:
    """``frame`` under a white strip that names it."""
    from PIL import Image, ImageDraw

    strip = Image.new("RGB", (frame.shape[1], 16), "white")
    ImageDraw.Draw(strip).text((4, 2), text, fill=(0, 0, 0))
    return np.concatenate([np.asarray(strip), frame], axis=0)


def _gap(frame: np.ndarray) -> np.ndarray:
    return np.full((frame.shape[0] + 16, 4, 3), 128, dtype=np.uint8)
