"""Policy evaluation in a Gymnasium env (success rate and returns per task, with confidence intervals, and videos).

``evaluate_policy(env, policy, episodes)`` runs ``episodes`` episodes of a ``WorldModelEnv`` or across the slots of
a ``WorldModelVectorEnv`` (any Gymnasium env / vector env works) and returns an ``EvalReport``;
``evaluate_checkpoint`` builds the env from a checkpoint and its own settings first (the CLI's ``eval``).

Which episodes count. Counting the first ``episodes`` episodes to finish would favour short ones: in a world-model
env successful episodes usually end early (termination) while failures run to the time limit, so the success rate
would come out too high. Instead every episode gets a fixed identity before it starts: the ``k``-th episode of slot
``s`` of an ``M``-slot env is episode ``k * M + s``, and exactly the episodes ``0 .. episodes - 1`` count (the quota
rule of Stable-Baselines3's ``evaluate_policy``). Slots that have run their quota keep stepping with the others,
since they share one batched model call, but their episodes are ignored. Videos are written for the episodes
``0 .. max_videos - 1``.

Success must be defined, never guessed: ``info["success"]`` of an episode's last step when the env sets it (a reward
model with a ``success_threshold``, given or from the checkpoint), else ``return > success_return_threshold`` when
that threshold is given. Without either the report has no success rate (None), rather than one that means nothing.

Statistics (``cosmos3_gym.statistics``, ``confidence`` = 0.95 by default): the success rate's Wilson interval; the
mean return's Student-t interval, clipped to the return's bounds when the per-step reward bounds are known
(``reward_bounds``: a return of an episode of up to ``L`` steps lies in ``[min(lo, L lo), max(hi, L hi)]``), else
marked approximate.

Progress is counted in env steps (chunks) of the counted episodes, out of ``episodes * max_episode_steps``; an
episode that ends early adds its unused steps, so the bar ends exactly at 100 % and its ETA stays right when episodes
run batched and end at different times.

Remote policies (``ws://`` specs, ``agents.RemotePolicyAgent``). A policy server that times out, drops the connection
or answers with something malformed for some slots raises ``RemotePolicyError``: the episodes in flight in those
slots are failed (``success`` False, the one-line reason in ``error``; their slots step on with zero actions until
the episodes end, so the episode count and the other slots' results stay as they are) and the evaluation goes on,
calling the server again (it reconnects). When ``max_failed_calls`` calls in a row fail for every slot, the server is
taken to be gone: the evaluation stops, the episodes in flight are reported as failed, and ``EvaluationAborted`` (an
``InputError`` naming the server) carries the report of the episodes so far (``evaluate_checkpoint`` writes it).

``recorder`` (optional) sees every counted episode as it runs: ``start(episode, slot, observation, info)``,
``step(episode, slot, action, reward, info)`` per env step and ``finish(result)`` (an ``EpisodeResult``), e.g. to
write the episodes as a dataset (``rl.dream``).

The policy-spec registry lives in ``cosmos3_gym.policy_specs`` and the intervals in ``cosmos3_gym.statistics``; their
public names are re-exported here. Task demos build on this module.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from tqdm.auto import tqdm

from .agents import PolicyAgent
from .agents.remote import RemotePolicyError
from .checkpoint import checkpoint_decoder, checkpoint_defaults, resolve_checkpoint
from .data.initial_states import read_initial_states_archive
from .errors import InputError
from .media import write_video
from .policy_specs import RandomPolicy, load_policy
from .statistics import check_confidence, describe_mean_interval, mean_interval, student_t_quantile, wilson_interval

__all__ = [
    "CheckpointEnv",
    "EpisodeResult",
    "EvalReport",
    "EvaluationAborted",
    "RandomPolicy",
    "Summary",
    "evaluate_checkpoint",
    "evaluate_policy",
    "load_policy",
    "make_checkpoint_env",
    "mean_interval",
    "student_t_quantile",
    "wilson_interval",
]

REPORT_FORMAT = "cosmos3_gym.eval_report/1"


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class EpisodeResult:
    """One evaluated episode. ``episode`` is its identity ``k * num_envs + slot`` (see the module docstring);
    ``success`` is None when no success definition was given."""

    episode: int
    slot: int
    task: str
    episode_return: float
    length: int  # env steps (chunks)
    success: bool | None
    terminated: bool
    truncated: bool
    initial_state_index: int | None
    video: str | None  # file name inside the video folder, None when not recorded
    error: str | None = None  # why the policy failed this episode (a remote policy's one-line error), else None


class EvaluationAborted(InputError):
    """The policy failed for every slot too many calls in a row; ``report`` holds the episodes so far (those in
    flight failed)."""

    def __init__(self, message: str, report: EvalReport):
        super().__init__(message)
        self.report = report


@dataclass
class Summary:
    """Statistics over a group of episodes (all of them, or one task's). The success fields are None when success is
    undefined (no success threshold given)."""

    episodes: int
    successes: int | None
    success_rate: float | None
    success_rate_interval: tuple[float, float] | None  # Wilson
    mean_return: float
    return_std: float | None  # sample standard deviation; None for one episode
    mean_return_interval: tuple[float, float] | None  # Student t (clipped to return_bounds); None for one episode
    mean_length: float

    @classmethod
    def of(
        cls, results: Sequence[EpisodeResult], confidence: float, return_bounds: tuple[float, float] | None = None
    ) -> Summary:
        returns = [result.episode_return for result in results]
        defined = all(result.success is not None for result in results)
        successes = sum(bool(result.success) for result in results) if defined else None
        return cls(
            episodes=len(results),
            successes=successes,
            success_rate=successes / len(results) if successes is not None else None,
            success_rate_interval=wilson_interval(successes, len(results), confidence)
            if successes is not None
            else None,
            mean_return=statistics.fmean(returns),
            return_std=statistics.stdev(returns) if len(returns) > 1 else None,
            mean_return_interval=mean_interval(returns, confidence, return_bounds),
            mean_length=statistics.fmean(result.length for result in results),
        )


@dataclass
class EvalReport:
    """What ``evaluate_policy`` measured: every episode, the totals and the per-task statistics.

    ``settings`` records how the run was made (episodes, num_envs, seed, policy, confidence, success definition,
    interval methods, wall time); callers may add entries (the CLI adds the checkpoint and env settings).
    """

    episodes: list[EpisodeResult]
    overall: Summary
    per_task: dict[str, Summary]
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": REPORT_FORMAT,
            "settings": self.settings,
            "overall": asdict(self.overall),
            "per_task": {task: asdict(summary) for task, summary in self.per_task.items()},
            # An episode's "error" appears only when the policy failed it, so reports of runs without one keep
            # their schema.
            "episodes": [_episode_dict(result) for result in self.episodes],
        }

    def to_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=_json_default) + "\n")
        return path

    def table(self) -> str:
        """A plain-text table: episodes, success rate and mean return per task and overall, with intervals. Task
        names are never cut; a mean-return interval marked ``~`` is approximate (reward bounds unknown)."""
        level = f"{round(100 * self.settings.get('confidence', 0.95))}% CI"
        approximate = self.settings.get("return_bounds") is None
        rows = [("task", "episodes", f"success rate [{level}]", f"mean return [{level}{', ~' if approximate else ''}]")]
        for name, summary in [*self.per_task.items(), ("(all)", self.overall)]:
            if summary.success_rate is None:
                success = "n/a"
            else:
                assert summary.success_rate_interval is not None  # set together with success_rate (Summary.of)
                success = "{:.2f} [{:.2f}, {:.2f}]".format(summary.success_rate, *summary.success_rate_interval)
            ret = f"{summary.mean_return:.4g}"
            if summary.mean_return_interval is not None:
                ret += " [{:.4g}, {:.4g}]".format(*summary.mean_return_interval)
            rows.append((name or '""', str(summary.episodes), success, ret))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [
            "  ".join(
                cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))
            ).rstrip()
            for row in rows
        ]
        if self.overall.success_rate is None:
            lines.append(
                "success rate: n/a, no success definition (give a success threshold, or a checkpoint or "
                "env that defines one)"
            )
        if approximate:
            lines.append("~: the reward's bounds are unknown, so the mean-return interval is approximate")
        failed = [result for result in self.episodes if result.error is not None]
        if failed:
            lines.append(f"{len(failed)} episode(s) failed on a policy error, first: {failed[0].error}")
        return "\n".join(lines)


def _episode_dict(result: EpisodeResult) -> dict[str, Any]:
    entry = asdict(result)
    if entry["error"] is None:
        del entry["error"]
    return entry


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def return_bounds(reward_bounds: tuple[float, float] | None, max_length: int | None) -> tuple[float, float] | None:
    """The bounds of an episode's return for per-step rewards in ``reward_bounds`` and episodes of 1 ..
    ``max_length`` steps; None when either is unknown."""
    if reward_bounds is None or max_length is None:
        return None
    low, high = (float(bound) for bound in reward_bounds)
    if not low <= high:
        raise InputError(f"reward_bounds: expected (low, high) with low <= high, got {reward_bounds!r}.")
    return min(low, max_length * low), max(high, max_length * high)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------


def _policy_name(policy: Any) -> str:
    name = getattr(policy, "name", None)
    return name if isinstance(name, str) else type(policy).__name__


ActFunction = Callable[[Any, list[str], np.ndarray], Any]


def _act_function(policy: Any, batched: bool, deterministic: bool) -> ActFunction:
    """``act(observations, tasks, episode_starts) -> actions`` for a batch of slots, whatever the policy's kind.

    ``batched=False`` (a single env run as one slot): the policy sees and returns one unbatched item.
    """
    if isinstance(policy, PolicyAgent):

        def act_one(observation, tasks, starts):  # the agent takes each slot's instruction as its prompt
            return policy.act(observation, task=tasks if batched else tasks[0])
    elif getattr(policy, "takes_tasks", False):  # e.g. a remote policy, which sends each slot's task as its prompt

        def act_one(observation, tasks, starts):
            return policy(observation, tasks=tasks if batched else tasks[0])
    elif callable(getattr(policy, "predict", None)):  # Stable-Baselines3 model or policy (recurrent state kept)
        state = None

        def act_one(observation, tasks, starts):
            nonlocal state
            action, state = policy.predict(
                observation, state=state, episode_start=starts if batched else starts[:1], deterministic=deterministic
            )
            return action
    elif callable(policy):

        def act_one(observation, tasks, starts):
            return policy(observation)
    else:
        raise InputError(
            f"policy: expected a callable obs -> action, a Stable-Baselines3 model (predict) or a PolicyAgent, got "
            f"{type(policy).__name__}."
        )
    if batched:
        return act_one

    def act_unbatched(observations, tasks, starts):
        return np.asarray(act_one(_first_item(observations), tasks, starts))[None]

    return act_unbatched


def _first_item(observations: Any) -> Any:
    if isinstance(observations, dict):
        return {key: _first_item(value) for key, value in observations.items()}
    return observations[0]


# ---------------------------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _RunningEpisode:
    episode: int  # the identity k * num_envs + slot
    task: str
    initial_state_index: int | None
    clips: list[np.ndarray] | None  # recorded frames, [T, H, W, 3] each; None when this episode is not recorded
    episode_return: float = 0.0
    length: int = 0
    error: str | None = None  # the first policy error of this episode (it then counts as failed)


class _EpisodeBook:
    """Which episode runs in each slot, and the results of the finished ones that count."""

    def __init__(
        self,
        num_envs: int,
        episodes: int,
        success_return_threshold: float | None,
        max_videos: int,
        video_dir: Path | None,
        fps: float,
        bar,
        max_episode_steps: int | None,
        recorder: Any = None,
    ):
        self.num_envs, self.episodes, self.success_return_threshold = num_envs, episodes, success_return_threshold
        self.max_videos, self.video_dir, self.fps, self.bar = max_videos, video_dir, fps, bar
        self.max_episode_steps = max_episode_steps
        self.recorder = recorder
        self.started = [0] * num_envs
        self.running: list[_RunningEpisode | None] = [None] * num_envs
        self.finished: list[EpisodeResult] = []

    def start(self, slot: int, info: dict, observations: Any) -> None:
        """A new episode in ``slot``; ``info`` is the vector info holding its reset info."""
        slot = int(slot)
        episode = self.started[slot] * self.num_envs + slot
        self.started[slot] += 1
        clips = None
        if episode < self.max_videos:
            first = _observation_image(observations, slot)
            clips = [] if first is None else [first[None]]
        index = _slot_value(info, "initial_state_index", slot)
        self.running[slot] = _RunningEpisode(
            episode, str(_slot_value(info, "task", slot, "")), None if index is None else int(index), clips
        )
        if self.recorder is not None and episode < self.episodes:
            self.recorder.start(episode, slot, _slot_observation(observations, slot), _slot_info(info, slot))

    def fail(self, slot: int, error: str) -> None:
        """The policy failed the episode running in ``slot`` (it ends as it would, and counts as failed)."""
        current = self.running[slot]
        if current is not None and current.error is None:
            current.error = error

    def counts(self, slot: int) -> bool:
        """Whether the episode running in ``slot`` is one of the evaluated ones (within the slot's quota)."""
        current = self.running[slot]
        return current is not None and current.episode < self.episodes

    def current(self, slot: int) -> _RunningEpisode:
        """The episode running in ``slot``."""
        current = self.running[slot]
        assert current is not None  # every slot runs an episode from the first reset on
        return current

    def finish(self, slot: int, step_info: dict, terminated: bool, truncated: bool) -> None:
        current = self.current(slot)
        if current.episode >= self.episodes:  # beyond this slot's quota: not part of the evaluation
            return
        success = step_info.get("success")
        if success is not None:
            success = bool(success)
        elif self.success_return_threshold is not None:
            success = current.episode_return > self.success_return_threshold
        if current.error is not None:
            success = False
        video = None
        if current.clips:
            assert self.video_dir is not None  # episodes are recorded only with a video_dir (max_videos is 0 without)
            video = write_video(
                self.video_dir / f"episode_{current.episode:04d}.mp4", _concatenate_clips(current.clips), fps=self.fps
            ).name
        self.finished.append(
            EpisodeResult(
                current.episode,
                slot,
                current.task,
                current.episode_return,
                current.length,
                success,
                terminated,
                truncated,
                current.initial_state_index,
                video,
                current.error,
            )
        )
        if self.recorder is not None:
            self.recorder.finish(self.finished[-1])
        if self.max_episode_steps is not None and current.length < self.max_episode_steps:
            self.bar.update(self.max_episode_steps - current.length)  # the steps this episode will not take
        self.bar.set_postfix(episodes=f"{len(self.finished)}/{self.episodes}", refresh=False)


def evaluate_policy(
    env: gym.Env | VectorEnv,
    policy: Any,
    episodes: int,
    *,
    seed: int | None = 0,
    video_dir: str | os.PathLike | None = None,
    max_videos: int = 8,
    success_return_threshold: float | None = None,
    confidence: float = 0.95,
    deterministic: bool = True,
    progress: bool = True,
    max_episode_steps: int | None = None,
    reward_bounds: tuple[float, float] | None = None,
    max_failed_calls: int = 3,
    recorder: Any = None,
    description: str = "evaluating (env steps)",
) -> EvalReport:
    """Run ``episodes`` episodes of ``policy`` in ``env`` and report success and return per task.

    ``env``: a Gymnasium env or vector env (any autoreset mode), e.g. ``WorldModelVectorEnv``; it is reset once with
    ``seed`` (slot ``i`` gets ``seed + i``) and not closed. Episodes must end (give the env ``max_episode_steps``).
    ``policy``: a callable ``obs -> action`` (batched ``obs -> actions`` for a vector env), a Stable-Baselines3
    model (``predict``, with ``deterministic``), or a ``PolicyAgent`` (prompted with each slot's task).
    ``video_dir``: write ``episode_NNNN.mp4`` for the episodes ``0 .. max_videos - 1``; frames come from
    ``info["frames"]`` (make the env with ``return_frames=True``) or else from ``render()`` (``render_mode=
    "rgb_array"``: one frame per step; under SAME_STEP autoreset an episode's last frame is then missing).
    ``success_return_threshold``: where the env sets no ``info["success"]``, an episode succeeds when its return
    exceeds this; with neither, success (and the success rate) is None. ``max_episode_steps``: the episodes' step
    limit for the progress bar and the return's bounds (default: the env's spec or settings). ``reward_bounds``:
    the per-step reward's ``(low, high)``, to clip the mean-return interval to the return's bounds.
    ``max_failed_calls``: stop (``EvaluationAborted``) after this many calls in a row in which a remote policy
    failed for every slot. ``recorder``: sees every counted episode (module docstring). ``description``: the
    progress bar's.
    See the module docstring for which episodes count, success, remote policies' errors and the intervals.
    """
    if isinstance(episodes, bool) or not isinstance(episodes, (int, np.integer)) or episodes < 1:
        raise InputError(f"episodes: expected an integer >= 1, got {episodes!r}.")
    if isinstance(max_videos, bool) or not isinstance(max_videos, (int, np.integer)) or max_videos < 0:
        raise InputError(f"max_videos: expected an integer >= 0, got {max_videos!r}.")
    if (
        isinstance(max_failed_calls, bool)
        or not isinstance(max_failed_calls, (int, np.integer))
        or max_failed_calls <= 0
    ):
        raise InputError(f"max_failed_calls: expected an integer >= 1, got {max_failed_calls!r}.")
    confidence = check_confidence(confidence)
    episodes = int(episodes)
    if video_dir is not None:
        video_dir = Path(video_dir)
        video_dir.mkdir(parents=True, exist_ok=True)

    batched = isinstance(env, VectorEnv)
    # A single env runs as a one-slot vector env (Gymnasium's own wrapper), so one loop serves both. DISABLED: the loop
    # resets it after the step that ended the episode (no policy call is spent on a reset step).
    vector_env: VectorEnv
    if isinstance(env, VectorEnv):
        vector_env = env
    else:
        single_env = env
        vector_env = SyncVectorEnv([lambda: single_env], autoreset_mode=AutoresetMode.DISABLED)
    autoreset = AutoresetMode(vector_env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
    act = _act_function(policy, batched, deterministic)
    num_envs = vector_env.num_envs
    fps = float(vector_env.metadata.get("render_fps") or 15.0)
    if max_episode_steps is None:
        max_episode_steps = _max_episode_steps(env)
    elif (
        isinstance(max_episode_steps, bool)
        or not isinstance(max_episode_steps, (int, np.integer))
        or max_episode_steps < 1
    ):
        raise InputError(f"max_episode_steps: expected an integer >= 1 or None, got {max_episode_steps!r}.")

    wall_start = time.perf_counter()
    vector_steps = 0
    total = None if max_episode_steps is None else episodes * int(max_episode_steps)
    failed_calls = 0  # calls in a row in which the policy failed for every slot
    policy_errors = 0  # slots failed by the policy, over the run
    aborted: str | None = None
    with tqdm(total=total, unit="step", desc=description, disable=not progress, file=sys.stderr) as bar:
        book = _EpisodeBook(
            num_envs,
            episodes,
            success_return_threshold,
            int(max_videos) if video_dir is not None else 0,
            video_dir,
            fps,
            bar,
            max_episode_steps,
            recorder,
        )
        observations, info = vector_env.reset(seed=seed)
        for slot in range(num_envs):
            book.start(slot, info, observations)
        episode_starts = np.ones(num_envs, dtype=np.bool_)
        reset_now = np.zeros(num_envs, dtype=np.bool_)  # NEXT_STEP autoreset: the slots the coming step resets
        actions = None
        while len(book.finished) < episodes:
            if not reset_now.all():  # when every slot resets, the env ignores the actions: keep the last ones
                try:
                    actions = act(observations, [book.current(slot).task for slot in range(num_envs)], episode_starts)
                    failed_calls = 0
                except RemotePolicyError as error:
                    failed = np.zeros(num_envs, bool)
                    failed[: len(error.failed)] = np.asarray(error.failed, bool)[:num_envs]
                    stepping = failed & ~reset_now  # a slot reset in this step has no episode to fail
                    for failed_slot in np.flatnonzero(stepping):
                        book.fail(int(failed_slot), str(error))
                    policy_errors += int(stepping.sum())
                    failed_calls = failed_calls + 1 if failed.all() else 0
                    if failed_calls >= max_failed_calls:
                        aborted = (
                            f"{error} ({failed_calls} calls in a row failed for every slot: stopped after "
                            f"{len(book.finished)} of {episodes} episodes, the episodes in flight reported as failed)"
                        )
                        for slot in range(num_envs):
                            if book.counts(slot) and not reset_now[slot]:
                                book.finish(slot, {}, False, True)
                        break
                    actions = _fallback_actions(error.actions, actions, vector_env.action_space)
            observations, rewards, terminated, truncated, info = vector_env.step(actions)
            vector_steps += 1
            rendered = None  # render() frames, fetched only if a recorded slot's info has no frames
            done = (terminated | truncated) & ~reset_now
            episode_starts = reset_now.copy()
            for slot in range(num_envs):
                if reset_now[slot]:  # this step reset the slot (its action was ignored); info is its reset info
                    book.start(slot, info, observations)
                    continue
                reset_in_step = bool(done[slot]) and autoreset == AutoresetMode.SAME_STEP
                step_info = _slot_info(info["final_info"] if reset_in_step else info, slot)
                current = book.current(slot)
                current.episode_return += float(rewards[slot])
                current.length += 1
                if book.counts(slot):
                    bar.update(1)
                    if recorder is not None:
                        recorder.step(current.episode, slot, np.asarray(actions)[slot], float(rewards[slot]), step_info)
                if current.clips is not None:
                    if "frames" in step_info:
                        current.clips.append(np.asarray(step_info["frames"]))
                    elif not reset_in_step:  # after a same-step reset render() already shows the next episode
                        rendered = _render(vector_env) if rendered is None else rendered
                        current.clips.append(np.asarray(rendered[slot])[None])
                if done[slot]:
                    book.finish(slot, step_info, bool(terminated[slot]), bool(truncated[slot]))
                    if reset_in_step:  # info holds the reset info of the slot's next episode
                        book.start(slot, info, observations)
                        episode_starts[slot] = True
            if autoreset == AutoresetMode.NEXT_STEP:
                reset_now = done
            elif autoreset == AutoresetMode.DISABLED and done.any():
                observations, info = vector_env.reset(options={"reset_mask": done})
                for slot in np.flatnonzero(done).tolist():
                    book.start(slot, info, observations)
                    episode_starts[slot] = True

    finished = sorted(book.finished, key=lambda result: result.episode)
    if not finished:  # stopped before any counted episode ran (cannot happen with num_envs >= 1)
        raise InputError(aborted or "episodes: no episode finished.")
    tasks = sorted({result.task for result in finished})
    longest = max(result.length for result in finished)
    bounds = return_bounds(reward_bounds, max(int(max_episode_steps or 0), longest))
    if success_return_threshold is not None:
        success_rule = (
            f"info['success'] of the last step when the env sets it, else return > {success_return_threshold}"
        )
    elif all(result.success is not None for result in finished):
        success_rule = "info['success'] of the last step (the env's success threshold)"
    else:
        success_rule = None
    settings = {
        "episodes": episodes,
        "num_envs": num_envs,
        "seed": seed,
        "policy": _policy_name(policy),
        "autoreset_mode": autoreset.value,
        "success": success_rule,
        "success_return_threshold": success_return_threshold,
        "confidence": confidence,
        "success_rate_interval": "wilson" if success_rule is not None else None,
        "mean_return_interval": describe_mean_interval(bounds),
        "reward_bounds": None if reward_bounds is None else [float(b) for b in reward_bounds],
        "return_bounds": None if bounds is None else list(bounds),
        "max_episode_steps": max_episode_steps,
        "video_dir": None if video_dir is None else str(video_dir),
        "env_steps": vector_steps,
        "wall_s": time.perf_counter() - wall_start,
        "policy_errors": policy_errors,
    }
    if aborted is not None:
        settings["aborted"] = aborted
    report = EvalReport(
        episodes=finished,
        overall=Summary.of(finished, confidence, bounds),
        per_task={task: Summary.of([r for r in finished if r.task == task], confidence, bounds) for task in tasks},
        settings=settings,
    )
    if aborted is not None:
        raise EvaluationAborted(aborted, report)
    return report


def _fallback_actions(partial: np.ndarray | None, previous: Any, action_space: Any) -> Any:
    """Actions for a step in which the policy failed some slots: the rows that answered (``partial``, zeros in the
    failed rows), else the last actions, else zeros; inside the action space's bounds."""
    shape = getattr(action_space, "shape", None)
    if partial is not None and shape is not None and tuple(np.shape(partial)) == tuple(shape):
        actions = np.asarray(partial, dtype=action_space.dtype)
    elif previous is not None:
        return previous
    elif isinstance(action_space, gym.spaces.Box):
        actions = np.zeros(action_space.shape, dtype=action_space.dtype)
    else:
        return action_space.sample()
    if isinstance(action_space, gym.spaces.Box):
        actions = np.clip(actions, action_space.low, action_space.high).astype(action_space.dtype)
    return actions


def _slot_observation(observations: Any, slot: int) -> Any:
    if isinstance(observations, dict):
        return {key: _slot_observation(value, slot) for key, value in observations.items()}
    return observations[slot]


def _slot_value(info: dict, key: str, slot: int, default: Any = None) -> Any:
    """Slot ``slot``'s entry of a vector info dict (masked by ``_key``), or ``default``."""
    mask = info.get(f"_{key}")
    if key not in info or (mask is not None and not mask[slot]):
        return default
    value = info[key][slot]
    return value.item() if isinstance(value, np.generic) else value


def _slot_info(info: dict, slot: int) -> dict[str, Any]:
    """The entries of a vector info dict that slot ``slot`` has (``final_obs`` / ``final_info`` left out)."""
    absent = object()
    entries = {
        key: _slot_value(info, key, slot, absent)
        for key in info
        if not key.startswith("_") and key not in ("final_obs", "final_info")
    }
    return {key: value for key, value in entries.items() if value is not absent}


def _render(vector_env: VectorEnv) -> Sequence[np.ndarray]:
    frames = vector_env.render() if getattr(vector_env, "render_mode", None) == "rgb_array" else None
    if frames is None:
        raise InputError(
            "video_dir: the env gives no frames to record; create it with return_frames=True (frames in "
            "info['frames']) or render_mode='rgb_array', or pass video_dir=None."
        )
    return cast("Sequence[np.ndarray]", frames)  # render_mode "rgb_array": one image array per slot


def _observation_image(observations: Any, slot: int) -> np.ndarray | None:
    """The slot's observed image ``[H, W, 3]`` (a video's first frame), if the observation holds one."""
    image = observations.get("image") if isinstance(observations, dict) else observations
    if not isinstance(image, np.ndarray) or image.ndim != 4 or image.shape[-1] != 3:
        return None
    return image[slot]


def _concatenate_clips(clips: list[np.ndarray]) -> np.ndarray:
    """One video from the recorded clips; the first (the observed start image) is dropped if its size differs from
    the model's frames (an env with ``observation_size``)."""
    size = clips[-1].shape[1:]
    return np.concatenate([clip for clip in clips if clip.shape[1:] == size])


def _max_episode_steps(env: Any) -> int | None:
    """The env's episode step limit: its registered spec's, else its settings' (None when unbounded/unknown)."""
    spec_limit = getattr(getattr(env, "spec", None), "max_episode_steps", None)
    if spec_limit:
        return int(spec_limit)
    value = getattr(getattr(getattr(env, "unwrapped", env), "settings", None), "max_episode_steps", None)
    return int(value) if isinstance(value, (int, np.integer)) and not isinstance(value, bool) else None


# ---------------------------------------------------------------------------------------------------------------
# Evaluating a checkpoint (the CLI's `eval`)
# ---------------------------------------------------------------------------------------------------------------

# Used where neither the user nor the checkpoint gives a setting.
FALLBACK_ENV_SETTINGS = dict(
    domain="droid_lerobot",
    chunk=32,
    resolution_tier=480,
    fps=15.0,
    num_steps=4,
    guidance_scale=3.0,
    max_episode_steps=10,
)


@dataclass
class CheckpointEnv:
    """What ``make_checkpoint_env`` built: the vector env and the settings it was made with."""

    env: Any  # a WorldModelVectorEnv
    checkpoint: Path
    settings: dict[str, Any]  # every env setting used (the user's, else the checkpoint's, else the fallbacks)
    overrides: dict[str, Any]  # the settings given that differ from the checkpoint's: {key: {checkpoint, used}}
    reward_bounds: tuple[float, float] | None
    decoder: str
    observation_size: tuple[int, int] | None


def make_checkpoint_env(
    checkpoint: str | os.PathLike,
    *,
    num_envs: int = 1,
    initial_states: Any = None,
    task: str | None = None,
    reward_model: Any = None,
    reward_bounds: tuple[float, float] | None = None,
    success_threshold: float | None = None,
    max_episode_steps: int | None = None,
    domain: str | int | None = None,
    raw_action_dim: int | None = None,
    chunk: int | None = None,
    num_steps: int | None = None,
    guidance_scale: float | None = None,
    resolution_tier: int | None = None,
    fps: float | None = None,
    observation_size: int | tuple[int, int] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    return_frames: bool = False,
    decoder: str | None = None,
    log: Callable[[str], None] | None = None,
    command: str = "eval",
) -> CheckpointEnv:
    """A ``WorldModelVectorEnv`` of ``num_envs`` slots on ``checkpoint`` (a folder, hub id, or a built-in model's
    name) with its own settings where none are given (``evaluate_checkpoint``'s rules; ``command`` names the caller
    in the override messages sent to ``log``)."""
    from .envs import WorldModelSettings, WorldModelVectorEnv
    from .envs.core import check_is_checkpoint
    from .envs.settings import split_settings

    log = log if log is not None else (lambda message: print(message, file=sys.stderr))
    checkpoint = resolve_checkpoint(checkpoint)
    check_is_checkpoint(checkpoint)  # a folder that is not one says so, not that it ships no start states
    recorded = checkpoint_defaults(checkpoint)
    decoder = decoder if decoder is not None else checkpoint_decoder(checkpoint)
    given = dict(
        domain=domain,
        raw_action_dim=raw_action_dim,
        chunk=chunk,
        resolution_tier=resolution_tier,
        fps=fps,
        num_steps=num_steps,
        guidance_scale=guidance_scale,
        task=task,
        reward_model=reward_model,
        success_threshold=success_threshold,
        max_episode_steps=max_episode_steps,
        initial_states=initial_states,
    )
    settings, overrides = {}, {}
    for key, value in given.items():
        if value is not None:
            settings[key] = value
            if key in recorded and key != "initial_states" and recorded[key] != value:
                overrides[key] = {"checkpoint": recorded[key], "used": value}
                log(f"{command}: using {key}={value!r} instead of the checkpoint's {recorded[key]!r}")
        elif key in recorded:
            settings[key] = recorded[key]
        elif key in FALLBACK_ENV_SETTINGS:
            settings[key] = FALLBACK_ENV_SETTINGS[key]
        else:
            settings[key] = None
    if settings["initial_states"] is None:
        raise InputError(
            "initial_states: this checkpoint ships no start states; give an image, video or folder (--initial-states)."
        )
    if settings["reward_model"] is None and settings["success_threshold"] is not None and success_threshold is None:
        settings["success_threshold"] = None  # the checkpoint's threshold applies to its reward model only
    if reward_bounds is None and str(settings["reward_model"] or "").startswith("classifier:"):
        reward_bounds = (0.0, 1.0)
    if recorded.get("action_stats") is not None:
        settings["action_stats"] = recorded["action_stats"]
    size: tuple[int, int] | None = None
    if isinstance(observation_size, (int, np.integer)) and not isinstance(observation_size, bool):
        size = (int(observation_size), int(observation_size))
    elif isinstance(observation_size, (tuple, list)) and len(observation_size) == 2:
        size = (int(observation_size[0]), int(observation_size[1]))
    elif observation_size is not None:
        raise InputError(f"observation_size: expected N or (H, W), got {observation_size!r}.")
    initial_states = settings["initial_states"]
    if isinstance(initial_states, (str, os.PathLike)) and Path(initial_states).suffix == ".npz":
        # A start-frames archive (frames [N, H, W, 3], as checkpoints carry) is N states, read as checkpoint_defaults
        # reads them; the env itself takes any other .npz as one state.
        try:
            initial_states = read_initial_states_archive(Path(initial_states).expanduser())
        except InputError:
            pass
    # The checkpoint's own settings as the env's base (settings=): the overrides were reported above, once, so the
    # env does not log them again in other words.
    base = WorldModelSettings(**split_settings(dict(recorded)))
    env = WorldModelVectorEnv(
        num_envs,
        checkpoint,
        settings=base,
        **{**settings, "initial_states": initial_states},
        observation_size=size,
        return_frames=return_frames,
        device=device,
        dtype=dtype,
        decoder=decoder,
    )
    return CheckpointEnv(env, Path(checkpoint), settings, overrides, reward_bounds, decoder, size)


def evaluate_checkpoint(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    policy: str = "agent",
    episodes: int = 10,
    num_envs: int = 1,
    initial_states: Any = None,
    task: str | None = None,
    reward_model: Any = None,
    reward_bounds: tuple[float, float] | None = None,
    success_threshold: float | None = None,
    success_return_threshold: float | None = None,
    max_episode_steps: int | None = None,
    domain: str | int | None = None,
    raw_action_dim: int | None = None,
    chunk: int | None = None,
    num_steps: int | None = None,
    guidance_scale: float | None = None,
    resolution_tier: int | None = None,
    fps: float | None = None,
    observation_size: int | tuple[int, int] | None = None,
    device: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
    max_videos: int = 8,
    progress: bool = True,
    extra_settings: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
    decoder: str | None = None,
) -> EvalReport:
    """Load ``checkpoint`` (a folder, hub id, or a built-in model's name) into a ``WorldModelVectorEnv``
    of ``num_envs`` slots, evaluate ``policy`` (a ``policy_specs`` spec) for ``episodes`` episodes and write
    ``out_dir/report.json`` and the episode videos.

    Settings left at None come from the checkpoint (``checkpoint.checkpoint_defaults``: its meta.json, with its
    reward model, start frames and action statistics), else ``FALLBACK_ENV_SETTINGS``; each setting given that differs
    from the checkpoint's is reported through ``log`` (default: stderr) and in the report's ``overrides``.
    ``observation_size``: the policy's image size (an int for square images), as ``WorldModelEnv``'s. When a remote
    policy's server stops answering (``EvaluationAborted``), the report of the episodes so far is written, then the
    error raised.
    ``reward_bounds``: the per-step reward's range (default: [0, 1] for a classifier reward model, which scores
    with a sigmoid; else unknown). ``extra_settings`` are added to the report's settings. ``decoder``: "vae" or
    "light" (default: the checkpoint's, ``checkpoint.checkpoint_decoder``).
    """
    built = make_checkpoint_env(
        checkpoint,
        num_envs=num_envs,
        initial_states=initial_states,
        task=task,
        reward_model=reward_model,
        reward_bounds=reward_bounds,
        success_threshold=success_threshold,
        max_episode_steps=max_episode_steps,
        domain=domain,
        raw_action_dim=raw_action_dim,
        chunk=chunk,
        num_steps=num_steps,
        guidance_scale=guidance_scale,
        resolution_tier=resolution_tier,
        fps=fps,
        observation_size=observation_size,
        device=device,
        dtype=dtype,
        return_frames=max_videos > 0,
        decoder=decoder,
        log=log,
    )
    env, settings, out_dir = built.env, built.settings, Path(out_dir)
    aborted: EvaluationAborted | None = None
    try:
        agent = load_policy(policy, env, seed=seed)
        try:
            report = evaluate_policy(
                env,
                agent,
                episodes,
                seed=seed,
                video_dir=out_dir if max_videos > 0 else None,
                max_videos=max_videos,
                success_return_threshold=success_return_threshold,
                progress=progress,
                max_episode_steps=settings["max_episode_steps"],
                reward_bounds=built.reward_bounds,
            )
        except EvaluationAborted as error:  # the report of the episodes so far is written below, then re-raised
            aborted, report = error, error.report
    finally:
        env.close()
    report.settings.update(
        policy=policy,
        checkpoint=str(built.checkpoint),
        overrides=built.overrides,
        decoder=built.decoder,
        initial_states=str(settings["initial_states"])
        if isinstance(settings["initial_states"], (str, os.PathLike))
        else "<from the checkpoint or in memory>",
        observation_size=None if built.observation_size is None else list(built.observation_size),
        env={
            key: (value if isinstance(value, (str, int, float, type(None))) else str(value))
            for key, value in settings.items()
            if key != "initial_states"
        },
        **(extra_settings or {}),
    )
    report.to_json(out_dir / "report.json")
    if aborted is not None:
        raise EvaluationAborted(f"{aborted} (the report so far: {out_dir / 'report.json'})", report)
    return report
