"""Episode starts from demonstrations: frames AND gym-pusht simulator states from any step of recorded episodes.

``DemoStartStates`` is an ``InitialStateSource`` (what the world-model envs take as ``initial_states``): item ``i``
is a ``SimInitialState``, an ``InitialState`` (frame, task) that also carries the simulator state
(``PushTSim.sim_state``, float64 ``[10]``) the frame shows, and where it came from (episode, step). The same index
restarts ``PushTSimVectorEnv`` (``cosmos3_gym.tasks.pusht.sim_vector_env``) in that state, so a world-model rollout and
its replay in the simulator start from one state (RLinf / WMPO start rollouts from mid-trajectory keyframes of
demonstrations: shorter rollouts, less drift).

Frames are rendered from the simulator state when an item is read (gym-pusht draws the same pixels from the same
state; a test checks it), so a source of thousands of starts costs 80 bytes each. A source built from recorded
frames keeps them instead and needs no simulator to read them.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from ...data.initial_states import InitialState, InitialStateSource
from ...errors import InputError
from .geometry import TASK
from .sim import SIM_STATE_FIELDS, PushTSim

RENDERED_FRAMES_KEPT = 256  # 50 MB of 256 x 256 frames

__all__ = ["DemoStartStates", "SimInitialState", "put_in_start"]


def put_in_start(sim: PushTSim, state: np.ndarray, seed: int = -1) -> None:
    """Put ``sim`` in the start ``state``; for a gym-pusht reset start (``seed`` >= 0) by gym-pusht's own
    ``reset(seed)``, whenever that gives ``state``.

    A ``sim_state`` holds positions and velocities, not contacts. gym-pusht's reset places the bodies and takes one
    physics step, so where the agent starts touching the block the reset's frame draws the contact points and its
    first step is warm-started from them; a restored state has neither (seed 400013: 5 pixels of the frame up to 98
    levels apart, the block 0.54 px apart after one step). Resetting makes these starts gym-pusht's exactly, so an
    evaluation from ``DemoStartStates.from_seeds`` and ``cosmos3-gym eval-real`` (which resets) see the same
    episodes. A seed whose reset gives another state (another gym-pusht version) falls back to the state."""
    if seed >= 0:
        sim.reset(seed)
        if np.array_equal(sim.sim_state, np.asarray(state, dtype=np.float64)):
            return
    sim.restore(state)


@dataclass(frozen=True)
class SimInitialState(InitialState):
    """An ``InitialState`` with the simulator state its frame shows and its place in the demonstrations."""

    sim_state: np.ndarray = field(default_factory=lambda: np.zeros(len(SIM_STATE_FIELDS)))
    episode: int = -1  # index of the recorded episode (-1: a simulator reset, not a recording)
    step: int = 0  # the step of that episode (0: its first frame)


class DemoStartStates(InitialStateSource):
    """Start states ``[N]``: simulator states, their (episode, step) and optionally recorded frames.

    Build with ``from_episodes`` (recorded episodes with ``sim_states``, every ``stride``-th step), ``from_seeds``
    (gym-pusht resets: step 0 of fresh episodes, e.g. held-out evaluation starts) or ``load`` (an ``.npz`` written by
    ``save``). ``image_size``: the size frames are rendered at (the world model's, 256 x 256 for PushT).
    """

    def __init__(
        self,
        sim_states: np.ndarray,
        *,
        episodes: Sequence[int] | np.ndarray | None = None,
        steps: Sequence[int] | np.ndarray | None = None,
        frames: np.ndarray | None = None,
        task: str = TASK,
        image_size: tuple[int, int] = (256, 256),
        description: str = "demonstration starts",
        seeds: Sequence[int] | np.ndarray | None = None,
    ):
        states = np.asarray(sim_states, dtype=np.float64)
        if states.ndim != 2 or states.shape[1] != len(SIM_STATE_FIELDS) or not np.isfinite(states).all():
            raise InputError(
                f"sim_states: expected finite [N, {len(SIM_STATE_FIELDS)}] ({SIM_STATE_FIELDS}), got "
                f"shape {states.shape}."
            )
        count = len(states)
        self.sim_states = states
        self.episodes = np.full(count, -1, np.int64) if episodes is None else np.asarray(episodes, np.int64)
        self.steps = np.zeros(count, np.int64) if steps is None else np.asarray(steps, np.int64)
        # The gym-pusht reset seed of each start that is one (-1: a recorded or visited state); see put_in_start.
        self.seeds = np.full(count, -1, np.int64) if seeds is None else np.asarray(seeds, np.int64)
        if self.episodes.shape != (count,) or self.steps.shape != (count,) or self.seeds.shape != (count,):
            raise InputError(
                f"episodes/steps/seeds: expected one entry per state ({count}), got "
                f"{self.episodes.shape}, {self.steps.shape} and {self.seeds.shape}."
            )
        if frames is not None:
            frames = np.asarray(frames)
            if frames.dtype != np.uint8 or frames.ndim != 4 or len(frames) != count or frames.shape[-1] != 3:
                raise InputError(f"frames: expected uint8 [{count}, H, W, 3], got {frames.dtype} {frames.shape}.")
            image_size = frames.shape[1:3]
        self.frames = frames
        self.task = task
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self._sim: PushTSim | None = None  # renders frames on demand (made at the first read)
        # The last RENDERED_FRAMES_KEPT rendered starts: a vector env resets every slot of a group from one start, and
        # rendering it again for each slot took 9 of the 82 s of 20 GRPO iterations at 128 envs in groups of 8.
        self._rendered: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        super().__init__(list(range(count)), description)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_episodes(
        cls,
        episodes: Iterable[dict[str, Any]],
        *,
        stride: int = 1,
        max_step: int | None = None,
        keep_frames: bool = False,
        image_size: tuple[int, int] = (256, 256),
    ) -> DemoStartStates:
        """Every ``stride``-th step (up to ``max_step``, excluding each episode's last frame: it has no action) of
        recorded episodes, each a dict with ``sim_states [T+1, 10]`` (``rollout_episode`` / dataset ``.npz``) and,
        with ``keep_frames``, ``frames [T+1, H, W, 3]``."""
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
            raise InputError(f"stride: expected an integer >= 1, got {stride!r}.")
        states, episode_ids, steps, frames = [], [], [], []
        for index, episode in enumerate(episodes):
            if "sim_states" not in episode:
                raise InputError(f"episodes[{index}]: has no 'sim_states' (record episodes with rollout_episode).")
            recorded = np.asarray(episode["sim_states"])
            # The last frame has no action after it (an episode of one frame keeps it).
            chosen = np.arange(0, max(len(recorded) - 1, 1), stride)
            if max_step is not None:
                chosen = chosen[chosen <= max_step]
            states.append(recorded[chosen])
            episode_ids.append(np.full(len(chosen), index))
            steps.append(chosen)
            if keep_frames:
                frames.append(np.asarray(episode["frames"])[chosen])
        if not states:
            raise InputError("episodes: expected at least one episode.")
        return cls(
            np.concatenate(states),
            episodes=np.concatenate(episode_ids),
            steps=np.concatenate(steps),
            frames=np.concatenate(frames) if keep_frames else None,
            image_size=image_size,
            description=f"{len(states)} demonstrations, every {stride} steps",
        )

    @classmethod
    def from_seeds(cls, seeds: Sequence[int], image_size: tuple[int, int] = (256, 256)) -> DemoStartStates:
        """The first state of gym-pusht episodes reset with ``seeds`` (held-out evaluation starts, for example)."""
        seeds = [int(seed) for seed in seeds]
        if not seeds:
            raise InputError("seeds: expected at least one gym-pusht seed.")
        sim = PushTSim(image_size, render_every_step=False)
        try:
            states = []
            for seed in seeds:
                sim.reset(seed)
                states.append(sim.sim_state)
        finally:
            sim.close()
        return cls(
            np.stack(states),
            episodes=np.full(len(seeds), -1),
            steps=np.zeros(len(seeds), np.int64),
            image_size=image_size,
            description=f"{len(seeds)} gym-pusht resets (seeds {seeds[0]}..)",
            seeds=seeds,
        )

    def save(self, path: str | os.PathLike) -> Path:
        """An ``.npz`` with ``sim_states``, ``episodes``, ``steps``, ``seeds``, ``task``, ``image_size``,
        ``description`` (and ``frames``)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, Any] = dict(
            sim_states=self.sim_states,
            episodes=self.episodes,
            steps=self.steps,
            seeds=self.seeds,
            task=np.asarray(self.task),
            image_size=np.asarray(self.image_size),
            description=np.asarray(self.description),
        )
        if self.frames is not None:
            arrays["frames"] = self.frames
        np.savez_compressed(path, **arrays)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> DemoStartStates:
        try:
            with np.load(path, allow_pickle=False) as archive:
                arrays = {key: archive[key] for key in archive.files}
        except (OSError, ValueError) as error:
            raise InputError(f"starts: cannot read {path} as an .npz of DemoStartStates.save ({error}).") from error
        if "sim_states" not in arrays:
            raise InputError(f"starts: {path} has no 'sim_states'.")
        return cls(
            arrays["sim_states"],
            episodes=arrays.get("episodes"),
            steps=arrays.get("steps"),
            seeds=arrays.get("seeds"),
            frames=arrays.get("frames"),
            task=str(arrays.get("task", TASK)),
            image_size=cast("tuple[int, int]", tuple(int(n) for n in arrays.get("image_size", (256, 256)))),
            description=str(arrays.get("description", path)),
        )

    # ------------------------------------------------------------------ InitialStateSource

    def __getitem__(self, index: int) -> SimInitialState:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(self):
            raise InputError(f"initial_state_index: expected an integer in [0, {len(self)}), got {index!r}.")
        index = int(index)
        return SimInitialState(
            self.frame(index),
            self.task,
            f"{self.description}[{index}]",
            sim_state=self.sim_states[index].copy(),
            episode=int(self.episodes[index]),
            step=int(self.steps[index]),
        )

    def frame(self, index: int) -> np.ndarray:
        """The frame of start ``index``, uint8 ``[H, W, 3]`` (recorded, or rendered from its simulator state)."""
        if self.frames is not None:
            return self.frames[index]
        frame = self._rendered.get(index)
        if frame is None:
            if self._sim is None:
                self._sim = PushTSim(self.image_size, render_every_step=False)
            put_in_start(self._sim, self.sim_states[index], int(self.seeds[index]))
            frame = self._rendered[index] = self._sim.render()
            if len(self._rendered) > RENDERED_FRAMES_KEPT:
                self._rendered.popitem(last=False)
        else:
            self._rendered.move_to_end(index)
        return frame.copy()

    def subset(self, indices: Sequence[int]) -> DemoStartStates:
        rows = np.asarray(indices, dtype=np.int64)
        return DemoStartStates(
            self.sim_states[rows],
            episodes=self.episodes[rows],
            steps=self.steps[rows],
            seeds=self.seeds[rows],
            frames=None if self.frames is None else self.frames[rows],
            task=self.task,
            image_size=self.image_size,
            description=f"{self.description} (subset)",
        )

    def __getstate__(self):  # picklable for worker processes: the simulator and the frames are made again there
        state = dict(self.__dict__)
        state["_sim"] = None
        state["_rendered"] = collections.OrderedDict()
        return state
