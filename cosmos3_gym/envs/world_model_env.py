"""``WorldModelEnv``: one Cosmos3 forward-dynamics rollout as a ``gymnasium.Env``.

``step(action_chunk)`` asks the model what the next ``chunk`` frames look like when the robot executes the chunk
from the current frame, and continues from the last of them. Observations are ``{"image": uint8 [H, W, 3]}`` (or the
image itself with ``obs_type="pixels"``);
actions are ``Box(-1, 1, (chunk, raw_action_dim), float32)`` in the model's normalised space. The reward comes from
an optional reward model scoring the chunk's frames. Everything model-related lives in ``core.WorldModelCore``
(shared with ``WorldModelVectorEnv``); this class adds Gymnasium's seeding, options and rendering.

Created with ``gym.make("cosmos3_gym/WorldModel-v0", ...)``, ``max_episode_steps`` becomes Gymnasium's ``TimeLimit``
wrapper (the env itself then never truncates); constructed directly, the env truncates after ``max_episode_steps``
chunks itself. Either way a step is one chunk and only one of them counts. The difference shows with
``reward_mode="terminal"``: the env pays the score on the steps that end an episode *inside* it, so under a
``TimeLimit`` wrapper it pays only on termination (``success_threshold``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import gymnasium as gym
import numpy as np

from ..errors import InputError
from .core import WorldModelCore, WorldModelExtras
from .rendering import RENDER_MODES, Renderer, check_render_mode, step_rate

if TYPE_CHECKING:
    from gymnasium.core import RenderFrame

RESET_OPTION_KEYS = ("frames", "task", "initial_state_index", "context_latents")


class WorldModelEnv(WorldModelExtras, gym.Env):
    """Cosmos3 forward dynamics as a Gymnasium environment.

    Args:
        checkpoint: checkpoint directory, hub id or built-in model name; the env loads (and on ``close``
            releases) its own engine, with the settings the checkpoint carries (``checkpoint.checkpoint_defaults``:
            its ``meta.json``) unless given here.
        engine: an already-built ``Cosmos3Engine`` to share between envs (not closed by the env). Give one of the two.
        settings: a ``WorldModelSettings`` (e.g. ``other_env.settings``); replaces the checkpoint's settings.
        **settings fields: any ``WorldModelSettings`` field (domain, raw_action_dim, chunk, num_steps,
            guidance_scale, resolution_tier, fps, task, image_size, observation_size, obs_type, reward_mode,
            success_threshold, max_episode_steps, score_name, action_stats, return_frames, request_options, preset,
            prompt_format, use_system_prompt, flip_gripper, action_history_length, handover, context_frames); wins
            over ``settings`` and the checkpoint's (a changed checkpoint value is logged).
        initial_states: folder / file / frames / list, see ``initial_states.load_initial_states``; not given: the
            checkpoint's; None: frames come from ``reset(options={"frames": ...})`` and ``image_size`` is required.
        reward_model: not given: the checkpoint's (if any); None: reward 0; a registered name, a callable
            ``(frames [B,T,3,H,W] in [0,1], tasks) -> [B]`` or a reward-model instance
            (``cosmos3_gym.rewards.resolve_reward_model``).
        handover_projection: None, or a callable (uint8 frames ``[N, H, W, 3]`` -> ``(frames, projected bool
            [N])``) that replaces each chunk's last frame before it is scored, observed and conditions the next
            chunk; ``info["handover_projected"]`` reports it. A task's env may set one.
        render_mode: None, "rgb_array", "rgb_array_list" or "human" (see ``rendering``).
        device, dtype, vae_dtype, precision, optimize, backend, decoder: how a checkpoint is loaded
            (``load_engine``; e.g. ``precision="fp8"``, ``optimize=True`` on a GPU, ``decoder="light"`` to decode
            with the checkpoint's ``light_decoder/`` instead of the VAE: cheaper, approximate; default: the
            checkpoint's meta.json ``decoder``, else the VAE). Not with ``engine=``.
        num_threads: ``torch.set_num_threads(num_threads)`` in this process before anything loads (a positive int;
            None leaves torch's default, one thread per core). Processes that share a machine's cores (two envs,
            an env and a trainer) should split them: each one's threads otherwise contend for every core.
        tp, cfg_parallel, dp: tensor / CFG / data parallel degrees (``cfg`` is the deprecated name of
            ``cfg_parallel``); above 1 the engine runs in worker processes that the env starts (``load_engine``),
            the env process stays light.

    ``reward_mode``: "per_step" (the chunk's score), "terminal" (the score only on the step that ends the episode
    inside the env) or "relative" (score minus the previous chunk's score; the first chunk's minus 0). With a
    reward model, ``info["score"]`` (also ``info[settings.score_name]``, e.g. ``"coverage"``) is the chunk's score
    and, with a ``success_threshold``, ``info["is_success"]`` (alias ``"success"``) says whether it was reached.
    """

    metadata = {"render_modes": list(RENDER_MODES), "render_fps": None}  # render_fps: fps / chunk, per instance

    def __init__(self, checkpoint: str | os.PathLike | None = None, *, render_mode: str | None = None, **kwargs: Any):
        task = kwargs.get("task")
        if task is not None and not isinstance(task, str):
            raise InputError(f"task: expected a string, got {type(task).__name__} (a list needs the vector env).")
        self.render_mode = check_render_mode(render_mode, self.metadata["render_modes"])
        self._core = WorldModelCore(1, checkpoint=checkpoint, **kwargs)
        self.observation_space = self._core.single_observation_space
        self.action_space = self._core.single_action_space
        settings = self._core.settings
        self.metadata = {**self.metadata, "render_fps": step_rate(settings.fps, settings.chunk)}
        self._renderer = Renderer(self.render_mode, settings.fps)
        # rgb_array_list and human show every frame of a chunk: the engine then decodes them all.
        self._core.keep_all_frames = self.render_mode in ("rgb_array_list", "human")

    # ------------------------------------------------------------------ Gymnasium API

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode. ``options``: ``frames`` (an initial frame instead of the source), ``task`` (this
        episode's instruction), ``initial_state_index`` (a specific item of the source instead of a random one),
        ``context_latents`` (``handover="latent"``: the latent context ``[C, K, h, w]`` to continue from, e.g. an
        earlier ``env.context_latents()``; the observation is ``frames`` if given, else its last frame decoded)."""
        super().reset(seed=seed)
        options = check_reset_options(options, RESET_OPTION_KEYS)
        info = self._core.reset_slot(0, self.np_random, **options)
        self._renderer.on_reset(self._core.frame(0))
        return self._core.observation(0), info

    def step(self, action):
        self._core.check_started([0])  # step before reset: InputError before looking at the action
        action = self._core.check_actions(action, batch=None, field="action")
        result = self._core.step_slots([0], action[None], [self.np_random])
        self._renderer.on_step(result.frames[0])
        return (
            result.observation(0),
            float(result.rewards[0]),
            bool(result.terminated[0]),
            bool(result.truncated[0]),
            result.info(0),
        )

    def render(self) -> np.ndarray | list[RenderFrame] | None:
        """``rgb_array``: the current frame; ``rgb_array_list``: the frames since the last reset or render;
        ``human``: None (the window shows every frame as it is generated)."""
        if self.render_mode is None:
            gym.logger.warn("render() was called without a render_mode; create the env with render_mode='rgb_array'.")
            return None
        if self.render_mode == "rgb_array_list":
            self._core.check_started([0])
            # a list of uint8 frames [H, W, 3] (gymnasium's return type has the invariant list[RenderFrame])
            return cast("list[RenderFrame]", self._renderer.collected())
        if self.render_mode == "human":
            return None
        return self._core.frame(0)

    def close(self) -> None:
        """Idempotent; releases the engine only if the env loaded it from ``checkpoint``."""
        self._renderer.close()
        self._core.close()

    # ------------------------------------------------------------------ world-model extras: WorldModelExtras

    @property
    def task(self) -> str:
        """The current episode's instruction."""
        return self._core.task(0)


def check_reset_options(options: dict[str, Any] | None, allowed: Sequence[str]) -> dict[str, Any]:
    """A copy of ``options`` with only the ``allowed`` keys (InputError naming any other)."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InputError(f"options: expected a dict, got {type(options).__name__}.")
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise InputError(f"options: unknown keys {unknown}; expected some of {list(allowed)}.")
    return dict(options)
