"""``WorldModelVectorEnv``: ``num_envs`` Cosmos3 rollouts advanced by ONE batched model call per step.

A native ``gymnasium.vector.VectorEnv`` (structured like Gymnasium's ``CartPoleVectorEnv``), not a
``SyncVectorEnv`` over copies of the model: every slot's request goes into one ``engine.step([...])`` call, and the
text K/V of a prompt is computed once and shared by all slots and steps (the engine caches it per prompt).

Groups (``group_size=G``, GRPO-style; ``num_envs`` must be a multiple of G). Slots ``[g*G, (g+1)*G)`` form group
``g`` (``info["group"]``, int array, in every info). The G slots of a group start every episode together, from the
same start (the same frame, the same initial-state index, the same task) but each with its own sampling seeds, so
their rollouts differ only by the model's noise. With ``group_size=1`` (the default) every slot is its own group.

A slot whose episode ended *waits* until every slot of its group has ended; then the group restarts together from
one new shared start (drawn by the group's first slot). While it waits, a slot's action is ignored and it returns
its last observation, reward 0, terminated and truncated False, and ``info["waiting"]`` True (a bool array in every
step's info): mask those entries out of the learning signal. ``info["waiting"]`` is also True on the step that
restarts a slot without stepping it (its action is ignored there too).

Autoreset (``autoreset_mode``, Gymnasium's ``AutoresetMode``) restarts only finished groups:

* ``NEXT_STEP`` (default): the step after the last slot of a group finishes restarts the whole group (actions
  ignored; reward 0, terminated/truncated False, its info is the reset info) while the other slots advance.
* ``SAME_STEP``: a group restarts within the step in which its last slot finishes. Every slot that finishes in a
  step has its last observation and info in ``info["final_obs"]`` / ``info["final_info"]`` (masked by
  ``info["_final_obs"]``); the observation it returns is the new start if its group restarted, else its last one.
* ``DISABLED``: finished groups must be reset with ``reset(options={"reset_mask": mask})`` (the mask covers whole
  groups) before the next step; a finished slot of an unfinished group waits as above.

Seeds: ``reset(seed=s)`` seeds slot ``i`` with ``s + i`` (a list seeds each slot), as ``SyncVectorEnv`` does, so
slot ``i`` follows the same random stream as a ``WorldModelEnv`` reset with seed ``s + i`` (with ``group_size=1``).
Autoresets continue the slots' streams. ``max_episode_steps`` is counted per slot, in chunks.

Reset options (``frames``, ``task``, ``initial_state_index``, ``context_latents``) are one value for all, a list with
one per group, or (as without groups) a list with one per slot whose values agree within each group; ``frames`` and
``context_latents`` are always a list (None where a slot starts from its initial state).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from ..errors import InputError
from .core import WorldModelCore, WorldModelExtras
from .rendering import check_render_mode, step_rate
from .world_model_env import check_reset_options

RESET_OPTION_KEYS = ("reset_mask", "frames", "task", "initial_state_index", "context_latents")
# Options whose value is always a list, one per slot or group: a list of frames is also one video, and a context a
# tensor whose first axis is not the slots.
_LIST_ONLY_OPTIONS = {"frames": "frames", "context_latents": "latent contexts [C, K, h, w]"}


class WorldModelVectorEnv(WorldModelExtras, VectorEnv):
    """Batched Cosmos3 forward dynamics; arguments as ``WorldModelEnv`` plus ``num_envs``, ``group_size``,
    ``autoreset_mode`` and ``task`` (a string for all slots or a list with one per slot). Renders ``rgb_array``
    only: a tuple with every slot's current frame."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": None, "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        num_envs: int = 1,
        checkpoint: str | os.PathLike | None = None,
        *,
        group_size: int = 1,
        render_mode: str | None = None,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        **kwargs: Any,
    ):
        if isinstance(num_envs, bool) or not isinstance(num_envs, (int, np.integer)) or num_envs < 1:
            raise InputError(f"num_envs: expected an integer >= 1, got {num_envs!r}.")
        if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
            raise InputError(f"group_size: expected an integer >= 1, got {group_size!r}.")
        if num_envs % group_size:
            raise InputError(
                f"group_size: num_envs ({num_envs}) must be a multiple of group_size ({group_size}), e.g. "
                f"num_envs={max(1, num_envs // group_size) * group_size}."
            )
        self.num_envs = int(num_envs)
        self.group_size = int(group_size)
        self.num_groups = self.num_envs // self.group_size
        self.autoreset_mode = _check_autoreset_mode(autoreset_mode)
        self.render_mode = check_render_mode(render_mode, self.metadata["render_modes"])
        self._core = WorldModelCore(self.num_envs, checkpoint=checkpoint, **kwargs)
        settings = self._core.settings
        render_fps = step_rate(settings.fps, settings.chunk)
        self.metadata = {**self.metadata, "render_fps": render_fps, "autoreset_mode": self.autoreset_mode}
        self.single_observation_space = self._core.single_observation_space
        self.single_action_space = self._core.single_action_space
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)

        self.groups = np.arange(self.num_envs) // self.group_size  # slot -> its group
        self._slot_rngs: list[np.random.Generator | None] = [None] * self.num_envs
        # Slots whose episode ended and whose group has not restarted yet.
        self._ended = np.zeros(self.num_envs, dtype=np.bool_)

    # ------------------------------------------------------------------ Gymnasium API

    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None):
        """Reset all slots, or those in ``options["reset_mask"]`` (bool ``[num_envs]``, whole groups). Other
        options, as for ``WorldModelEnv``: one value for every slot, or per group / per slot (see the module doc;
        ``frames`` and ``context_latents`` must be lists, None where the initial-state source is used)."""
        seeds = slot_seeds(seed, self.num_envs)
        super().reset(seed=seed if isinstance(seed, (int, np.integer)) else None)
        options = check_reset_options(options, RESET_OPTION_KEYS)
        mask = self._check_reset_mask(options.pop("reset_mask", None))
        per_group = {key: self._per_group_option(key, value) for key, value in options.items()}

        for slot in np.flatnonzero(mask):
            if seeds[slot] is not None or self._slot_rngs[slot] is None:
                self._slot_rngs[slot], _ = seeding.np_random(seeds[slot])
        infos: dict[str, Any] = {}
        for group in np.unique(self.groups[mask]):
            group_options = {key: values[group] for key, values in per_group.items()}
            infos = self._reset_group(int(group), infos, **group_options)
        return self._observations(), self._with_slot_info(infos, np.zeros(self.num_envs, dtype=np.bool_))

    def step(self, actions):
        self._core.check_started(range(self.num_envs))  # step before reset: InputError before looking at the actions
        actions = self._core.check_actions(actions, batch=self.num_envs, field="actions")
        finished_groups = self._finished_groups()
        if self.autoreset_mode == AutoresetMode.DISABLED and finished_groups:
            slots = np.flatnonzero(np.isin(self.groups, finished_groups)).tolist()
            raise InputError(
                f"reset_mask: slots {slots} finished their episodes; with autoreset_mode DISABLED reset them with "
                "reset(options={'reset_mask': mask}) before stepping."
            )
        waiting = self._ended.copy()  # these slots' actions are ignored in this step
        stepping = np.flatnonzero(~waiting).tolist()

        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminated = np.zeros(self.num_envs, dtype=np.bool_)
        truncated = np.zeros(self.num_envs, dtype=np.bool_)
        infos: dict[str, Any] = {}
        result = self._core.step_slots(stepping, actions[stepping], [self._slot_rngs[s] for s in stepping])
        if result is not None:
            rewards[stepping], terminated[stepping], truncated[stepping] = (
                result.rewards,
                result.terminated,
                result.truncated,
            )
            ended = result.terminated | result.truncated
            self._ended[stepping] |= ended
            if self.autoreset_mode == AutoresetMode.SAME_STEP:
                for i in np.flatnonzero(ended):  # only the slots that finish now: per slot, as Gymnasium's infos
                    final = {"final_obs": result.observation(i), "final_info": result.info(i)}
                    infos = self._add_info(infos, final, stepping[i])

        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            restarting = finished_groups  # finished on an earlier step
        elif self.autoreset_mode == AutoresetMode.SAME_STEP:
            restarting = self._finished_groups()  # finished now (none were finished before: they restart at once)
        else:
            restarting = []
        if result is not None:
            keep = ~np.isin(self.groups[stepping], restarting)  # a restarting slot's info is its reset info
            infos = self._add_batch_info(infos, result.infos, np.asarray(stepping)[keep], keep)
        for group in restarting:
            infos = self._reset_group(int(group), infos)
        return self._observations(), rewards, terminated, truncated, self._with_slot_info(infos, waiting)

    def render(self) -> tuple[np.ndarray, ...] | None:
        if self.render_mode is None:
            gym.logger.warn("render() was called without a render_mode; create the env with render_mode='rgb_array'.")
            return None
        return tuple(self._core.frame(slot) for slot in range(self.num_envs))

    def close_extras(self, **kwargs: Any) -> None:
        """Called once by ``VectorEnv.close``; releases the engine only if the env loaded it."""
        self._core.close()

    # ------------------------------------------------------------------ world-model extras: WorldModelExtras

    @property
    def tasks(self) -> list[str]:
        """The current instruction of every slot."""
        return [self._core.task(slot) for slot in range(self.num_envs)]

    # ------------------------------------------------------------------ groups

    def _group_slots(self, group: int) -> range:
        return range(group * self.group_size, (group + 1) * self.group_size)

    def _slot_rng(self, slot: int) -> np.random.Generator:
        """The slot's generator; ``reset`` gives one to every slot before it resets the slot's group."""
        rng = self._slot_rngs[slot]
        assert rng is not None
        return rng

    def _finished_groups(self) -> list[int]:
        """Groups all of whose slots have ended."""
        return np.flatnonzero(self._ended.reshape(self.num_groups, self.group_size).all(axis=1)).tolist()

    def _reset_group(
        self,
        group: int,
        infos: dict[str, Any],
        *,
        frames: Any = None,
        task: str | None = None,
        initial_state_index: int | None = None,
        context_latents: Any = None,
    ) -> dict[str, Any]:
        """Start a new episode in every slot of ``group`` from one shared start; returns ``infos`` updated."""
        slots = self._group_slots(group)
        given = frames is not None or initial_state_index is not None or context_latents is not None
        if not given and self._core.initial_states is not None:
            # The group's first slot draws the start (with one slot per group, exactly as WorldModelEnv does).
            initial_state_index = int(self._slot_rng(slots[0]).integers(len(self._core.initial_states)))
        for slot in slots:
            info = self._core.reset_slot(
                slot,
                self._slot_rng(slot),
                frames=frames,
                task=task,
                initial_state_index=initial_state_index,
                context_latents=context_latents,
            )
            infos = self._add_info(infos, info, slot)
        self._ended[slots.start : slots.stop] = False
        return infos

    def _per_group_option(self, key: str, value: Any) -> list[Any]:
        """One reset option's value for every group: one value, one per group, or one per slot equal in a group."""
        is_list = isinstance(value, (list, tuple, np.ndarray))
        counts = (self.num_envs, self.num_groups)
        if key in _LIST_ONLY_OPTIONS and not (isinstance(value, (list, tuple)) and len(value) in counts):
            raise InputError(
                f"options[{key!r}]: expected a list of {self.num_envs} {_LIST_ONLY_OPTIONS[key]} (one per env"
                + (f", or {self.num_groups}: one per group" if self.group_size > 1 else "")
                + "; None to use initial_states)."
            )
        if not is_list:
            return [value] * self.num_groups
        values = list(value)
        if len(values) == self.num_groups:
            return values
        if len(values) != self.num_envs:
            expected = f"{self.num_envs}" + (
                f" (one per env) or {self.num_groups} (one per group)" if self.group_size > 1 else ""
            )
            raise InputError(f"options[{key!r}]: expected one value or a list of {expected}, got {len(values)} items.")
        per_group = values[:: self.group_size]
        for slot, item in enumerate(values):
            if not _same_value(item, per_group[slot // self.group_size]):
                raise InputError(
                    f"options[{key!r}]: the slots of a group share their start, but slot {slot} differs from slot "
                    f"{slot // self.group_size * self.group_size} of its group; give one value per group."
                )
        return per_group

    # ------------------------------------------------------------------ helpers

    def _with_slot_info(self, infos: dict[str, Any], waiting: np.ndarray) -> dict[str, Any]:
        """Add the entries every info has: ``group`` and ``waiting`` (all slots)."""
        infos["group"], infos["_group"] = self.groups.copy(), np.ones(self.num_envs, dtype=np.bool_)
        infos["waiting"], infos["_waiting"] = waiting, np.ones(self.num_envs, dtype=np.bool_)
        return infos

    def _observations(self) -> dict[str, np.ndarray] | np.ndarray:
        return self._core.observations()

    def _add_batch_info(
        self, infos: dict[str, Any], batch_infos: dict[str, np.ndarray], slots: np.ndarray, rows: np.ndarray
    ) -> dict[str, Any]:
        """``_add_info`` for many slots at once: ``batch_infos[key][rows]`` go to ``slots``, in arrays of the dtype
        ``_add_info`` gives them (the batch arrays already have it), with their ``_key`` masks."""
        if not len(slots):
            return infos
        for key, values in batch_infos.items():
            if key not in infos:
                array = (
                    np.full(self.num_envs, None, dtype=object)
                    if values.dtype == object
                    else np.zeros((self.num_envs, *values.shape[1:]), dtype=values.dtype)
                )
                mask = np.zeros(self.num_envs, dtype=np.bool_)
            else:
                array, mask = infos[key], infos.get(f"_{key}", np.zeros(self.num_envs, dtype=np.bool_))
            array[slots] = values[rows]
            mask[slots] = True
            infos[key], infos[f"_{key}"] = array, mask
        return infos

    def _check_reset_mask(self, mask: Any) -> np.ndarray:
        if mask is None:
            return np.ones(self.num_envs, dtype=np.bool_)
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.shape != (self.num_envs,):
            raise InputError(
                f"reset_mask: expected a bool array of shape ({self.num_envs},), got dtype {mask.dtype} and shape "
                f"{mask.shape}."
            )
        if not mask.any():
            raise InputError("reset_mask: expected at least one True entry.")
        by_group = mask.reshape(self.num_groups, self.group_size)
        if (by_group.any(axis=1) != by_group.all(axis=1)).any():
            raise InputError(
                f"reset_mask: the slots of a group (group_size={self.group_size}) restart together; the mask must "
                "select whole groups."
            )
        return mask


def _same_value(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    try:
        return bool(a == b)
    except (ValueError, TypeError):  # tensors, images: compared as arrays
        return np.array_equal(np.asarray(a), np.asarray(b))


def _check_autoreset_mode(mode: Any) -> AutoresetMode:
    try:
        return AutoresetMode(mode)
    except ValueError:
        raise InputError(
            f"autoreset_mode: expected a gymnasium.vector.AutoresetMode or one of "
            f"{[m.value for m in AutoresetMode]}, got {mode!r}."
        ) from None


def slot_seeds(seed: Any, num_envs: int) -> list[int | None]:
    """A vector env's ``reset(seed=...)`` as one seed per slot: None; an int ``s`` -> ``s, s + 1, ...`` (Gymnasium's
    convention); or a list of ``num_envs`` ints or Nones."""
    if seed is None:
        return [None] * num_envs
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return [int(seed) + slot for slot in range(num_envs)]
    if isinstance(seed, (list, tuple)) and len(seed) == num_envs:
        if all(s is None or (isinstance(s, (int, np.integer)) and not isinstance(s, bool)) for s in seed):
            return [None if s is None else int(s) for s in seed]
    raise InputError(f"seed: expected None, an int or a list of {num_envs} ints (or None), got {seed!r}.")
