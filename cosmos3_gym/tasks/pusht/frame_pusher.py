"""The scripted pusher as a frame policy (``scripted-frames:NOISE``): it sees pixels, not the simulator's state.

``ScriptedPusher`` reads gym-pusht's true agent position and block pose every step, so a world model can only replay
its actions open loop: once the imagined block drifts a few pixels, the replayed pushes miss it, and the world model
under-credits the policy for a reason that has nothing to do with how users evaluate theirs (closed loop, on the
frames they see). ``FrameScriptedPusher`` reads both off each chunk's first frame instead (``readoff.read_state``:
the agent's blue disc by colour, the block by fitting a rigid T; within about 1 px and 0.4 degrees on simulator
frames) and plans the chunk's steps by predicting where the agent goes: gym-pusht's PD controller (the agent lags its
targets, covering about a quarter of the way in one step) integrated from the frame's agent position, with the block
held still within the chunk. It then runs closed loop in gym-pusht and in a world model alike, on whatever frames
each world shows it, like the BC and RL pixel policies. In gym-pusht it reaches about 0.6 final coverage in 16 chunks
where the per-step pusher reaches 0.9 (planning as if the agent reached each target instead: 0.2).

With ``planner="physics"`` (``scripted-physics:NOISE``) it plans the chunk in gym-pusht's own physics instead: a
private simulator is put in the state read off the frame (the block at rest, the agent at its predicted velocity) and
the per-step pusher runs in it for the chunk, so the plan follows the block as it is pushed. In gym-pusht this
reaches about 0.95 final coverage (8 starts), a closed-loop policy as good as the state-reading one, so the
policies a world model is ranked on can span the task's whole range. It still sees only the frame: in a world model
it plans from the imagined state, and its plan goes wrong where the imagined state is wrong.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import InputError
from .geometry import TABLE_SIZE
from .policies import ScriptedPusher, plan_chunk_in_physics
from .readoff import read_state

if TYPE_CHECKING:
    from .sim import PushTSim

__all__ = ["FrameScriptedPusher"]


class FrameScriptedPusher:
    """``act(frames uint8 [N, H, W, 3]) -> [N, chunk, 2]`` normalised targets (the world-model env's action space,
    through ``action_stats.normalize``), one ``ScriptedPusher`` per slot with target noise ``noise`` px, seeded by
    ``(seed, slot)``. ``start_episodes()`` starts new episodes (the pushers keep their chosen contact and the
    agent's predicted velocity between chunks): call it before each world's episodes so that both see the same
    policy. A slot where no block is found holds its agent where it is; one where the agent is not found plans from
    its last target (the table's centre at first). ``planner``: ``"controller"`` (the agent's PD controller, the block
    held still) or ``"physics"`` (gym-pusht's physics; module docstring)."""

    # gym-pusht's agent: PD control towards the target (k_p 100, k_v 20) at 100 Hz, 10 physics steps per action.
    K_P, K_V, PHYSICS_DT, PHYSICS_STEPS = 100.0, 20.0, 0.01, 10

    PLANNERS = ("controller", "physics")

    def __init__(self, noise: float, chunk: int, action_stats: Any, seed: int = 0, planner: str = "controller"):
        if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not noise >= 0:
            raise InputError(f"noise: expected a number of pixels >= 0, got {noise!r}.")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise InputError(f"chunk: expected an integer >= 1, got {chunk!r}.")
        if not callable(getattr(action_stats, "normalize", None)):
            raise InputError(f"action_stats: expected the checkpoint's ActionStats, got {type(action_stats).__name__}.")
        if planner not in self.PLANNERS:
            raise InputError(f"planner: expected one of {list(self.PLANNERS)}, got {planner!r}.")
        self.noise, self.chunk, self.action_stats, self.seed = float(noise), chunk, action_stats, seed
        self.planner = planner
        self._physics: PushTSim | None = None  # planner="physics": the private gym-pusht simulator, made on first use
        self._pushers: list[ScriptedPusher] = []
        self._last_targets: np.ndarray | None = None
        self._velocities: np.ndarray | None = None  # the agent's, as predicted at the end of the last chunk

    @property
    def action_shape(self) -> tuple[int, int]:
        return (self.chunk, 2)

    def start_episodes(self) -> None:
        self._pushers, self._last_targets, self._velocities = [], None, None

    def act(self, frames: np.ndarray) -> np.ndarray:
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise InputError(f"frames: expected uint8 [N, H, W, 3], got {frames.dtype} {list(frames.shape)}")
        count = len(frames)
        if len(self._pushers) != count:  # a new batch of episodes
            self._pushers = [
                ScriptedPusher(np.random.default_rng([self.seed, slot]), noise=self.noise) for slot in range(count)
            ]
            self._last_targets = np.full((count, 2), TABLE_SIZE / 2.0)
            self._velocities = np.zeros((count, 2))
        agents, poses, found = read_state(frames)
        targets = np.empty((count, self.chunk, 2), np.float64)
        for slot in range(count):
            last_targets, velocities = self._last_targets, self._velocities
            assert last_targets is not None and velocities is not None  # set with this batch's pushers
            position = agents[slot] if np.isfinite(agents[slot]).all() else last_targets[slot]
            if found[slot] and self.planner == "physics":
                velocity = self._plan_in_physics(
                    self._pushers[slot], position, velocities[slot], poses[slot], targets[slot]
                )
            else:  # the controller plan; with no block found, the agent is held where it is
                pusher = self._pushers[slot] if found[slot] else None
                velocity = self._plan_with_controller(pusher, position, velocities[slot], poses[slot], targets[slot])
            last_targets[slot], velocities[slot] = targets[slot, -1], velocity
        return np.clip(np.asarray(self.action_stats.normalize(targets), np.float32), -1.0, 1.0)

    def _plan_with_controller(
        self,
        pusher: ScriptedPusher | None,
        position: np.ndarray,
        velocity: np.ndarray,
        pose: np.ndarray,
        out: np.ndarray,
    ) -> np.ndarray:
        """Fill ``out [chunk, 2]`` with the pusher's targets along the agent's predicted path (the block held still;
        no pusher: the agent's own position, holding it); returns the agent's velocity at the chunk's end."""
        for step in range(self.chunk):
            out[step] = target = pusher(position, pose) if pusher is not None else position
            for _ in range(self.PHYSICS_STEPS):  # semi-implicit Euler, as pymunk integrates it
                velocity = velocity + (self.K_P * (target - position) - self.K_V * velocity) * self.PHYSICS_DT
                position = position + velocity * self.PHYSICS_DT
        return velocity

    def _plan_in_physics(
        self, pusher: ScriptedPusher, position: np.ndarray, velocity: np.ndarray, pose: np.ndarray, out: np.ndarray
    ) -> np.ndarray:
        """The same, stepping gym-pusht from the read-off state (the block at rest); returns the agent's velocity."""
        if self._physics is None:
            from .sim import PushTSim

            self._physics = PushTSim((16, 16), render_every_step=False)  # never draws: only its physics is used
        sim = self._physics
        out[:] = plan_chunk_in_physics(sim, pusher, np.concatenate([position, velocity, pose, np.zeros(3)]), self.chunk)
        return np.asarray(sim.sim_state[2:4], float)


# The scripted pushers that read frames, and how each plans a chunk.
FRAME_PUSHER_PLANNERS = {"scripted-frames": "controller", "scripted-physics": "physics"}


def make_frame_pusher(spec: Any, *, action_stats: Any, chunk: int | None, seed: int = 0) -> FrameScriptedPusher:
    """The frame agent of ``scripted-frames:NOISE`` / ``scripted-physics:NOISE`` (``policy_specs.PolicyKind``): it
    needs the world model's ``action_stats`` and ``chunk``."""
    if action_stats is None or chunk is None:
        raise InputError(
            f"policy: {spec.spec!r} needs action_stats and chunk (the world model's action "
            "normalisation and chunk length)."
        )
    return FrameScriptedPusher(spec.noise, chunk, action_stats, seed=seed, planner=FRAME_PUSHER_PLANNERS[spec.kind])
