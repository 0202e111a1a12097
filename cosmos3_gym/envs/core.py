"""The world-model logic both environments share: settings, the engine, the reward, and a batch of slots.

A *slot* is one running episode: its current frame, task, step count and last reward-model score. ``WorldModelEnv``
is one slot; ``WorldModelVectorEnv`` is ``num_envs`` slots. ``WorldModelCore.step_slots`` advances any subset of
slots in ONE batched ``engine.step`` call (forward dynamics: current frame + action chunk -> the next ``chunk``
frames), scores the decoded frames with the reward model in one call, and continues each slot from its last frame.
The environments own the random number generators and the Gymnasium bookkeeping (seeding, autoreset, infos).

Frame size. Gymnasium needs a fixed observation space, but the model's output size depends on its input size
(``processor.prepare_conditioning`` fits a frame into the tier's canvas, snapped to multiples of 16, and the chunk
decodes at the content's latent grid times 16). ``model_frame_size`` iterates that map to its fixed point, so a frame
of that size generates frames of the same size forever. Every initial frame is resized to it once, at reset.

Actions. The action space is the model's normalised space, ``Box(-1, 1, (chunk, raw_action_dim), float32)``, and
actions reach the model unchanged. ``action_stats`` (dataset statistics) never changes what the model sees: it only
adds ``info["raw_action"]`` (the chunk in dataset units) and is exposed as ``env.action_stats`` for agents that think
in raw units. Out-of-bounds, NaN/inf, wrongly shaped or non-float actions raise ``InputError`` before the model runs;
wrap the env in ``gymnasium.wrappers.ClipAction`` to clip instead.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from gymnasium import spaces

from .. import processor
from ..engine import Cosmos3Engine, Cosmos3Request
from ..parallel.mesh import ParallelConfig
from ..errors import InputError
from ..media import to_uint8
from ..rewards import resolve_reward_model, validate_reward
from .initial_states import InitialStateSource, check_task, first_frame, load_initial_states, resize_frame

REWARD_MODES = ("per_step", "terminal", "relative")
# Cosmos3Request fields a user may set through ``request_options``; the env sets the others itself.
REQUEST_OPTION_KEYS = ("flow_shift", "use_karras_sigmas", "view_point", "negative_prompt")
# Seeds for the engine's noise generator are drawn below 2**63 (torch.Generator.manual_seed takes any uint64).
_SEED_BOUND = 2**63 - 1


def model_frame_size(height: int, width: int, resolution_tier: int) -> tuple[int, int]:
    """The size ``(H, W)`` of the frames the model generates from a ``height x width`` frame, iterated to the fixed
    point: a frame of the returned size generates frames of the same size. Sizes only shrink along the way."""
    size = (int(height), int(width))
    while True:
        conditioning = processor.prepare_conditioning(np.zeros((*size, 3), np.uint8), resolution_tier, 1)
        generated = tuple(processor.VAE_SPATIAL_FACTOR * n for n in conditioning.latent_hw)
        if generated == size:
            return size
        size = generated


@dataclass
class SlotStep:
    """What one slot's step returns, in Gymnasium's types (Python float and bools)."""

    observation: dict[str, np.ndarray]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class WorldModelCore:
    """Settings, engine, reward model and per-slot state for ``num_slots`` episodes; see the module docstring."""

    def __init__(
        self,
        num_slots: int,
        *,
        checkpoint: str | os.PathLike | None = None,
        engine: Cosmos3Engine | None = None,
        domain: str | int = "droid_lerobot",
        raw_action_dim: int | None = None,
        task: str | Sequence[str | None] | None = None,
        initial_states: Any = None,
        image_size: tuple[int, int] | None = None,
        observation_size: tuple[int, int] | None = None,
        reward_model: Any = None,
        reward_mode: str = "per_step",
        success_threshold: float | None = None,
        max_episode_steps: int | None = None,
        chunk: int = 32,
        num_steps: int = 4,
        guidance_scale: float = 3.0,
        resolution_tier: int = 480,
        fps: float = 15.0,
        action_stats: Any = None,
        return_frames: bool = False,
        request_options: dict[str, Any] | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype | str | None = None,
        tp: int = 1,
        cfg: int = 1,
        dp: int = 1,
    ):
        # Everything that does not need the model is checked before a checkpoint is loaded.
        self.num_slots = num_slots
        self.chunk = _check_int(chunk, "chunk", minimum=1)
        self.num_steps = _check_int(num_steps, "num_steps", minimum=1)
        self.guidance_scale = _check_number(guidance_scale, "guidance_scale", minimum=0.0)
        self.fps = _check_number(fps, "fps", minimum=0.0, inclusive=False)
        if resolution_tier not in processor.RESOLUTION_TIERS:
            raise InputError(
                f"resolution_tier: expected one of {list(processor.RESOLUTION_TIERS)}, got {resolution_tier!r}."
            )
        self.resolution_tier = resolution_tier
        self.max_episode_steps = None if max_episode_steps is None else _check_int(
            max_episode_steps, "max_episode_steps", minimum=1
        )
        self.reward_mode, self.success_threshold = _check_reward_settings(
            reward_model, reward_mode, success_threshold, self.max_episode_steps
        )
        self.return_frames = bool(return_frames)
        self.keep_all_frames = False  # set by an env whose rendering needs every frame of a chunk (see decode_mode)
        self.request_options = _check_request_options(request_options)
        self.default_tasks = _per_slot_tasks(task, num_slots, "task")
        self.initial_states = load_initial_states(initial_states)
        self.frame_size = self._resolve_frame_size(image_size)
        self.observation_size = self.frame_size if observation_size is None else _check_size(
            observation_size, "observation_size"
        )

        self.owns_engine = engine is None
        self.engine = _resolve_engine(checkpoint, engine, device, dtype, ParallelConfig(dp=dp, cfg=cfg, tp=tp))
        try:
            temporal = self.engine.temporal_compression
            if self.chunk % temporal:
                raise InputError(
                    f"chunk: expected a multiple of the VAE's temporal compression ({temporal}) so that the chunk + 1 "
                    f"frames decode to exactly chunk new frames, got {self.chunk}."
                )
            self.domain = domain
            _, self.raw_action_dim = processor.resolve_domain(
                domain, raw_action_dim, action_dim=self.engine.action_dim
            )
            self.action_stats = _resolve_action_stats(action_stats, self.raw_action_dim)
            self.reward_model = _resolve_reward_model(reward_model, self.engine)
        except BaseException:
            if self.owns_engine:
                self.engine.close()
            raise

        self.single_observation_space = spaces.Dict(
            {"image": spaces.Box(0, 255, (*self.observation_size, 3), dtype=np.uint8)}
        )
        self.single_action_space = spaces.Box(-1.0, 1.0, (self.chunk, self.raw_action_dim), dtype=np.float32)

        self._frames: list[np.ndarray | None] = [None] * num_slots  # current frame per slot, uint8 [H, W, 3]
        self._tasks: list[str] = [""] * num_slots
        self._elapsed = np.zeros(num_slots, dtype=np.int64)
        self._last_score = np.zeros(num_slots, dtype=np.float64)
        self._home_device: torch.device | None = None  # set while offloaded
        self.closed = False

    # ------------------------------------------------------------------ construction helpers

    def _resolve_frame_size(self, image_size: tuple[int, int] | None) -> tuple[int, int]:
        if image_size is not None:
            size = _check_size(image_size, "image_size")
            fixed = model_frame_size(*size, self.resolution_tier)
            if fixed != size:
                raise InputError(
                    f"image_size: the model turns a {size[0]}x{size[1]} frame into {fixed[0]}x{fixed[1]} frames at "
                    f"resolution_tier {self.resolution_tier}; use image_size={fixed}."
                )
            return size
        if self.initial_states is None:
            raise InputError(
                "initial_states: give an initial-state source, or image_size=(H, W) and pass the frames at each "
                "reset with options={'frames': ...}."
            )
        frame = self.initial_states[0].frame
        return model_frame_size(frame.shape[0], frame.shape[1], self.resolution_tier)

    # ------------------------------------------------------------------ per-slot state

    def reset_slot(
        self,
        slot: int,
        rng: np.random.Generator,
        *,
        frames: Any = None,
        task: str | None = None,
        initial_state_index: int | None = None,
    ) -> dict[str, Any]:
        """Start a new episode in ``slot``; returns its reset info.

        The frame comes from ``frames`` if given, else item ``initial_state_index`` of the source, else an item drawn
        with ``rng``. The task is ``task`` if given, else the env's task for the slot, else the item's own, else "".
        """
        self._check_open()
        task = check_task(task, "options['task']")
        if frames is not None:
            if initial_state_index is not None:
                raise InputError("options: give either 'frames' or 'initial_state_index', not both.")
            frame, item_task, index = first_frame(frames, "options['frames']"), None, -1
        else:
            if self.initial_states is None:
                raise InputError("options: this env has no initial_states; pass reset(options={'frames': ...}).")
            index = int(rng.integers(len(self.initial_states))) if initial_state_index is None else initial_state_index
            state = self.initial_states[index]
            frame, item_task = state.frame, state.task
        for candidate in (task, self.default_tasks[slot], item_task, ""):
            if candidate is not None:
                self._tasks[slot] = candidate
                break
        self._frames[slot] = resize_frame(frame, self.frame_size)
        self._elapsed[slot] = 0
        self._last_score[slot] = 0.0
        return {"task": self._tasks[slot], "initial_state_index": int(index)}

    def observation(self, slot: int) -> dict[str, np.ndarray]:
        """The slot's observation (a new array every call)."""
        self.check_started([slot])
        return {"image": resize_frame(self._frames[slot], self.observation_size).copy()}

    def task(self, slot: int) -> str:
        """The slot's current instruction."""
        return self._tasks[slot]

    def frame(self, slot: int) -> np.ndarray:
        """The slot's current frame at the model's size, uint8 ``[H, W, 3]`` (a copy)."""
        self.check_started([slot])
        return self._frames[slot].copy()

    def check_started(self, slots: Sequence[int]) -> None:
        """InputError unless the env is open and every slot in ``slots`` has been reset."""
        self._check_open()
        if any(self._frames[slot] is None for slot in slots):
            raise InputError("reset: call reset() before step() or render().")

    def check_actions(self, actions: Any, batch: int | None, field: str) -> np.ndarray:
        """Validated float32 actions ``[chunk, D]`` (``batch=None``) or ``[batch, chunk, D]``; see the module doc."""
        expected = (self.chunk, self.raw_action_dim) if batch is None else (batch, self.chunk, self.raw_action_dim)
        if isinstance(actions, torch.Tensor):
            actions = actions.detach().cpu()
            actions = (actions.float() if actions.is_floating_point() else actions).numpy()  # numpy has no bf16
        try:
            array = np.asarray(actions)
        except ValueError as error:  # ragged nested lists
            raise InputError(f"{field}: expected a float array of shape {expected}, got a ragged sequence.") from error
        if array.dtype.kind != "f":
            raise InputError(f"{field}: expected floating-point values (float32), got dtype {array.dtype}.")
        if array.shape != expected:
            raise InputError(
                f"{field}: expected shape {expected} ({'' if batch is None else 'num_envs, '}chunk, raw_action_dim), "
                f"got {array.shape}."
            )
        array = array.astype(np.float32)
        if not np.isfinite(array).all():
            raise InputError(f"{field}: contains NaN or infinity.")
        if np.abs(array).max() > 1.0:
            raise InputError(
                f"{field}: values must lie in the action space [-1, 1] (the model's normalised actions), got range "
                f"[{array.min():.4g}, {array.max():.4g}]; clip them first, e.g. with gymnasium.wrappers.ClipAction."
            )
        return array

    # ------------------------------------------------------------------ the batched transition

    def step_slots(
        self, slots: Sequence[int], actions: np.ndarray, rngs: Sequence[np.random.Generator]
    ) -> list[SlotStep]:
        """Advance ``slots`` by one chunk each in one batched engine call. ``actions[i]`` (validated by
        ``check_actions``) and ``rngs[i]`` belong to ``slots[i]``; each slot draws its noise seed from its rng."""
        if not slots:
            return []
        self.check_started(slots)
        self.onload()
        seeds = [int(rng.integers(_SEED_BOUND)) for rng in rngs]
        requests = [
            Cosmos3Request(
                mode="forward_dynamics",
                observation=self._frames[slot],
                task=self._tasks[slot],
                actions=action,
                domain=self.domain,
                raw_action_dim=self.raw_action_dim,
                chunk=self.chunk,
                num_steps=self.num_steps,
                guidance_scale=self.guidance_scale,
                fps=self.fps,
                seed=seed,
                resolution_tier=self.resolution_tier,
                **self.request_options,
            )
            for slot, action, seed in zip(slots, actions, seeds)
        ]
        decode = self.decode_mode()
        results = self.engine.step(requests, decode=decode)
        # pixels [3, chunk + 1, H, W]: frame 0 re-renders the conditioning frame, 1.. are the chunk's new frames
        # (decode "last": [3, 1, H, W], the chunk's last frame only).
        first = 1 if decode == "all" else 0
        generated = torch.stack([result.pixels[:, first:].permute(1, 0, 2, 3) for result in results])  # [B,T,3,H,W]
        if generated.shape[-2:] != self.frame_size:
            raise RuntimeError(f"the model generated {tuple(generated.shape[-2:])} frames, expected {self.frame_size}")
        scores = self._score(generated, [self._tasks[slot] for slot in slots])
        frames_uint8 = to_uint8(generated.permute(0, 1, 3, 4, 2).numpy())  # [B, T, H, W, 3]

        steps = []
        for i, slot in enumerate(slots):
            self._frames[slot] = frames_uint8[i, -1].copy()
            self._elapsed[slot] += 1
            info: dict[str, Any] = {
                "task": self._tasks[slot],
                "elapsed_steps": int(self._elapsed[slot]),
                "noise_seed": seeds[i],  # the engine seed of this chunk: Cosmos3Request(seed=...) reproduces it
            }
            terminated = False
            truncated = self.max_episode_steps is not None and bool(self._elapsed[slot] >= self.max_episode_steps)
            reward = 0.0
            if scores is not None:
                score = float(scores[i])
                info["score"] = score
                if self.success_threshold is not None:
                    terminated = score >= self.success_threshold
                    info["success"] = terminated
                if self.reward_mode == "per_step":
                    reward = score
                elif self.reward_mode == "relative":
                    reward = score - float(self._last_score[slot])
                elif terminated or truncated:  # "terminal"
                    reward = score
                self._last_score[slot] = score
            if self.return_frames:
                info["frames"] = frames_uint8[i]
            if self.action_stats is not None:
                info["raw_action"] = np.asarray(self.action_stats.denormalize(actions[i]), dtype=np.float32)
            steps.append(SlotStep(self.observation(slot), reward, bool(terminated), bool(truncated), info))
        return steps

    def decode_mode(self) -> str:
        """"last" when nothing reads more than the chunk's last frame (the observation, the next step's conditioning
        frame, a reward model whose ``frames_read`` is "last"), so the engine decodes only that frame (same values,
        less work); "all" with ``return_frames``, ``keep_all_frames`` (e.g. a render mode that shows every frame) or
        a reward model that may read every frame."""
        reward_reads_last = self.reward_model is None or getattr(self.reward_model, "frames_read", "all") == "last"
        return "last" if reward_reads_last and not (self.return_frames or self.keep_all_frames) else "all"

    def _score(self, frames: torch.Tensor, tasks: list[str]) -> np.ndarray | None:
        """Reward-model scores ``[B]`` for decoded frames ``[B, T, 3, H, W]`` in [0, 1] (None without a model)."""
        if self.reward_model is None:
            return None
        with torch.inference_mode():
            scores = self.reward_model(frames, tasks)
        return validate_reward(scores, len(tasks), self.reward_model).cpu().numpy().astype(np.float64)

    # ------------------------------------------------------------------ device memory and lifetime

    def offload(self) -> None:
        """Move the model (and a torch reward model) to CPU memory until the next ``onload`` or step."""
        self._check_open()
        if self._home_device is not None:
            return
        self._home_device = self.engine.device
        self.engine.offload()
        if self.reward_model is not None:
            self.reward_model.to("cpu")

    def onload(self) -> None:
        """Move the model back to the device it was on before ``offload`` (a no-op when it was not offloaded)."""
        if self._home_device is None:
            return
        self.engine.onload()
        if self.reward_model is not None:
            self.reward_model.to(self._home_device)
        self._home_device = None

    def close(self) -> None:
        """Idempotent; closes the engine only if this core created it."""
        if self.closed:
            return
        self.closed = True
        if self.owns_engine:
            self.engine.close()
        self._frames = [None] * self.num_slots

    def _check_open(self) -> None:
        if self.closed:
            raise InputError("env: the environment is closed.")


# ---------------------------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------------------------


def _resolve_engine(checkpoint, engine, device, dtype, parallel: ParallelConfig):
    """The env's engine: the one given, or one loaded from ``checkpoint``. With tp/cfg/dp > 1 (outside torchrun)
    ``from_pretrained`` starts worker processes and returns a client with the same ``step`` API."""
    if engine is not None:
        if checkpoint is not None:
            raise InputError("checkpoint: give either checkpoint= or engine=, not both.")
        # A Cosmos3Engine, its client-mode handle, or RayEngineReplicas (the vector env's slots spread over them).
        if not all(callable(getattr(engine, name, None)) for name in ("step", "close", "offload", "onload")):
            raise InputError(f"engine: expected a Cosmos3Engine, got {type(engine).__name__}.")
        return engine
    if checkpoint is None:
        raise InputError("checkpoint: required (a checkpoint directory or hub id), unless engine= is given.")
    return Cosmos3Engine.from_pretrained(checkpoint, device=device, dtype=dtype, progress=False, parallel=parallel)


def _resolve_reward_model(spec: Any, engine: Cosmos3Engine):
    if spec is None:
        return None
    return resolve_reward_model(spec, engine.device, vae=engine.vae)


def _check_reward_settings(
    reward_model: Any, reward_mode: Any, success_threshold: Any, max_episode_steps: int | None
) -> tuple[str, float | None]:
    if reward_mode not in REWARD_MODES:
        raise InputError(f"reward_mode: expected one of {list(REWARD_MODES)}, got {reward_mode!r}.")
    if success_threshold is not None:
        if reward_model is None:
            raise InputError("success_threshold: needs a reward_model to score the frames.")
        success_threshold = _check_number(success_threshold, "success_threshold")
    pays_never = success_threshold is None and max_episode_steps is None
    if reward_model is not None and reward_mode == "terminal" and pays_never:
        warnings.warn(
            "reward_mode='terminal' pays the score only on a step that ends the episode inside the env "
            "(success_threshold or the env's own max_episode_steps); with neither, every reward is 0. "
            "gym.make(max_episode_steps=...) adds a TimeLimit wrapper outside the env: construct the env "
            "directly or use gym.make_vec to give the env its horizon.",
            stacklevel=4,
        )
    return reward_mode, success_threshold


def _resolve_action_stats(spec: Any, raw_action_dim: int) -> processor.ActionStats | None:
    if spec is None:
        return None
    stats = spec if isinstance(spec, processor.ActionStats) else processor.ActionStats.from_json(spec)
    if stats.dim != raw_action_dim:
        raise InputError(
            f"action_stats: the statistics have {stats.dim} dims but the domain's actions have {raw_action_dim} "
            "(raw_action_dim)."
        )
    return stats


def _per_slot_tasks(task: Any, num_slots: int, field: str) -> list[str | None]:
    if task is None or isinstance(task, str):
        return [task] * num_slots
    if isinstance(task, (list, tuple)):
        if len(task) != num_slots:
            raise InputError(
                f"{field}: expected a string or a list of {num_slots} (one per env), got {len(task)} items."
            )
        return [check_task(item, f"{field}[{i}]") for i, item in enumerate(task)]
    raise InputError(f"{field}: expected a string or a list of strings, got {type(task).__name__}.")


def _check_request_options(options: dict[str, Any] | None) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InputError(f"request_options: expected a dict, got {type(options).__name__}.")
    unknown = sorted(set(options) - set(REQUEST_OPTION_KEYS))
    if unknown:
        raise InputError(f"request_options: unknown keys {unknown}; expected some of {list(REQUEST_OPTION_KEYS)}.")
    return dict(options)


def _check_int(value: Any, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise InputError(f"{field}: expected an integer >= {minimum}, got {value!r}.")
    return int(value)


def _check_number(value: Any, field: str, minimum: float | None = None, inclusive: bool = True) -> float:
    is_number = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value):
        raise InputError(f"{field}: expected a finite number, got {value!r}.")
    if minimum is not None and (value < minimum or (not inclusive and value == minimum)):
        raise InputError(f"{field}: expected a number {'>=' if inclusive else '>'} {minimum}, got {value!r}.")
    return float(value)


def _check_size(size: Any, field: str) -> tuple[int, int]:
    if (
        not isinstance(size, (tuple, list))
        or len(size) != 2
        or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in size)
    ):
        raise InputError(f"{field}: expected (height, width) as two positive integers, got {size!r}.")
    return int(size[0]), int(size[1])


class WorldModelExtras:
    """What both envs offer beyond the Gymnasium API, delegated to their ``_core`` (an ``EnvCore``)."""

    _core: "WorldModelCore"

    def offload(self) -> None:
        """Move the model to CPU memory (e.g. while a policy trains on the GPU); the next step moves it back."""
        self._core.offload()

    def onload(self) -> None:
        """Move the model back to its device now rather than at the next step."""
        self._core.onload()

    @property
    def engine(self) -> Cosmos3Engine:
        return self._core.engine

    @property
    def image_size(self) -> tuple[int, int]:
        """The model frame size ``(H, W)`` (of ``render()`` and ``info["frames"]``)."""
        return self._core.frame_size

    @property
    def initial_states(self) -> InitialStateSource | None:
        return self._core.initial_states

    @property
    def action_stats(self) -> processor.ActionStats | None:
        """Dataset statistics to map actions to raw units and back (``.denormalize`` / ``.normalize``)."""
        return self._core.action_stats
