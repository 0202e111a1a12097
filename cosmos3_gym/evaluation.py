"""Policy evaluation in the world model (success rate and returns per task, with confidence intervals, and videos)
and the ``cosmos3-gym demo`` run.

``evaluate_policy(env, policy, episodes)`` runs ``episodes`` episodes of a ``WorldModelEnv`` or across the slots of
a ``WorldModelVectorEnv`` (any Gymnasium env / vector env works) and returns an ``EvalReport``.

Which episodes count. Counting the first ``episodes`` episodes to finish would favour short ones: in a world-model
env successful episodes usually end early (termination) while failures run to the time limit, so the success rate
would come out too high. Instead every episode gets a fixed identity before it starts: the ``k``-th episode of slot
``s`` of an ``M``-slot env is episode ``k * M + s``, and exactly the episodes ``0 .. episodes - 1`` count (the quota
rule of Stable-Baselines3's ``evaluate_policy``). Slots that have run their quota keep stepping with the others,
since they share one batched model call, but their episodes are ignored. Videos are written for the episodes
``0 .. max_videos - 1``.

Statistics (``confidence`` = 0.95 by default):

* success rate: Wilson score interval, which stays inside [0, 1] and keeps its coverage for small samples and rates
  near 0 or 1, where the normal (Wald) interval fails;
* mean return: Student-t interval, mean +- t(confidence, n - 1) * s / sqrt(n) with the sample standard deviation
  ``s`` (None for a single episode).

Success is ``info["success"]`` of an episode's last step when the env sets it (a reward model with a
``success_threshold``), else ``return > success_return_threshold``.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv, VectorEnv
from tqdm.auto import tqdm

from .agents import PolicyAgent
from .errors import CheckpointError, InputError
from .media import write_video

__all__ = [
    "DEMO_IMAGE",
    "DEMO_TASK",
    "EpisodeResult",
    "EvalReport",
    "RandomPolicy",
    "Summary",
    "cached_tiny_checkpoint",
    "evaluate_checkpoint",
    "evaluate_policy",
    "load_policy",
    "mean_interval",
    "run_demo",
    "student_t_quantile",
    "wilson_interval",
]

REPORT_FORMAT = "cosmos3_gym.eval_report/1"
# The demo's initial state ships inside the package (a copy of examples/assets/tabletop.png) so that the demo also
# runs from an installed wheel.
DEMO_IMAGE = Path(__file__).parent / "assets" / "tabletop.png"
DEMO_TASK = "push the T-shaped block onto the target"


# ---------------------------------------------------------------------------------------------------------------
# Confidence intervals
# ---------------------------------------------------------------------------------------------------------------


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` for a success rate of ``successes`` out of ``trials``."""
    if trials < 1 or not 0 <= successes <= trials:
        raise InputError(f"successes/trials: expected 0 <= successes <= trials and trials >= 1, got "
                         f"{successes}/{trials}.")
    z = statistics.NormalDist().inv_cdf(0.5 + _check_confidence(confidence) / 2)
    rate = successes / trials
    denominator = 1 + z * z / trials
    center = (rate + z * z / (2 * trials)) / denominator
    half_width = z / denominator * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials))
    # At 0 and `trials` successes the bound is exactly 0 (1); the formula gives it up to rounding.
    low = 0.0 if successes == 0 else center - half_width
    high = 1.0 if successes == trials else center + half_width
    return low, high


def student_t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile (0.5 < probability < 1) of Student's t with ``df`` degrees of freedom.

    Bisection on the exact CDF for integer ``df`` (Abramowitz & Stegun 26.7.3 / 26.7.4), so no SciPy is needed.
    """
    if not 0.5 < probability < 1 or isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise InputError(f"probability/df: expected 0.5 < probability < 1 and an integer df >= 1, got "
                         f"{probability!r}, {df!r}.")
    target = 2 * probability - 1  # P(|T| <= t)
    high = 1.0
    while _t_central_probability(high, df) < target:
        high *= 2
    low = 0.0
    for _ in range(200):
        middle = (low + high) / 2
        if _t_central_probability(middle, df) < target:
            low = middle
        else:
            high = middle
        if high - low <= 1e-12 * high:
            break
    return (low + high) / 2


def _t_central_probability(t: float, df: int) -> float:
    """``P(|T| <= t)`` for Student's t with integer ``df`` (A&S 26.7.3 for odd df, 26.7.4 for even df)."""
    theta = math.atan(t / math.sqrt(df))
    cos2 = math.cos(theta) ** 2
    term = total = 1.0
    if df % 2:
        for k in range(1, (df - 1) // 2):  # 1 + 2/3 cos^2 + (2*4)/(3*5) cos^4 + ... up to cos^(df-3)
            term *= cos2 * (2 * k) / (2 * k + 1)
            total += term
        series = math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0
        return 2 / math.pi * (theta + series)
    for k in range(1, df // 2):  # 1 + 1/2 cos^2 + (1*3)/(2*4) cos^4 + ... up to cos^(df-2)
        term *= cos2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """Student-t confidence interval ``(low, high)`` for the mean of ``values``; None for fewer than 2 values."""
    confidence = _check_confidence(confidence)
    if len(values) < 2:
        return None
    mean = statistics.fmean(values)
    half_width = student_t_quantile(0.5 + confidence / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(
        len(values)
    )
    return mean - half_width, mean + half_width


def _check_confidence(confidence: Any) -> float:
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0 < confidence < 1:
        raise InputError(f"confidence: expected a number strictly between 0 and 1, got {confidence!r}.")
    return float(confidence)


# ---------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class EpisodeResult:
    """One evaluated episode. ``episode`` is its identity ``k * num_envs + slot`` (see the module docstring)."""

    episode: int
    slot: int
    task: str
    episode_return: float
    length: int  # env steps (chunks)
    success: bool
    terminated: bool
    truncated: bool
    initial_state_index: int | None
    video: str | None  # file name inside the video folder, None when not recorded


@dataclass
class Summary:
    """Statistics over a group of episodes (all of them, or one task's)."""

    episodes: int
    successes: int
    success_rate: float
    success_rate_interval: tuple[float, float]  # Wilson
    mean_return: float
    return_std: float | None  # sample standard deviation; None for one episode
    mean_return_interval: tuple[float, float] | None  # Student t; None for one episode
    mean_length: float

    @classmethod
    def of(cls, results: Sequence[EpisodeResult], confidence: float) -> "Summary":
        returns = [result.episode_return for result in results]
        successes = sum(result.success for result in results)
        return cls(
            episodes=len(results),
            successes=successes,
            success_rate=successes / len(results),
            success_rate_interval=wilson_interval(successes, len(results), confidence),
            mean_return=statistics.fmean(returns),
            return_std=statistics.stdev(returns) if len(returns) > 1 else None,
            mean_return_interval=mean_interval(returns, confidence),
            mean_length=statistics.fmean(result.length for result in results),
        )


@dataclass
class EvalReport:
    """What ``evaluate_policy`` measured: every episode, the totals and the per-task statistics.

    ``settings`` records how the run was made (episodes, num_envs, seed, policy, confidence, interval methods,
    wall time); callers may add entries (the CLI adds the checkpoint and env settings).
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
            "episodes": [asdict(result) for result in self.episodes],
        }

    def to_json(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=_json_default) + "\n")
        return path

    def table(self) -> str:
        """A short plain-text table: episodes, success rate and mean return per task and overall, with intervals."""
        level = f"{round(100 * self.settings.get('confidence', 0.95))}% CI"
        rows = [("task", "episodes", f"success rate [{level}]", f"mean return [{level}]")]
        for name, summary in [*self.per_task.items(), ("(all)", self.overall)]:
            low, high = summary.success_rate_interval
            ret = f"{summary.mean_return:.4g}"
            if summary.mean_return_interval is not None:
                ret += " [{:.4g}, {:.4g}]".format(*summary.mean_return_interval)
            rows.append((_shorten(name or '""', 40), str(summary.episodes),
                         f"{summary.success_rate:.2f} [{low:.2f}, {high:.2f}]", ret))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        return "\n".join(
            "  ".join(cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in
                      enumerate(zip(row, widths))).rstrip()
            for row in rows
        )


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


# ---------------------------------------------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------------------------------------------


class RandomPolicy:
    """Uniformly random actions from (a seeded copy of) an action space; batched for a vector env's space."""

    name = "random"

    def __init__(self, action_space: gym.Space, seed: int | None = 0):
        self.action_space = copy.deepcopy(action_space)
        self.action_space.seed(seed)

    def __call__(self, observation: Any) -> Any:
        return self.action_space.sample()


def load_policy(spec: str, env: gym.Env | VectorEnv, *, seed: int | None = 0) -> Any:
    """A policy for ``env`` from a spec string.

    * ``"random"``: ``RandomPolicy`` over the env's action space (batched for a vector env), seeded with ``seed``;
    * ``"agent"``: the checkpoint's own policy, a ``PolicyAgent`` on the env's engine with the env's settings
      (domain, chunk, sampling steps, guidance, resolution tier, fps), seeded with ``seed``;
    * ``"module:factory"`` or ``"path/to/file.py:factory"``: imports ``factory`` and returns ``factory(env)``, which
      must be a callable ``obs -> action`` or an object with Stable-Baselines3's ``predict`` (e.g.
      ``PPO.load(...)``). Dotted names (``"module:Class.build"``) are followed.
    """
    if not isinstance(spec, str) or not spec:
        raise InputError(f"policy: expected 'random', 'agent' or 'module:factory', got {spec!r}.")
    if spec == "random":
        return RandomPolicy(env.action_space, seed)
    if spec == "agent":
        return PolicyAgent(**_agent_settings(env), seed=seed)
    module_name, colon, attribute = spec.rpartition(":")
    if not colon or not module_name or not attribute:
        raise InputError(
            f"policy: expected 'random', 'agent', 'module:factory' or 'path/to/file.py:factory', got {spec!r}."
        )
    factory = _import_attribute(module_name, attribute, spec)
    if not callable(factory):
        raise InputError(f"policy: {spec!r} is a {type(factory).__name__}, not a callable factory(env) -> policy.")
    policy = factory(env)
    if not (callable(policy) or callable(getattr(policy, "predict", None))):
        raise InputError(
            f"policy: the factory {spec!r} returned a {type(policy).__name__}; expected a callable obs -> action or "
            "an object with a Stable-Baselines3 predict() method."
        )
    return policy


def _import_attribute(module_name: str, attribute: str, spec: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise InputError(f"policy: file not found: {path} (in {spec!r}).")
        module_spec = importlib.util.spec_from_file_location(f"cosmos3_gym_policy_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise InputError(f"policy: cannot import module {module_name!r} from {spec!r}: {error}.") from error
    value = module
    for name in attribute.split("."):
        if not hasattr(value, name):
            raise InputError(f"policy: {module_name!r} has no attribute {attribute!r} (from {spec!r}).")
        value = getattr(value, name)
    return value


def _agent_settings(env: Any) -> dict[str, Any]:
    """The ``PolicyAgent`` arguments that match a world-model env's own settings (``env.settings``)."""
    base = getattr(env, "unwrapped", env)
    settings = getattr(base, "settings", None)
    if settings is None:
        raise InputError(
            f"policy: 'agent' needs a cosmos3_gym world-model env (WorldModelEnv / WorldModelVectorEnv), got "
            f"{type(env).__name__}."
        )
    return dict(engine=base.engine, settings=settings)


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
    elif callable(getattr(policy, "predict", None)):  # Stable-Baselines3 model or policy (recurrent state kept)
        state = None

        def act_one(observation, tasks, starts):
            nonlocal state
            action, state = policy.predict(observation, state=state, episode_start=starts if batched else starts[:1],
                                           deterministic=deterministic)
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


class _EpisodeBook:
    """Which episode runs in each slot, and the results of the finished ones that count."""

    def __init__(self, num_envs: int, episodes: int, success_return_threshold: float, max_videos: int,
                 video_dir: Path | None, fps: float, bar):
        self.num_envs, self.episodes, self.success_return_threshold = num_envs, episodes, success_return_threshold
        self.max_videos, self.video_dir, self.fps, self.bar = max_videos, video_dir, fps, bar
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
        self.running[slot] = _RunningEpisode(episode, str(_slot_value(info, "task", slot, "")),
                                             None if index is None else int(index), clips)

    def finish(self, slot: int, step_info: dict, terminated: bool, truncated: bool) -> None:
        current = self.running[slot]
        if current.episode >= self.episodes:  # beyond this slot's quota: not part of the evaluation
            return
        success = step_info.get("success")
        success = bool(success) if success is not None else current.episode_return > self.success_return_threshold
        video = None
        if current.clips:
            video = f"episode_{current.episode:04d}.mp4"
            write_video(self.video_dir / video, _concatenate_clips(current.clips), fps=self.fps)
        self.finished.append(EpisodeResult(
            current.episode, slot, current.task, current.episode_return, current.length, success, terminated,
            truncated, current.initial_state_index, video,
        ))
        self.bar.update(1)


def evaluate_policy(
    env: gym.Env | VectorEnv,
    policy: Any,
    episodes: int,
    *,
    seed: int | None = 0,
    video_dir: str | os.PathLike | None = None,
    max_videos: int = 8,
    success_return_threshold: float = 0.0,
    confidence: float = 0.95,
    deterministic: bool = True,
    progress: bool = True,
) -> EvalReport:
    """Run ``episodes`` episodes of ``policy`` in ``env`` and report success and return per task.

    ``env``: a Gymnasium env or vector env (any autoreset mode), e.g. ``WorldModelVectorEnv``; it is reset once with
    ``seed`` (slot ``i`` gets ``seed + i``) and not closed. Episodes must end (give the env ``max_episode_steps``).
    ``policy``: a callable ``obs -> action`` (batched ``obs -> actions`` for a vector env), a Stable-Baselines3
    model (``predict``, with ``deterministic``), or a ``PolicyAgent`` (prompted with each slot's task).
    ``video_dir``: write ``episode_NNNN.mp4`` for the episodes ``0 .. max_videos - 1``; frames come from
    ``info["frames"]`` (make the env with ``return_frames=True``) or else from ``render()`` (``render_mode=
    "rgb_array"``: one frame per step; under SAME_STEP autoreset an episode's last frame is then missing).
    See the module docstring for which episodes count, success and the intervals.
    """
    if isinstance(episodes, bool) or not isinstance(episodes, (int, np.integer)) or episodes < 1:
        raise InputError(f"episodes: expected an integer >= 1, got {episodes!r}.")
    if isinstance(max_videos, bool) or not isinstance(max_videos, (int, np.integer)) or max_videos < 0:
        raise InputError(f"max_videos: expected an integer >= 0, got {max_videos!r}.")
    confidence = _check_confidence(confidence)
    episodes = int(episodes)
    if video_dir is not None:
        video_dir = Path(video_dir)
        video_dir.mkdir(parents=True, exist_ok=True)

    batched = isinstance(env, VectorEnv)
    # A single env runs as a one-slot vector env (Gymnasium's own wrapper), so one loop serves both. DISABLED: the loop
    # resets it after the step that ended the episode (no policy call is spent on a reset step).
    vector_env = env if batched else SyncVectorEnv([lambda: env], autoreset_mode=AutoresetMode.DISABLED)
    autoreset = AutoresetMode(vector_env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
    act = _act_function(policy, batched, deterministic)
    num_envs = vector_env.num_envs
    fps = float(vector_env.metadata.get("render_fps") or 15.0)

    wall_start = time.perf_counter()
    vector_steps = 0
    with tqdm(total=episodes, unit="episode", desc="evaluating", disable=not progress) as bar:
        book = _EpisodeBook(num_envs, episodes, success_return_threshold,
                            int(max_videos) if video_dir is not None else 0, video_dir, fps, bar)
        observations, info = vector_env.reset(seed=seed)
        for slot in range(num_envs):
            book.start(slot, info, observations)
        episode_starts = np.ones(num_envs, dtype=np.bool_)
        reset_now = np.zeros(num_envs, dtype=np.bool_)  # NEXT_STEP autoreset: the slots the coming step resets
        actions = None
        while len(book.finished) < episodes:
            if not reset_now.all():  # when every slot resets, the env ignores the actions: keep the last ones
                actions = act(observations, [episode.task for episode in book.running], episode_starts)
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
                current = book.running[slot]
                current.episode_return += float(rewards[slot])
                current.length += 1
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
                for slot in np.flatnonzero(done):
                    book.start(slot, info, observations)
                    episode_starts[slot] = True

    finished = sorted(book.finished, key=lambda result: result.episode)
    tasks = sorted({result.task for result in finished})
    settings = {
        "episodes": episodes,
        "num_envs": num_envs,
        "seed": seed,
        "policy": _policy_name(policy),
        "autoreset_mode": autoreset.value,
        "success": "info['success'] of the last step when the env sets it, else return > success_return_threshold",
        "success_return_threshold": success_return_threshold,
        "confidence": confidence,
        "success_rate_interval": "wilson",
        "mean_return_interval": "student_t",
        "video_dir": None if video_dir is None else str(video_dir),
        "env_steps": vector_steps,
        "wall_s": time.perf_counter() - wall_start,
    }
    return EvalReport(
        episodes=finished,
        overall=Summary.of(finished, confidence),
        per_task={task: Summary.of([r for r in finished if r.task == task], confidence) for task in tasks},
        settings=settings,
    )


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
    entries = {key: _slot_value(info, key, slot, absent) for key in info
               if not key.startswith("_") and key not in ("final_obs", "final_info")}
    return {key: value for key, value in entries.items() if value is not absent}


def _render(vector_env: VectorEnv) -> Sequence[np.ndarray]:
    frames = vector_env.render() if getattr(vector_env, "render_mode", None) == "rgb_array" else None
    if frames is None:
        raise InputError(
            "video_dir: the env gives no frames to record; create it with return_frames=True (frames in "
            "info['frames']) or render_mode='rgb_array', or pass video_dir=None."
        )
    return frames


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


# ---------------------------------------------------------------------------------------------------------------
# Evaluating a checkpoint (the CLI's `eval` and `demo`)
# ---------------------------------------------------------------------------------------------------------------


def checkpoint_env_defaults(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """Env settings a trained checkpoint records in ``meta.json`` (domain, raw_action_dim, chunk, resolution_tier,
    fps); empty for checkpoints without one (hub ids, converted releases)."""
    path = Path(checkpoint).expanduser() / "meta.json"
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint: cannot read {path}: {error}") from error
    return {key: meta[key] for key in ("domain", "raw_action_dim", "chunk", "resolution_tier", "fps") if key in meta}


def evaluate_checkpoint(
    checkpoint: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    policy: str = "agent",
    episodes: int = 10,
    num_envs: int = 1,
    initial_states: Any,
    task: str | None = None,
    reward_model: Any = None,
    success_threshold: float | None = None,
    success_return_threshold: float = 0.0,
    max_episode_steps: int = 10,
    domain: str | int | None = None,
    raw_action_dim: int | None = None,
    chunk: int | None = None,
    num_steps: int = 4,
    guidance_scale: float = 3.0,
    resolution_tier: int | None = None,
    fps: float | None = None,
    device: str | None = None,
    dtype: str | None = None,
    seed: int = 0,
    max_videos: int = 8,
    progress: bool = True,
    extra_settings: dict[str, Any] | None = None,
) -> EvalReport:
    """Load ``checkpoint`` into a ``WorldModelVectorEnv`` of ``num_envs`` slots, evaluate ``policy`` (a
    ``load_policy`` spec) for ``episodes`` episodes and write ``out_dir/report.json`` and the episode videos.

    Settings left at None come from the checkpoint's ``meta.json`` when it has one, else: domain "droid_lerobot",
    chunk 32, resolution tier 480, 15 fps. ``extra_settings`` are added to the report's settings.
    """
    from .envs import WorldModelVectorEnv

    recorded = checkpoint_env_defaults(checkpoint)
    settings = dict(
        domain=domain if domain is not None else recorded.get("domain", "droid_lerobot"),
        raw_action_dim=raw_action_dim if raw_action_dim is not None else recorded.get("raw_action_dim"),
        chunk=chunk if chunk is not None else recorded.get("chunk", 32),
        resolution_tier=resolution_tier if resolution_tier is not None else recorded.get("resolution_tier", 480),
        fps=fps if fps is not None else recorded.get("fps", 15.0),
        num_steps=num_steps, guidance_scale=guidance_scale, task=task, reward_model=reward_model,
        success_threshold=success_threshold, max_episode_steps=max_episode_steps,
    )
    out_dir = Path(out_dir)
    env = WorldModelVectorEnv(
        num_envs, checkpoint, initial_states=initial_states, return_frames=max_videos > 0, device=device,
        dtype=dtype, **settings,
    )
    try:
        agent = load_policy(policy, env, seed=seed)
        report = evaluate_policy(
            env, agent, episodes, seed=seed, video_dir=out_dir if max_videos > 0 else None, max_videos=max_videos,
            success_return_threshold=success_return_threshold, progress=progress,
        )
    finally:
        env.close()
    report.settings.update(
        policy=policy, checkpoint=str(checkpoint),
        initial_states=str(initial_states) if isinstance(initial_states, (str, os.PathLike)) else "<in memory>",
        env={key: (value if isinstance(value, (str, int, float, type(None))) else str(value))
             for key, value in settings.items()},
        **(extra_settings or {}),
    )
    report.to_json(out_dir / "report.json")
    return report


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
    episode. Without ``checkpoint``: the built-in PushT world model (its start frames, reward model and settings),
    plus ``out_dir/side_by_side.mp4`` (the real simulator next to the world model where gym-pusht is installed);
    if the built-in model is not installed, ``cached_tiny_checkpoint()`` (random weights) on the tabletop image."""
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
    recorded = checkpoint_env_defaults(checkpoint)
    return evaluate_checkpoint(
        checkpoint, out_dir, policy=policy, episodes=episodes, num_envs=min(episodes, 8), initial_states=DEMO_IMAGE,
        task=DEMO_TASK, max_episode_steps=steps_per_episode, domain=recorded.get("domain", "pusht"),
        chunk=chunk if chunk is not None else recorded.get("chunk", 8), num_steps=num_steps, resolution_tier=256,
        device=device, dtype=dtype, seed=seed, max_videos=episodes, progress=progress,
        extra_settings={"random_weights": random_weights},
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
                                 progress=progress)
        video = side_by_side(out_dir / "side_by_side.mp4", seed=seed, num_chunks=steps_per_episode,
                             engine=env.engine, num_steps=num_steps)
    finally:
        env.close()
    report.settings.update(policy=policy, checkpoint=str(builtin_checkpoint_dir()), random_weights=False,
                           side_by_side=video)
    report.to_json(out_dir / "report.json")
    return report
