"""The world-model logic both environments share: the engine, the reward, and a batch of slots.

The settings live in one ``WorldModelSettings`` (``settings.py``), built once from the checkpoint's own settings
(``checkpoint.checkpoint_defaults``), a task's defaults and the user's keywords.

A *slot* is one running episode: its current frame, task, step count and last reward-model score. ``WorldModelEnv``
is one slot; ``WorldModelVectorEnv`` is ``num_envs`` slots. ``WorldModelCore.step_slots`` advances any subset of
slots in ONE batched ``engine.step`` call (forward dynamics: current frame + action chunk -> the next ``chunk``
frames), scores the decoded frames with the reward model in one call, and continues each slot from its last frame.
The environments own the random number generators and the Gymnasium bookkeeping (seeding, autoreset, infos).

Hand-over (``settings.handover``). "pixels": the next chunk is conditioned on the slot's current frame, which the
engine encodes again. "latent": each slot also keeps a context of ``context_frames`` (K) latent frames on the
engine's device; the next chunk is conditioned on it (``Cosmos3Request.context_latents``) and it becomes the last K
latent frames of (context, the chunk's generated latents), so nothing goes through pixels between chunks. A reset
slot's context is its start frame's latent repeated K times, encoded at its next step together with every other
slot reset since (one encoder call for a vector env's reset or autoreset), or the context given at reset.

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

import inspect
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gymnasium import spaces

from .. import processor
from ..checkpoint import checkpoint_decoder, checkpoint_defaults, resolve_checkpoint, validate_checkpoint
from ..cuda_graphs import DEFAULT_MAX_PADDING
from ..data.initial_states import (
    InitialStateSource,
    check_task,
    first_frame,
    load_initial_states,
    resize_frame,
    resize_frames,
)
from ..engine import Cosmos3Engine, Cosmos3Request
from ..engine_protocol import WorldModelEngine
from ..errors import CheckpointError, InputError, UnknownArgumentsError
from ..launcher import load_engine
from ..rewards import resolve_reward_model, validate_reward
from .settings import (  # noqa: F401 (REWARD_MODES, model_frame_size: re-exported)
    REWARD_MODES,
    WorldModelSettings,
    check_int,
    model_frame_size,
    split_settings,
)

# Seeds for the engine's noise generator are drawn below 2**63 (torch.Generator.manual_seed takes any uint64).
_SEED_BOUND = 2**63 - 1
# "Not given" for arguments whose None means "none" (initial_states, reward_model): not given -> the checkpoint's.
_UNSET: Any = object()
# How to load a checkpoint (handed to ``_resolve_engine``): ``load_engine``'s arguments (``cfg`` is the deprecated
# name of ``cfg_parallel``; ``decoder`` "light" decodes with the checkpoint's light_decoder/ instead of the VAE).
ENGINE_LOAD_KEYS = (
    "device",
    "dtype",
    "vae_dtype",
    "precision",
    "optimize",
    "backend",
    "tp",
    "cfg_parallel",
    "cfg",
    "dp",
    "decoder",
)


@dataclass
class StepBatch:
    """What ``step_slots`` returns for the slots it advanced, as arrays over those slots (row ``i`` is
    ``slots[i]``): built once per step with array operations, not per slot. ``infos`` holds one array per info key
    with Gymnasium's vector-info dtypes (int -> int64, float -> float64, bool -> bool, str -> object)."""

    slots: list[int]
    rewards: np.ndarray  # float64 [B]
    terminated: np.ndarray  # bool [B]
    truncated: np.ndarray  # bool [B]
    infos: dict[str, np.ndarray]  # key -> [B, ...]
    frames: np.ndarray  # the chunk's generated frames, uint8 [B, T, H, W, 3] (for rendering)
    # frames uint8 [B, H, W, 3] -> their observations (the core's): built only for the rows that need one
    observe: Callable[[np.ndarray], dict[str, np.ndarray] | np.ndarray]

    def observation(self, i: int) -> dict[str, np.ndarray] | np.ndarray:
        """Row ``i``'s observation (a new array): its last frame, in the env's observation form."""
        batch = self.observe(self.frames[i : i + 1, -1])
        return {key: value[0] for key, value in batch.items()} if isinstance(batch, dict) else batch[0]

    def info(self, i: int) -> dict[str, Any]:
        """Row ``i``'s info as a single env returns it (Python scalars, arrays for array entries)."""
        return {
            key: values[i].item() if values.ndim == 1 and values.dtype != object else values[i]
            for key, values in self.infos.items()
        }


class WorldModelCore:
    """Settings, engine, reward model and per-slot state for ``num_slots`` episodes; see the module docstring.

    Keyword arguments: ``checkpoint`` or ``engine``; ``settings`` (a ``WorldModelSettings``) and/or any of its
    fields; ``initial_states``, ``reward_model`` (not given: the checkpoint's; None: none); ``handover_projection``
    (None, or a callable uint8 frames ``[N, H, W, 3]`` -> ``(frames, projected bool [N])`` that cleans each chunk's
    last frame before it is scored, observed and conditions the next chunk, e.g. a task's rigid-body re-drawing; not
    with ``handover="latent"``, where no frame conditions the next chunk); how to
    load a checkpoint (``ENGINE_LOAD_KEYS``); ``num_threads`` (``torch.set_num_threads`` for this process, first).

    Precedence, lowest first: ``WorldModelSettings``' defaults (or ``settings=``), the checkpoint's own settings
    (``checkpoint_defaults``; for settings fields only when ``settings=`` is not given: that object is complete),
    the keywords. Keywords that change a checkpoint's value are logged. The checkpoint's meta.json ``decoder``
    (``checkpoint_decoder``) is its default ``decoder`` where none is given and one rank decodes.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        checkpoint: str | os.PathLike | None = None,
        engine: Cosmos3Engine | None = None,
        settings: WorldModelSettings | None = None,
        initial_states: Any = _UNSET,
        reward_model: Any = _UNSET,
        handover_projection: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
        num_threads: int | None = None,
        **kwargs: Any,
    ):
        # Everything that does not need the model is checked before a checkpoint is loaded.
        if num_threads is not None:
            # Process-wide, and first: the checkpoint then loads with it too. torch's default (one thread per core)
            # oversubscribes the cores when several processes share them (issue 41: 15 s instead of 0.7 s a step).
            torch.set_num_threads(check_int(num_threads, "num_threads", minimum=1))
        overrides = split_settings(kwargs)
        load_options = {key: kwargs.pop(key) for key in ENGINE_LOAD_KEYS if key in kwargs}
        if kwargs:
            raise UnknownArgumentsError(
                f"{sorted(kwargs)}: unknown arguments (unexpected keyword argument {sorted(kwargs)[0]!r}); expected "
                f"settings {list(WorldModelSettings.field_names())}, "
                f"engine options {list(ENGINE_LOAD_KEYS)}, checkpoint, engine, settings, initial_states, "
                "reward_model, handover_projection or num_threads."
            )
        if handover_projection is not None and not callable(handover_projection):
            raise InputError(
                f"handover_projection: expected a callable or None, got {type(handover_projection).__name__}."
            )
        self.handover_projection = handover_projection
        carried: dict[str, Any] = {}
        if checkpoint is not None and engine is None:
            checkpoint = resolve_checkpoint(checkpoint)
            check_is_checkpoint(checkpoint)  # a folder that is not one says so, not that it lacks initial_states
            carried = checkpoint_defaults(checkpoint)
            _default_decoder(checkpoint, load_options)
        if initial_states is _UNSET:
            initial_states = carried.get("initial_states")
        if reward_model is _UNSET:
            reward_model = carried.get("reward_model")
        carried = split_settings(carried) if settings is None else {}
        # A shared engine's own preset (from_pretrained(preset=...)) is the env's unless it names another.
        engine_preset = getattr(engine, "preset", None)
        if engine_preset is not None and "preset" not in overrides and getattr(settings, "preset", None) is None:
            overrides["preset"] = engine_preset
        self.settings = WorldModelSettings.build(settings, carried, overrides, source=f"the checkpoint {checkpoint}")
        if handover_projection is not None and self.settings.handover == "latent":
            raise InputError(
                "handover_projection: edits the frame that conditions the next chunk, but with handover='latent' "
                "the chunk's latent frames do; use handover='pixels' with a projection."
            )
        self.num_slots = num_slots
        self.default_tasks = _per_slot_tasks(self.settings.task, num_slots, "task")
        self.keep_all_frames = False  # set by an env whose rendering needs every frame of a chunk (see decode_mode)
        _check_reward_settings(reward_model, self.settings)
        self.initial_states = load_initial_states(initial_states)
        self.frame_size = self._resolve_frame_size(self.settings.image_size)
        self.observation_size = self.settings.observation_size or self.frame_size

        self.owns_engine = engine is None
        self.engine = _resolve_engine(checkpoint, engine, **load_options)
        try:
            self.settings.check_engine(self.engine)
            self.reward_model = _resolve_reward_model(reward_model, self.engine)
        except BaseException:
            if self.owns_engine:
                self.engine.close()
            raise

        image_space = spaces.Box(0, 255, (*self.observation_size, 3), dtype=np.uint8)
        self.single_observation_space = (
            image_space if self.settings.obs_type == "pixels" else spaces.Dict({"image": image_space})
        )
        raw_action_dim = self.settings.raw_action_dim
        assert raw_action_dim is not None  # WorldModelSettings resolves it from the domain
        self.single_action_space = spaces.Box(-1.0, 1.0, (self.settings.chunk, raw_action_dim), dtype=np.float32)

        # The current frame of every slot, uint8 [num_slots, H, W, 3], in one array: a step writes the new frames of
        # all its slots with one assignment and the vector env's observations are one copy of it.
        self._frames = np.zeros((num_slots, *self.frame_size, 3), dtype=np.uint8)
        self._started = np.zeros(num_slots, dtype=np.bool_)  # reset at least once
        self._history: list[np.ndarray | None] = [None] * num_slots  # last executed action rows per slot
        self._tasks: list[str] = [""] * num_slots
        self._elapsed = np.zeros(num_slots, dtype=np.int64)
        self._last_score = np.zeros(num_slots, dtype=np.float64)
        # handover "latent": every slot's context [num_slots, C, K, h, w] on the engine's device (module docstring),
        # and the slots whose context is still to be encoded from their current (start) frame.
        self._context: torch.Tensor | None = None
        self._context_pending = np.zeros(num_slots, dtype=np.bool_)
        if self.settings.handover == "latent":
            latent_hw = [size // processor.VAE_SPATIAL_FACTOR for size in self.frame_size]  # a fixed point's latents
            shape = (num_slots, self.engine.vae.latent_channels, self.settings.context_frames, *latent_hw)
            self._context = torch.zeros(shape, device=self.engine.device)
        self._home_device: torch.device | None = None  # set while offloaded
        self.closed = False

    # ------------------------------------------------------------------ construction helpers

    def _resolve_frame_size(self, image_size: tuple[int, int] | None) -> tuple[int, int]:
        if image_size is not None:
            return image_size  # checked against the tier by WorldModelSettings
        if self.initial_states is None:
            raise InputError(
                "initial_states: give an initial-state source, or image_size=(H, W) and pass the frames at each "
                "reset with options={'frames': ...}."
            )
        frame = self.initial_states[0].frame
        return model_frame_size(frame.shape[0], frame.shape[1], self.settings.resolution_tier)

    # ------------------------------------------------------------------ per-slot state

    def reset_slot(
        self,
        slot: int,
        rng: np.random.Generator,
        *,
        frames: Any = None,
        task: str | None = None,
        initial_state_index: int | None = None,
        context_latents: Any = None,
    ) -> dict[str, Any]:
        """Start a new episode in ``slot``; returns its reset info.

        The frame comes from ``frames`` if given, else item ``initial_state_index`` of the source, else an item drawn
        with ``rng``. The task is ``task`` if given, else the env's task for the slot, else the item's own, else "".
        ``context_latents`` (handover "latent"): the slot's context ``[C, K, h, w]`` (normalised latents, e.g. the
        last K ``video_latents`` frames of a rollout or ``env.context_latents()``) instead of the start frame's latent
        repeated; the frame is then ``frames`` if given, else the context's last latent frame decoded.
        """
        self._check_open()
        task = check_task(task, "options['task']")
        context = None if context_latents is None else self._check_context(context_latents)
        if context is not None and initial_state_index is not None:
            raise InputError("options: give either 'context_latents' or 'initial_state_index', not both.")
        if frames is not None:
            if initial_state_index is not None:
                raise InputError("options: give either 'frames' or 'initial_state_index', not both.")
            frame, item_task, index = first_frame(frames, "options['frames']"), None, -1
        elif context is not None:
            frame, item_task, index = self._decode_last_latent(context), None, -1
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
        if self._context is not None:
            if context is not None:
                self._context[slot] = context
            self._context_pending[slot] = context is None  # encoded from the frame at the slot's next step
        self._started[slot] = True
        self._history[slot] = None
        self._elapsed[slot] = 0
        self._last_score[slot] = 0.0
        return {"task": self._tasks[slot], "initial_state_index": int(index)}

    def _check_context(self, value: Any) -> torch.Tensor:
        """A reset's ``context_latents`` as float32 on the context's device; ``InputError`` unless it fits."""
        if self._context is None:
            raise InputError(
                "options['context_latents']: a latent context needs handover='latent'; this env hands over in pixels."
            )
        expected = list(self._context.shape[1:])
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and list(value.shape) == expected):
            got = f"shape {list(value.shape)}, dtype {value.dtype}" if isinstance(value, torch.Tensor) else None
            raise InputError(
                f"options['context_latents']: expected a float tensor {expected} (C, context_frames, h, w: normalised "
                f"latents as Cosmos3Result.video_latents holds them), got {got or type(value).__name__}."
            )
        return value.to(self._context.device, torch.float32)

    def _decode_last_latent(self, context: torch.Tensor) -> np.ndarray:
        """The frame uint8 ``[H, W, 3]`` of a context's last latent frame, decoded alone (the engine's decoder)."""
        pixels = self.engine.decode_latents(context[None, :, -1:], frames="last")  # [1, 3, 1, H, W]
        return _to_uint8_frames(pixels.transpose(1, 2))[0, 0]

    def context_latents(self, slot: int) -> torch.Tensor:
        """The slot's latent context ``[C, K, h, w]`` (a copy, on the engine's device; handover "latent"): what its
        next chunk is conditioned on; ``reset(options={"context_latents": ...})`` continues from it."""
        self.check_started([slot])
        if self._context is None:
            raise InputError("context_latents: this env hands over in pixels (handover='pixels'); it keeps no context.")
        self._encode_pending_contexts()
        return self._context[slot].clone()

    def _encode_pending_contexts(self) -> None:
        """The contexts of the slots reset from a frame since their last step: the frames' latents repeated K times,
        all in one ``encode_frames`` call."""
        if self._context is None:
            return
        pending = np.flatnonzero(self._context_pending)
        if not len(pending):
            return
        settings = self.settings
        latents = self.engine.encode_frames(
            self._frames[pending],
            resolution_tier=settings.resolution_tier,
            canvas=settings.request_options.get("canvas"),
            preset=settings.preset,
        )  # [N, C, 1, h, w]
        repeated = latents.to(self._context.device).expand(-1, -1, settings.context_frames, -1, -1)
        self._context[torch.from_numpy(pending)] = repeated
        self._context_pending[pending] = False

    def observation(self, slot: int) -> dict[str, np.ndarray] | np.ndarray:
        """The slot's observation (a new array every call), in the form of ``settings.obs_type``."""
        self.check_started([slot])
        return self._as_observation(self._images(self._frames[slot : slot + 1])[0])

    def observations(self) -> dict[str, np.ndarray] | np.ndarray:
        """Every slot's observation, batched ``[num_slots, ...]`` (new arrays), in the form of ``obs_type``."""
        self.check_started(range(self.num_slots))
        return self._as_observation(self._images(self._frames))

    def _images(self, frames: np.ndarray) -> np.ndarray:
        """Observation images (a new array) of frames uint8 ``[B, H, W, 3]`` at the model's size."""
        return resize_frames(frames, self.observation_size)

    def _as_observation(self, images: np.ndarray) -> dict[str, np.ndarray] | np.ndarray:
        return images if self.settings.obs_type == "pixels" else {"image": images}

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
        if not self._started[np.asarray(slots, dtype=np.int64)].all():
            raise InputError("reset: call reset() before step() or render().")

    def check_actions(self, actions: Any, batch: int | None, field: str) -> np.ndarray:
        """Validated float32 actions ``[chunk, D]`` (``batch=None``) or ``[batch, chunk, D]``; see the module doc."""
        single = (self.settings.chunk, self.settings.raw_action_dim)
        expected = single if batch is None else (batch, *single)
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
    ) -> StepBatch | None:
        """Advance ``slots`` by one chunk each in one batched engine call. ``actions[i]`` (validated by
        ``check_actions``) and ``rngs[i]`` belong to ``slots[i]``; each slot draws its noise seed from its rng."""
        if not len(slots):
            return None
        self.check_started(slots)
        self.onload()
        self._encode_pending_contexts()
        context = self._context
        seeds = [int(rng.integers(_SEED_BOUND)) for rng in rngs]
        samples = self.settings.imagination_samples
        # Further imagined samples of the same chunk (imagination_samples): their seeds come after the slot's own,
        # so with one sample the random streams are as they always were.
        extra_seeds = [[int(rng.integers(_SEED_BOUND)) for rng in rngs] for _ in range(samples - 1)]
        fields = self.settings.request_fields()
        requests = [
            Cosmos3Request(
                mode="forward_dynamics",
                observation=self._frames[slot] if context is None else None,
                context_latents=None if context is None else context[slot],
                task=self._tasks[slot],
                action=action,
                action_history=self._action_history(slot, action),
                seed=seed,
                context_noise=self.settings.context_noise,
                **fields,
            )
            for sample_seeds in [seeds, *extra_seeds]
            for slot, action, seed in zip(slots, actions, sample_seeds)
        ]
        decode = self.decode_mode()
        # An engine that can (Cosmos3Engine) leaves the pixels on its device: the reward model and the uint8
        # conversion run there on the whole batch, and only the uint8 frames come to the host, in one copy.
        # The latents stay there too: a latent hand-over continues from them on the device, a pixel one never reads
        # them (each slot's latents were a device -> host copy a step).
        on_device = {
            keyword: True
            for keyword in ("pixels_on_device", "latents_on_device")
            if _takes_keyword(self.engine.step, keyword)
        }
        results = self.engine.step(requests, decode=decode, **on_device)
        # pixels [3, chunk + 1, H, W]: frame 0 re-renders the conditioning frame, 1.. are the chunk's new frames
        # (decode "last": [3, 1, H, W], the chunk's last frame only).
        first = 1 if decode == "all" else 0
        # [K * B, T, 3, H, W] float32 (the values the host copies of a bf16 VAE's pixels had), sample-major
        generated = _stack_rows([result.pixels[:, first:] for result in results]).transpose(1, 2).float()
        if generated.shape[-2:] != self.frame_size:
            raise RuntimeError(f"the model generated {tuple(generated.shape[-2:])} frames, expected {self.frame_size}")
        projected = None
        if self.handover_projection is not None:
            generated, projected = self._project_last_frames(generated)
        scores = self._score(generated, [self._tasks[slot] for slot in slots] * samples)
        sample_scores = None
        if scores is not None and samples > 1:
            sample_scores = scores.reshape(samples, len(slots)).T  # [B, K]
            scores = (
                sample_scores.mean(axis=1) if self.settings.imagination_reduce == "mean" else sample_scores.min(axis=1)
            )
        # [B, T, H, W, 3]: the first sample goes on. In a reused pinned buffer unless the frames are handed out
        # (return_frames, a renderer's list): a fresh pageable 50 MB array at 256 slots was page faults and staging.
        staging = not (self.settings.return_frames or self.keep_all_frames)
        frames_uint8 = _to_uint8_frames(generated[: len(slots)], staging=staging)
        if context is not None:
            # video_latents are (context, generated latents): their last K frames are the next context
            latents = _stack_rows([result.video_latents for result in results[: len(slots)]])
            context[torch.tensor(slots)] = latents[:, :, -context.shape[2] :].to(context.device)
        batch = self._finish_step(list(slots), np.asarray(actions), seeds, scores, frames_uint8)
        if sample_scores is not None:
            batch.infos["score_samples"] = sample_scores
        if projected is not None:
            batch.infos["handover_projected"] = projected[: len(slots)]
        return batch

    def _project_last_frames(self, generated: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        """``handover_projection`` applied to the last frame of every generated chunk ``[B, T, 3, H, W]``: the
        frames with their last one replaced (a new tensor; the other frames stay as generated) and ``projected [B]``.
        Before scoring, so the reward, the observation and the next chunk's conditioning frame are one frame."""
        assert self.handover_projection is not None  # called only with a projection
        last = _to_uint8_frames(generated[:, -1:])[:, 0]  # [B, H, W, 3]
        frames, projected = self.handover_projection(last)
        projected = np.asarray(projected, dtype=np.bool_)
        pixels = torch.from_numpy(np.ascontiguousarray(frames)).to(generated.device).permute(0, 3, 1, 2)
        generated = torch.cat([generated[:, :-1], pixels[:, None].to(generated.dtype) / 255.0], dim=1)
        return generated, projected

    def _finish_step(
        self,
        slots: list[int],
        actions: np.ndarray,
        seeds: list[int],
        scores: np.ndarray | None,
        frames_uint8: np.ndarray,
    ) -> StepBatch:
        """The slots' new state, rewards, flags and infos from the step's frames and scores, as arrays."""
        settings = self.settings
        index = np.asarray(slots, dtype=np.int64)
        if index[-1] - index[0] + 1 == len(index) and (np.diff(index) == 1).all():
            self._frames[index[0] : index[-1] + 1] = frames_uint8[:, -1]  # a block copy, not a gather
        else:
            self._frames[index] = frames_uint8[:, -1]
        if settings.history_length:
            for i, slot in enumerate(slots):
                self._history[slot] = actions[i, -settings.history_length :].copy()
        self._elapsed[index] += 1
        elapsed = self._elapsed[index]
        count = len(slots)
        infos: dict[str, np.ndarray] = {
            "task": _object_array([self._tasks[slot] for slot in slots]),
            "elapsed_steps": elapsed.copy(),
            # the engine seed of this chunk: Cosmos3Request(seed=...) reproduces it
            "noise_seed": np.array(seeds, dtype=np.int64),
        }
        terminated = np.zeros(count, dtype=np.bool_)
        if settings.max_episode_steps is not None:
            truncated = elapsed >= settings.max_episode_steps
        else:
            truncated = np.zeros(count, dtype=np.bool_)
        rewards = np.zeros(count, dtype=np.float64)
        if scores is not None:
            infos["score"] = scores.copy()
            if settings.score_name is not None:
                infos[settings.score_name] = scores.copy()  # e.g. "coverage"
            if settings.success_threshold is not None:
                terminated = scores >= settings.success_threshold
                infos["is_success"] = terminated.copy()  # Gymnasium/SB3's key
                infos["success"] = terminated.copy()  # and ours
            if settings.reward_mode == "per_step":
                rewards = scores.copy()
            elif settings.reward_mode == "relative":
                rewards = scores - self._last_score[index]
            else:  # "terminal"
                rewards = np.where(terminated | truncated, scores, 0.0)
            self._last_score[index] = scores
        if settings.return_frames:
            infos["frames"] = frames_uint8
        if settings.action_stats is not None:
            infos["raw_action"] = np.asarray(settings.action_stats.denormalize(actions), dtype=np.float32)
        observe = lambda frames: self._as_observation(self._images(frames))  # noqa: E731
        return StepBatch(slots, rewards, terminated, truncated, infos, frames_uint8, observe)

    def _action_history(self, slot: int, action: np.ndarray) -> np.ndarray | None:
        """The state rows of the slot's next request when the checkpoint takes them (``history_length``): the last
        executed action rows (joint-position actions: where the robot was sent), and at an episode's first step the
        chunk's first row (the robot taken to be at its first target already)."""
        length = self.settings.history_length
        if not length:
            return None
        if self._history[slot] is None:
            return np.repeat(np.asarray(action)[:1], length, axis=0)
        return self._history[slot]

    def decode_mode(self) -> str:
        """ "last" when nothing reads more than the chunk's last frame (the observation, the next step's conditioning
        frame, a reward model whose ``frames_read`` is "last"), so the engine decodes only that frame (same values,
        less work); "all" with ``return_frames``, ``keep_all_frames`` (e.g. a render mode that shows every frame) or
        a reward model that may read every frame."""
        reward_reads_last = self.reward_model is None or getattr(self.reward_model, "frames_read", "all") == "last"
        return "last" if reward_reads_last and not (self.settings.return_frames or self.keep_all_frames) else "all"

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
        if self._context is not None:
            self._context = self._context.to("cpu")
        if self.reward_model is not None:
            self.reward_model.to("cpu")

    def onload(self) -> None:
        """Move the model back to the device it was on before ``offload`` (a no-op when it was not offloaded)."""
        if self._home_device is None:
            return
        self.engine.onload()
        if self._context is not None:
            self._context = self._context.to(self._home_device)
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
        close_projection = getattr(self.handover_projection, "close", None)
        if callable(close_projection):
            close_projection()
        self._started[:] = False

    def _check_open(self) -> None:
        if self.closed:
            raise InputError("env: the environment is closed.")


# ---------------------------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------------------------


def _takes_keyword(function: Callable, name: str) -> bool:
    """Whether ``function`` accepts the keyword ``name`` (other engines, and wrapped or replaced ``step`` methods,
    may not)."""
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def _stack_rows(rows: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(rows)``; without a copy when the rows are already the consecutive rows of one tensor (the
    engine's results are views of its batch): a 50 MB copy per step at 64 envs on a CPU."""
    first = rows[0]
    step = rows[1].storage_offset() - first.storage_offset() if len(rows) > 1 else first.numel()
    consecutive = step > 0 and all(
        row.shape == first.shape
        and row.stride() == first.stride()
        and row.dtype == first.dtype
        and row.device == first.device
        and row.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and row.storage_offset() == first.storage_offset() + i * step
        for i, row in enumerate(rows)
    )
    if not consecutive:
        return torch.stack(rows)
    return first.as_strided((len(rows), *first.shape), (step, *first.stride()), first.storage_offset())


def _to_uint8_frames(frames: torch.Tensor, staging: bool = False) -> np.ndarray:
    """Frames ``[B, T, 3, H, W]`` in [0, 1] -> uint8 ``[B, T, H, W, 3]`` in one pass over the batch, with the same
    float32 arithmetic as ``media.to_uint8`` (clip, * 255, + 0.5, truncate), so the values are identical.

    ``staging`` (frames on a GPU): the result is a view of pinned host memory from torch's caching host allocator,
    reused from step to step once the previous view is gone, for a caller that copies what it keeps and hands none of
    it out; otherwise a new array of its own."""
    batch, steps, _, height, width = frames.shape
    out = torch.empty((batch, steps, height, width, 3), dtype=torch.uint8, device=frames.device)
    # One pass on a GPU. On a CPU in slices of about a megabyte: a temporary the size of the batch (50 MB at 64 envs)
    # costs more in page faults and cache misses than the arithmetic (measured 8x slower than per-slot slices).
    rows = batch if frames.is_cuda else max(1, (1 << 20) // max(1, frames[0].numel() * 4))
    for start in range(0, batch, rows):
        scaled = frames[start : start + rows].float().clamp(0.0, 1.0).mul_(255.0).add_(0.5)
        # the truncating float -> uint8 cast and the move to channels-last, in one copy
        out[start : start + rows].permute(0, 1, 4, 2, 3).copy_(scaled)
    if not (staging and out.is_cuda):
        return out.cpu().numpy()  # on a GPU: the step's one device -> host copy
    host = torch.empty(out.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(out, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return host.numpy()


def _object_array(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def check_is_checkpoint(directory: str | os.PathLike) -> None:
    """``CheckpointError`` saying that ``directory`` is not a Cosmos3 checkpoint and what it lacks (the first missing
    or broken part, ``checkpoint.validate_checkpoint``: configs and safetensors headers only, a few KB a file)."""
    try:
        validate_checkpoint(directory)
    except CheckpointError as error:
        fault = str(error).removeprefix("checkpoint: ")
        raise CheckpointError(
            f"checkpoint: {directory} is not a usable Cosmos3 checkpoint (diffusers layout: model_index.json, "
            f"transformer/, vae/, scheduler/, text_tokenizer/): {fault}"
        ) from error


def _default_decoder(checkpoint: os.PathLike, load_options: dict[str, Any]) -> None:
    """A checkpoint's meta.json ``decoder`` is its default, as for every other setting it carries, where the user
    gives none and one rank decodes (a light decoder cannot decode tile-parallel over cfg_parallel * tp ranks)."""
    if "decoder" in load_options:
        return
    decoder = checkpoint_decoder(checkpoint)
    ranks = (load_options.get("cfg_parallel") or load_options.get("cfg") or 1) * (load_options.get("tp") or 1)
    if decoder != "vae" and ranks == 1:  # "vae" is load_engine's own default
        load_options["decoder"] = decoder


def _resolve_engine(checkpoint, engine, **load_options: Any):
    """The env's engine: the one given (any ``WorldModelEngine``), or ``load_engine(checkpoint, **load_options)``
    (``ENGINE_LOAD_KEYS``: device, dtype, vae_dtype, precision, optimize, backend, tp, cfg_parallel, dp, decoder).
    With tp/cfg_parallel/dp > 1 (outside torchrun) that starts worker processes and returns a client with the same
    API."""
    if engine is not None:
        if checkpoint is not None:
            raise InputError("checkpoint: give either checkpoint= or engine=, not both.")
        if load_options:
            raise InputError(
                f"{sorted(load_options)}: options for loading a checkpoint; with engine= the engine is already loaded."
            )
        # A Cosmos3Engine, its client-mode handle, RayEngineReplicas, or another WorldModelEngine.
        if not isinstance(engine, WorldModelEngine):
            raise InputError(
                f"engine: expected a WorldModelEngine (e.g. a Cosmos3Engine), got {type(engine).__name__}."
            )
        return engine
    if checkpoint is None:
        raise InputError("checkpoint: required (a checkpoint directory or hub id), unless engine= is given.")
    return load_engine(checkpoint, progress=False, **load_options)


def _resolve_reward_model(spec: Any, engine: Cosmos3Engine):
    if spec is None:
        return None
    model = resolve_reward_model(spec, engine.device, vae=engine.vae)
    # A reward model that can replay its scoring as CUDA graphs does where the engine replays its own stages so
    # (``Cosmos3Engine.optimize``): at one env the scoring's kernel launches are a share of the step.
    use_graphs = getattr(model, "use_cuda_graphs", None)
    if getattr(engine, "stage_graphs", False) and callable(use_graphs) and engine.device.type == "cuda":
        padding = getattr(engine, "graph_padding", DEFAULT_MAX_PADDING)  # pads batches as the engine does
        use_graphs(**({"max_padding": padding} if _takes_keyword(use_graphs, "max_padding") else {}))
    return model


def _check_reward_settings(reward_model: Any, settings: WorldModelSettings) -> None:
    if settings.success_threshold is not None and reward_model is None:
        raise InputError("success_threshold: needs a reward_model to score the frames.")
    pays_never = settings.success_threshold is None and settings.max_episode_steps is None
    if reward_model is not None and settings.reward_mode == "terminal" and pays_never:
        warnings.warn(
            "reward_mode='terminal' pays the score only on a step that ends the episode inside the env "
            "(success_threshold or the env's own max_episode_steps); with neither, every reward is 0. "
            "gym.make(max_episode_steps=...) adds a TimeLimit wrapper outside the env: construct the env "
            "directly or use gym.make_vec to give the env its horizon.",
            stacklevel=4,
        )


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


class WorldModelExtras:
    """What both envs offer beyond the Gymnasium API, delegated to their ``_core`` (a ``WorldModelCore``)."""

    _core: WorldModelCore

    def offload(self) -> None:
        """Move the model to CPU memory (e.g. while a policy trains on the GPU); the next step moves it back."""
        self._core.offload()

    def onload(self) -> None:
        """Move the model back to its device now rather than at the next step."""
        self._core.onload()

    @property
    def engine(self) -> Cosmos3Engine:
        return self._core.engine

    def context_latents(self, slot: int = 0) -> torch.Tensor:
        """With ``handover="latent"``: the latent context ``[C, K, h, w]`` (a copy) that ``slot``'s next chunk (the
        vector env's slot; 0 for ``WorldModelEnv``) is conditioned on; ``reset(options={"context_latents": ...})``
        continues from it."""
        return self._core.context_latents(slot)

    @property
    def settings(self) -> WorldModelSettings:
        """The env's settings (frozen): the checkpoint's own, updated with the arguments the env was made with."""
        return self._core.settings

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
        return self._core.settings.action_stats
