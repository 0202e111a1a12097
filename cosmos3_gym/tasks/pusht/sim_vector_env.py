"""``PushTSimVectorEnv``: ``num_envs`` gym-pusht simulators behind the PushT world model's vector-env interface, with
group resets, so one RL trainer runs in both worlds.

Same spaces as ``cosmos3_gym/PushT-v0``: observations ``{"image": uint8 [h, w, 3]}`` (gym-pusht's frame at the
model's ``image_size``, downscaled to ``observation_size`` by the envs' ``resize_frame``), one action per step = one
chunk ``Box(-1, 1, (chunk, 2))`` of normalised targets, mapped to table pixels as ``PushTSimEnv`` does (clip to
[-1, 1], ``action_stats.denormalize``, clip to [0, 512]). A chunk stops early at success (coverage above
``success_threshold``; gym-pusht terminates there). Reward: 1.0 on the step that succeeds, else 0 (sparse success);
``terminated`` on success, ``truncated`` after ``max_episode_steps`` chunks. ``info``: ``is_success``, ``coverage``
(the true coverage after the chunk), ``max_coverage`` (best within the chunk), ``elapsed_steps``,
``initial_state_index``, ``group`` (every step and reset, one int per slot) and ``waiting``.

Starts come from a ``DemoStartStates`` (``starts``): simulator states of any step of recorded episodes, or
gym-pusht resets. ``reset(options={"initial_state_index": i})`` (one index, or one per slot) picks them; otherwise
each group draws one with its first slot's random stream.

Groups (``group_size=G``, RLinf's ``group_size``): slots ``[g*G, (g+1)*G)`` form group ``g``; ``num_envs`` must be a
multiple of G. A group's slots start from one shared state (drawn once per group) with their own seeds. Autoreset
keeps groups intact, in every mode: a group restarts together, from one new shared start, once all its slots are
done. Until then a finished slot *waits*: its step returns its last observation, reward 0, terminated and truncated
False and ``info["waiting"]`` True, and its action is ignored. ``NEXT_STEP`` (default): the step after the group's
last slot finishes resets the whole group (reward 0, not done, the reset's info). ``SAME_STEP``: the group is reset
within the step its last slot finishes; ``info["final_obs"]`` / ``info["final_info"]`` hold the finishing slots'
last observation and info. ``DISABLED``: finished slots wait until ``reset(options={"reset_mask": mask})`` (whole
groups). With G = 1 this is the usual per-slot autoreset.

``expert_action_chunks()`` labels every slot with the noise-free scripted pusher's next chunk, planned from the
slot's true state (DAgger's expert, ``cosmos3_gym.rl.dagger``).

``workers`` > 0 runs the simulators in that many processes (slots split in contiguous blocks; each worker process
uses one thread); 0 runs them in this process.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import gymnasium as gym
import numpy as np
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from ...data.initial_states import resize_frame
from ...envs.vector_env import slot_seeds
from ...errors import InputError
from ...processor import ActionStats
from .geometry import RAW_ACTION_DIM, SUCCESS_COVERAGE, TABLE_SIZE
from .policies import ScriptedPusher, plan_chunk_in_physics
from .sim import PushTSim, _check_image_size
from .starts import DemoStartStates, put_in_start

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

__all__ = ["PushTSimVectorEnv"]

RESET_OPTION_KEYS = ("initial_state_index", "reset_mask")


class _SimBlock:
    """The simulators of a block of slots; the same calls run in this process or in a worker."""

    def __init__(
        self, count: int, image_size: tuple[int, int], observation_size: tuple[int, int], success_threshold: float
    ):
        self.sims = [PushTSim(image_size, render_every_step=False) for _ in range(count)]
        self.observation_size = observation_size
        self.success_threshold = success_threshold
        self.experts: list[ScriptedPusher | None] = [None] * count  # per slot, for its current episode
        self._planner: PushTSim | None = None  # the expert's private physics

    def _observe(self, sim: PushTSim) -> np.ndarray:
        return resize_frame(sim.render(), self.observation_size)

    def restore(self, items: list[tuple[int, tuple[np.ndarray, int]]]) -> list[tuple[np.ndarray, float]]:
        out = []
        for local, (state, seed) in items:
            put_in_start(self.sims[local], state, seed)
            self.experts[local] = None
            out.append((self._observe(self.sims[local]), self.sims[local].coverage))
        return out

    def step(self, items: list[tuple[int, np.ndarray]]) -> list[tuple[np.ndarray, float, float, bool]]:
        out = []
        for local, targets in items:
            sim = self.sims[local]
            best, success = sim.coverage, False
            for target in targets:
                sim.step(target)
                best = max(best, sim.coverage)
                if sim.coverage > self.success_threshold:  # gym-pusht terminates here
                    success = True
                    break
            out.append((self._observe(sim), sim.coverage, best, success))
        return out

    def sim_states(self, items: list[tuple[int, None]]) -> list[np.ndarray]:
        return [self.sims[local].sim_state for local, _ in items]

    def expert_plans(self, items: list[tuple[int, int]]) -> list[np.ndarray]:
        """Per ``(slot, chunk)``: the noise-free scripted pusher's next ``chunk`` targets from the slot's true state."""
        if self._planner is None:
            self._planner = PushTSim((16, 16), render_every_step=False)  # only its physics is used
        out = []
        for local, chunk in items:
            expert = self.experts[local]
            if expert is None:
                expert = self.experts[local] = ScriptedPusher(np.random.default_rng(0))
            out.append(plan_chunk_in_physics(self._planner, expert, self.sims[local].sim_state, chunk))
        return out

    def close(self) -> None:
        for sim in self.sims:
            sim.close()
        if self._planner is not None:
            self._planner.close()


def _worker(connection, count, image_size, observation_size, success_threshold) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    block = _SimBlock(count, image_size, observation_size, success_threshold)
    try:
        while True:
            command, payload = connection.recv()
            if command == "close":
                break
            connection.send(getattr(block, command)(payload))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        block.close()
        connection.close()


class PushTSimVectorEnv(VectorEnv):
    """gym-pusht x ``num_envs`` with group resets; see the module docstring."""

    metadata = {"render_modes": [], "render_fps": 10.0, "autoreset_mode": AutoresetMode.NEXT_STEP}

    def __init__(
        self,
        num_envs: int,
        *,
        starts: DemoStartStates,
        action_stats: ActionStats | str | os.PathLike | dict,
        group_size: int = 1,
        chunk: int = 8,
        image_size: tuple[int, int] = (256, 256),
        observation_size: tuple[int, int] | None = (96, 96),
        max_episode_steps: int | None = None,
        success_threshold: float = SUCCESS_COVERAGE,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        workers: int = 0,
    ):
        for name, value, minimum in (
            ("num_envs", num_envs, 1),
            ("group_size", group_size, 1),
            ("chunk", chunk, 1),
            ("workers", workers, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
                raise InputError(f"{name}: expected an integer >= {minimum}, got {value!r}.")
        if num_envs % group_size:
            raise InputError(f"group_size: num_envs ({num_envs}) must be a multiple of group_size ({group_size}).")
        if max_episode_steps is not None and (isinstance(max_episode_steps, bool) or max_episode_steps < 1):
            raise InputError(f"max_episode_steps: expected None or an integer >= 1, got {max_episode_steps!r}.")
        if not isinstance(starts, DemoStartStates):
            raise InputError(f"starts: expected a DemoStartStates, got {type(starts).__name__}.")
        if not isinstance(action_stats, ActionStats):
            action_stats = ActionStats.from_json(action_stats, mode="minmax")
        if action_stats.dim != RAW_ACTION_DIM:
            raise InputError(f"action_stats: expected {RAW_ACTION_DIM} dims (x, y), got {action_stats.dim}.")
        try:
            self.autoreset_mode = AutoresetMode(autoreset_mode)
        except ValueError:
            raise InputError(
                f"autoreset_mode: expected one of {[m.value for m in AutoresetMode]}, got {autoreset_mode!r}."
            ) from None
        self.num_envs = int(num_envs)
        self.group_size = int(group_size)
        self.starts = starts
        self.action_stats = action_stats
        self.chunk = int(chunk)
        self.image_size = _check_image_size(tuple(image_size))
        self.observation_size = (
            self.image_size if observation_size is None else _check_image_size(tuple(observation_size))
        )
        self.max_episode_steps = max_episode_steps
        self.success_threshold = float(success_threshold)
        self.metadata = {**self.metadata, "autoreset_mode": self.autoreset_mode}
        self.render_mode = None
        self.single_observation_space = gym.spaces.Dict(
            {"image": gym.spaces.Box(0, 255, (*self.observation_size, 3), dtype=np.uint8)}
        )
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, (self.chunk, RAW_ACTION_DIM), dtype=np.float32)
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)

        self.group = np.arange(self.num_envs) // self.group_size
        self._observations = np.zeros((self.num_envs, *self.observation_size, 3), np.uint8)
        self._coverage = np.zeros(self.num_envs)
        self._elapsed = np.zeros(self.num_envs, np.int64)
        self._start_index = np.full(self.num_envs, -1, np.int64)
        self._done = np.zeros(self.num_envs, bool)  # finished, waiting for its group
        self._started = False
        self._slot_rngs: list[np.random.Generator | None] = [None] * self.num_envs
        self._start_blocks(int(workers))

    # ------------------------------------------------------------------ simulator blocks

    def _start_blocks(self, workers: int) -> None:
        workers = min(workers, self.num_envs)
        bounds = np.linspace(0, self.num_envs, max(workers, 1) + 1).astype(int)
        self._blocks = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        arguments = (self.image_size, self.observation_size, self.success_threshold)
        if workers == 0:
            self._local: _SimBlock | None = _SimBlock(self.num_envs, *arguments)
            self._connections: list[Connection] | None = None
            return
        self._local = None
        # Workers run only numpy/pymunk/pygame, never torch or CUDA, so fork is safe (and spares re-importing torch).
        context = (
            multiprocessing.get_context("fork")
            if "fork" in multiprocessing.get_all_start_methods()
            else multiprocessing.get_context("spawn")
        )
        self._connections, self._processes = [], []
        for start, end in self._blocks:
            parent, child = context.Pipe()
            process = context.Process(target=_worker, args=(child, end - start, *arguments), daemon=True)
            process.start()
            child.close()
            self._connections.append(parent)
            self._processes.append(process)

    def _call(self, command: str, items: dict[int, Any]) -> dict[int, Any]:
        """Run ``command`` on ``{slot: payload}``; returns ``{slot: result}``."""
        results: dict[int, Any] = {}
        if self._connections is None:
            slots = sorted(items)
            for slot, result in zip(slots, getattr(self._local, command)([(s, items[s]) for s in slots])):
                results[slot] = result
            return results
        sent = []
        for (start, end), connection in zip(self._blocks, self._connections):
            slots = [s for s in sorted(items) if start <= s < end]
            if slots:
                connection.send((command, [(s - start, items[s]) for s in slots]))
                sent.append((connection, slots))
        for connection, slots in sent:
            for slot, result in zip(slots, connection.recv()):
                results[slot] = result
        return results

    # ------------------------------------------------------------------ Gymnasium API

    def reset(self, *, seed: int | Sequence[int | None] | None = None, options: dict[str, Any] | None = None):
        """Reset all slots, or the groups in ``options["reset_mask"]`` (bool ``[num_envs]``, whole groups);
        ``options["initial_state_index"]``: one start index for all, or one per slot (equal within a group)."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(RESET_OPTION_KEYS))
        if unknown:
            raise InputError(f"options: unknown keys {unknown}; expected some of {list(RESET_OPTION_KEYS)}.")
        seeds = slot_seeds(seed, self.num_envs)
        super().reset(seed=seed if isinstance(seed, (int, np.integer)) else None)
        mask = options.get("reset_mask")
        if mask is None:
            mask = np.ones(self.num_envs, bool)
        else:
            mask = np.asarray(mask)
            if mask.dtype != np.bool_ or mask.shape != (self.num_envs,) or not mask.any():
                raise InputError(f"reset_mask: expected a bool array of shape ({self.num_envs},) with a True entry.")
            if not self._whole_groups(mask):
                raise InputError(f"reset_mask: groups of {self.group_size} slots reset together; mark whole groups.")
        for slot in np.flatnonzero(mask):
            if seeds[slot] is not None or self._slot_rngs[slot] is None:
                self._slot_rngs[slot], _ = seeding.np_random(seeds[slot])
        indices = self._check_indices(options.get("initial_state_index"))
        groups = np.unique(self.group[mask])
        self._reset_groups(groups, indices)
        self._started = True
        return self._observation_batch(), self._info_for(np.flatnonzero(mask))

    def step(self, actions):
        if not self._started:
            raise InputError("reset: call reset() before step().")
        actions = np.asarray(actions, dtype=np.float32)
        if actions.shape != self.action_space.shape or not np.isfinite(actions).all():
            raise InputError(
                f"actions: expected finite values of shape {self.action_space.shape}, got {actions.shape}."
            )
        rewards = np.zeros(self.num_envs)
        terminated = np.zeros(self.num_envs, bool)
        truncated = np.zeros(self.num_envs, bool)
        group_done = self._group_all_done()
        if self.autoreset_mode == AutoresetMode.DISABLED and group_done.any():
            raise InputError(
                f"reset_mask: groups {np.flatnonzero(group_done).tolist()} finished; with autoreset "
                "DISABLED reset them with reset(options={'reset_mask': mask}) before stepping."
            )
        resetting = (
            self._done & group_done[self.group]
            if self.autoreset_mode == AutoresetMode.NEXT_STEP
            else np.zeros(self.num_envs, bool)
        )
        stepping = np.flatnonzero(~self._done)
        waiting = self._done & ~resetting

        raw = np.clip(self.action_stats.denormalize(np.clip(actions, -1.0, 1.0)), 0.0, TABLE_SIZE)
        results = self._call("step", {int(slot): raw[slot] for slot in stepping})
        max_coverage = self._coverage.copy()
        success = np.zeros(self.num_envs, bool)
        for slot, (observation, coverage, best, succeeded) in results.items():
            self._observations[slot] = observation
            self._coverage[slot] = coverage
            max_coverage[slot] = best
            self._elapsed[slot] += 1
            success[slot] = succeeded
            terminated[slot] = succeeded
            truncated[slot] = (
                not succeeded and self.max_episode_steps is not None and self._elapsed[slot] >= self.max_episode_steps
            )
            rewards[slot] = float(succeeded)
        finishing = terminated | truncated
        self._done |= finishing
        infos = self._info_for(np.arange(self.num_envs))
        infos["is_success"] = success
        infos["max_coverage"] = max_coverage
        infos["waiting"] = waiting.copy()

        if self.autoreset_mode == AutoresetMode.NEXT_STEP and resetting.any():
            self._reset_groups(np.unique(self.group[resetting]), None)
            reset_info = self._info_for(np.flatnonzero(resetting))
            for key in ("coverage", "elapsed_steps", "initial_state_index"):
                infos[key][resetting] = reset_info[key][resetting]
            infos["waiting"][resetting] = False
        elif self.autoreset_mode == AutoresetMode.SAME_STEP:
            complete = self._group_all_done()
            finished_groups = np.flatnonzero(complete)
            if len(finished_groups):
                slots = np.flatnonzero(np.isin(self.group, finished_groups))
                final_obs = np.array([None] * self.num_envs, dtype=object)
                final_info = np.array([None] * self.num_envs, dtype=object)
                for slot in slots[finishing[slots]]:
                    final_obs[slot] = {"image": self._observations[slot].copy()}
                    final_info[slot] = {
                        "is_success": bool(success[slot]),
                        "coverage": float(self._coverage[slot]),
                        "elapsed_steps": int(self._elapsed[slot]),
                    }
                infos["final_obs"], infos["final_info"] = final_obs, final_info
                infos["_final_obs"] = infos["_final_info"] = np.isin(np.arange(self.num_envs), slots) & finishing
                self._reset_groups(finished_groups, None)
                for key in ("coverage", "elapsed_steps", "initial_state_index"):
                    infos[key][slots] = self._info_for(slots)[key][slots]
        return self._observation_batch(), rewards, terminated, truncated, infos

    def close_extras(self, **kwargs: Any) -> None:
        if self._connections is not None:
            for connection in self._connections:
                try:
                    connection.send(("close", None))
                    connection.close()
                except (BrokenPipeError, OSError):
                    pass
            for process in self._processes:
                process.join(timeout=5)
            self._connections = None
        elif self._local is not None:
            self._local.close()
            self._local = None

    def expert_action_chunks(self) -> np.ndarray:
        """What the noise-free scripted pusher would do next in every slot, planned from the slot's true simulator
        state in a private copy of the physics: float32 ``[num_envs, chunk, 2]`` normalised actions (the inverse of
        ``step``'s mapping, clipped to [-1, 1]). The privileged labels of DAgger (``cosmos3_gym.rl.dagger``); each
        slot's pusher keeps its chosen contact until the slot's episode restarts. Waiting slots are labelled too."""
        if not self._started:
            raise InputError("reset: call reset() before expert_action_chunks().")
        plans = self._call("expert_plans", {slot: self.chunk for slot in range(self.num_envs)})
        targets = np.stack([plans[slot] for slot in range(self.num_envs)]).astype(np.float32)
        return np.clip(self.action_stats.normalize(targets), -1.0, 1.0).astype(np.float32)

    def sim_states(self) -> np.ndarray:
        """Every slot's current simulator state (``PushTSim.sim_state``), float64 ``[num_envs, 10]``: what
        ``DemoStartStates`` restarts from (``sim.pusht_replay.policy_rollout_starts`` records them)."""
        if not self._started:
            raise InputError("reset: call reset() before sim_states().")
        states = self._call("sim_states", {slot: None for slot in range(self.num_envs)})
        return np.stack([states[slot] for slot in range(self.num_envs)])

    # ------------------------------------------------------------------ helpers

    @property
    def initial_states(self) -> DemoStartStates:
        """The start states (as the world-model envs name their source)."""
        return self.starts

    def _reset_groups(self, groups: np.ndarray, indices: np.ndarray | None) -> None:
        items = {}
        for group in groups:
            slots = np.flatnonzero(self.group == group)
            if indices is None:
                index = int(self._slot_rngs[slots[0]].integers(len(self.starts)))
            else:
                index = int(indices[slots[0]])
            for member in slots:
                items[int(member)] = (self.starts.sim_states[index], int(self.starts.seeds[index]))
                self._start_index[member] = index
        for slot, (observation, coverage) in self._call("restore", items).items():
            self._observations[slot] = observation
            self._coverage[slot] = coverage
            self._elapsed[slot] = 0
            self._done[slot] = False

    def _group_all_done(self) -> np.ndarray:
        return cast(np.ndarray, self._done.reshape(-1, self.group_size).all(axis=1))  # numpy's stubs: bool or array

    def _whole_groups(self, mask: np.ndarray) -> bool:
        per_group = mask.reshape(-1, self.group_size)
        return bool((per_group.all(axis=1) | ~per_group.any(axis=1)).all())

    def _check_indices(self, value: Any) -> np.ndarray | None:
        if value is None:
            return None
        indices = np.asarray(value)
        if indices.ndim == 0:
            indices = np.full(self.num_envs, indices)
        if indices.shape != (self.num_envs,) or indices.dtype.kind not in "iu":
            raise InputError(
                f"options['initial_state_index']: expected an integer or {self.num_envs} integers, got {value!r}."
            )
        if (indices < 0).any() or (indices >= len(self.starts)).any():
            raise InputError(f"options['initial_state_index']: expected indices in [0, {len(self.starts)}).")
        if not (indices.reshape(-1, self.group_size) == indices.reshape(-1, self.group_size)[:, :1]).all():
            raise InputError(
                "options['initial_state_index']: the slots of a group share one start; give equal "
                f"indices within each group of {self.group_size}."
            )
        return indices

    def _observation_batch(self) -> dict[str, np.ndarray]:
        return {"image": self._observations.copy()}

    def _info_for(self, slots: np.ndarray) -> dict[str, Any]:
        """Per-slot info arrays (Gymnasium's vector layout: a value array and a ``_key`` mask)."""
        mask = np.zeros(self.num_envs, bool)
        mask[slots] = True
        info = {
            "coverage": self._coverage.copy(),
            "elapsed_steps": self._elapsed.copy(),
            "initial_state_index": self._start_index.copy(),
            "group": self.group.copy(),
            "is_success": np.zeros(self.num_envs, bool),
            "waiting": np.zeros(self.num_envs, bool),
        }
        for key in list(info):
            info[f"_{key}"] = mask.copy() if key not in ("group",) else np.ones(self.num_envs, bool)
        return info
