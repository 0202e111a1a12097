"""Is the PushT world model a faithful simulator? Metrics and the policy comparison against gym-pusht.

* Frame metrics: ``ssim`` (grayscale, Gaussian window) next to ``pusht.psnr``.
* Agreement of policy rankings: ``pearson``, ``spearman`` (average ranks for ties) and ``mmrv`` (SIMPLER's mean
  maximum rank violation, Li et al. 2024): for policies ``i, j`` the violation is ``|real_i - real_j|`` when the
  world model orders them opposite to the real simulator, and MMRV is the mean over ``i`` of the largest violation
  of ``i``. All in numpy (no SciPy).
* ``compare_policies``: each policy from the same simulator start states, in gym-pusht and in the world model.
* ``evaluate_in_simulator`` (``cosmos3-gym eval-real --real-only``): policies in gym-pusht alone, success rate
  (Wilson interval) and mean final coverage (Student-t interval clipped to [0, 1]) over many seeded episodes.

Policy specs come from the one registry, ``cosmos3_gym.policy_specs`` (comma-separated): ``random``,
``scripted:NOISE`` (the scripted pusher with NOISE px of target noise), ``scripted-frames:NOISE`` (the same pusher
reading the agent and the block off the frames), ``scripted-physics:NOISE`` (that, planning each chunk in gym-pusht's
physics from the read-off state), ``agent`` (the checkpoint's own policy mode),
``file:PATH`` (any policy file this package saves: the BC / GRPO pixel policies of ``cosmos3_gym.rl`` and SB3
policies; the file's metadata says which) and ``sb3:PATH`` / ``ppo:PATH`` (a ``save_sb3_policy`` file). File
policies act deterministically (their mean action).

How a policy runs in the world model. Policies that see images (``agent``, the frame-reading pushers and the policy
files) run closed loop in both worlds: in the simulator on its frames, in the world model on the model's own frames.
The simulator's reference policies (``scripted:NOISE``, which reads the true block pose, and ``random``) cannot observe
the world model's state, so the world model replays, open loop, the action chunks they produced in the simulator
from the same start: it predicts what those actions do. The world model's score of an episode is the reward
model's estimate of coverage on its frames; in the simulator it is gym-pusht's true coverage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from ...errors import InputError
from ...policy_specs import PolicySpec, load_frame_agent, parse_policy_specs
from ...statistics import check_confidence, mean_interval, wilson_interval
from . import episodes as pusht
from .sim import drawn

__all__ = [
    "PolicyRun",
    "compare_policies",
    "compare_with_simulator",
    "evaluate_in_simulator",
    "format_comparison",
    "format_real_only",
    "mmrv",
    "parse_policy_specs",
    "pearson",
    "ranking_agreement",
    "spearman",
    "ssim",
]


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------

SSIM_WINDOW = 11  # the Gaussian window of Wang et al. (2004): 11 x 11, sigma 1.5
SSIM_SIGMA = 1.5
SSIM_C1, SSIM_C2 = (0.01**2, 0.03**2)  # (K1 L)^2, (K2 L)^2 for the data range L = 1


def _grayscale(frames: np.ndarray) -> torch.Tensor:
    """uint8 ``[..., H, W, 3]`` -> float64 ``[N, 1, H, W]`` luma in [0, 1] (ITU-R BT.601 weights)."""
    frames = np.asarray(frames)
    if frames.ndim < 3 or frames.shape[-1] != 3:
        raise InputError(f"frames: expected [..., H, W, 3], got {list(frames.shape)}")
    # float64: the variances are differences of close numbers (E[x^2] - E[x]^2), lossy in float32.
    values = torch.from_numpy(frames.reshape(-1, *frames.shape[-3:]).astype(np.float64))
    if frames.dtype == np.uint8:
        values = values / 255.0
    luma = values @ torch.tensor([0.299, 0.587, 0.114], dtype=torch.float64)
    return luma[:, None]


def ssim(reference: np.ndarray, estimate: np.ndarray) -> float:
    """Mean SSIM of two stacks of RGB frames ``[..., H, W, 3]`` (uint8, or float in [0, 1]) on their grayscale,
    with an 11 x 11 Gaussian window (sigma 1.5) over the valid region; 1.0 for identical frames."""
    if np.shape(reference) != np.shape(estimate):
        raise InputError(f"frames: shapes differ, {list(np.shape(reference))} vs {list(np.shape(estimate))}")
    x, y = _grayscale(reference), _grayscale(estimate)
    if min(x.shape[-2:]) < SSIM_WINDOW:
        raise InputError(f"frames: SSIM needs frames of at least {SSIM_WINDOW} x {SSIM_WINDOW} pixels")
    offsets = torch.arange(SSIM_WINDOW, dtype=torch.float64) - (SSIM_WINDOW - 1) / 2
    profile = torch.exp(-(offsets**2) / (2 * SSIM_SIGMA**2))
    window = torch.outer(profile, profile)
    window = (window / window.sum())[None, None]

    def blur(image: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(image, window)

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    index = ((2 * mu_x * mu_y + SSIM_C1) * (2 * cov + SSIM_C2)) / (
        (mu_x**2 + mu_y**2 + SSIM_C1) * (var_x + var_y + SSIM_C2)
    )
    return float(index.mean())


def pearson(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Pearson correlation; NaN when either side is constant (no correlation is defined)."""
    a, b = _pair(x, y)
    dx, dy = a - a.mean(), b - b.mean()
    denominator = math.sqrt(float((dx * dx).sum() * (dy * dy).sum()))
    return float((dx * dy).sum() / denominator) if denominator > 0 else math.nan


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing their average rank."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    for value in np.unique(values):
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Spearman rank correlation: Pearson of the (tie-averaged) ranks."""
    a, b = _pair(x, y)
    return pearson(_ranks(a), _ranks(b))


def mmrv(predicted: Sequence[float] | np.ndarray, real: Sequence[float] | np.ndarray) -> float:
    """SIMPLER's mean maximum rank violation of the ``predicted`` scores against the ``real`` ones (0 is perfect)."""
    guess, truth = _pair(predicted, real)
    opposite = (guess[:, None] < guess[None, :]) != (truth[:, None] < truth[None, :])
    violation = opposite * np.abs(truth[:, None] - truth[None, :])
    return float(violation.max(axis=1).mean())


def _pair(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape or len(a) < 2:
        raise InputError(
            f"scores: expected two 1-D sequences of the same length >= 2, got {list(a.shape)} and {list(b.shape)}"
        )
    return a, b


# ---------------------------------------------------------------------------------------------------------------
# Policies in both worlds
# ---------------------------------------------------------------------------------------------------------------


PolicyRun = PolicySpec  # the name before the spec registry moved to cosmos3_gym.policy_specs


def simulate_policy(
    run: PolicySpec,
    sim_seeds: Sequence[int],
    num_chunks: int,
    chunk: int,
    image_size,
    stats,
    agent: Any,
    seed: int,
    progress: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``run`` in one gym-pusht simulator per start: start frames ``[N, H, W, 3]``, the normalised action chunks it
    took ``[N, num_chunks, chunk, 2]`` and the true coverage after every step ``[N, num_chunks * chunk + 1]``.
    ``agent``: for the policies that act on frames (``run.acts_on_frames``), ``act(frames [N, H, W, 3]) -> [N,
    chunk, 2]``, called once per chunk on the current frames. ``progress``: a tqdm bar advanced by the env steps
    taken."""
    sims = [pusht.PushTSim(image_size) for _ in sim_seeds]
    if callable(getattr(agent, "start_episodes", None)):
        agent.start_episodes()  # a stateful frame agent (scripted-frames) starts new episodes
    try:
        frames = np.stack([drawn(sim.reset(s)) for sim, s in zip(sims, sim_seeds)])
        starts = frames.copy()
        coverage = [[sim.coverage] for sim in sims]
        rng = np.random.default_rng(seed)
        pushers = [pusht.ScriptedPusher(np.random.default_rng([seed, s]), noise=run.noise) for s in sim_seeds]
        taken = np.zeros((len(sims), num_chunks, chunk, 2), np.float32)
        for k in range(num_chunks):
            if run.acts_on_frames:
                taken[:, k] = np.clip(agent.act(frames), -1.0, 1.0)
            elif run.kind == "random":
                taken[:, k] = rng.uniform(-1.0, 1.0, size=taken[:, k].shape)
            for i, sim in enumerate(sims):
                for t in range(chunk):
                    if run.kind == "scripted":  # reads the true state every step
                        raw = pushers[i](sim.agent_xy, sim.block_pose)
                        taken[i, k, t] = np.clip(stats.normalize(raw), -1.0, 1.0)
                    else:
                        raw = stats.denormalize(taken[i, k, t])
                    frames[i] = sim.step(np.clip(raw, 0.0, pusht.TABLE_SIZE))
                    coverage[i].append(sim.coverage)
            if progress is not None:
                progress.update(len(sims) * chunk)
    finally:
        for sim in sims:
            sim.close()
    return starts, taken, np.asarray(coverage)


def replay_actions(vector_env: Any, start_frames: np.ndarray, action_chunks: np.ndarray, seed: int = 0) -> np.ndarray:
    """Open-loop rollouts in a world-model vector env (one slot per start, ``return_frames=True``): from
    ``start_frames [N, H, W, 3]`` it steps through ``action_chunks [N, K, chunk, 2]`` (normalised), continuing from
    its own frames, and returns the generated frames ``[N, K, chunk, H, W, 3]``."""
    vector_env.reset(seed=seed, options={"frames": list(start_frames)})
    chunks = [np.asarray(vector_env.step(action_chunks[:, k])[-1]["frames"]) for k in range(action_chunks.shape[1])]
    return np.stack(chunks, axis=1)


def compare_policies(
    policies: str | Sequence[str],
    sim_seeds: Sequence[int],
    *,
    vector_env: Any,
    score_frames: Callable[[np.ndarray], np.ndarray],
    stats: Any,
    num_chunks: int,
    make_agent: Callable[[], Any] | None = None,
    seed: int = 0,
    confidence: float = 0.95,
    extra_scores: Mapping[str, Callable[[np.ndarray], np.ndarray]] | None = None,
    success_threshold: float = pusht.SUCCESS_COVERAGE,
) -> dict[str, Any]:
    """Each policy of ``policies`` from the simulator starts ``sim_seeds``, in gym-pusht and in the world model.

    ``vector_env``: a world-model vector env (``reset(options={"frames": [...]})``, ``step(actions)``) with one slot
    per (policy, start), in policy-major order, that returns every frame (``info["frames"]``, ``return_frames=True``):
    each chunk's last frame is the coverage, and success is scored on every frame, as gym-pusht's success at any step
    (scored at chunk ends only, the model's success was under-counted: in gym-pusht two in five of the successes of
    run 1300000's checkpoints are undone by the chunk's end, ``success_visibility_pusht.py``). An env without frames
    gives the observations: last frames only;
    ``score_frames``: frames ``[M, H, W, 3]`` uint8 -> predicted coverage ``[M]`` (the reward model);
    ``extra_scores``: more such scorers by name (e.g. a geometric coverage measured on the frames), each scored on the
    same world-model frames and reported next to the first (``world_model_by_score``, ``agreement_by_score``);
    ``stats``: the checkpoint's ``ActionStats``; ``make_agent()``: the ``PolicyAgent`` for ``"agent"``. Policy files
    (``file:PATH``, ``sb3:PATH``) are loaded by ``policy_specs.load_frame_agent`` (deterministic, on the CPU).

    Returns per policy the real and predicted final coverage (mean, Student-t CI) and success (rate, Wilson CI),
    then Pearson / Spearman / MMRV / mean absolute error between the per-policy mean predicted and real final
    coverage. Success: coverage > 0.95 at any step (real) or on any generated frame (predicted), where the
    ``score_frames`` scorer's line is ``success_threshold`` (a reward model's own, ``rewards.fit_success_threshold``:
    regressors score true successes below 0.95) and the ``extra_scores``' is 0.95. Coverage intervals are clipped
    to [0, 1].
    """
    runs = parse_policy_specs(policies)
    sim_seeds = [int(s) for s in sim_seeds]
    slots = len(runs) * len(sim_seeds)
    if vector_env.num_envs != slots:
        raise InputError(f"vector_env: expected {slots} slots (policies x starts), got {vector_env.num_envs}")
    chunk = vector_env.single_action_space.shape[0]
    image_size = tuple(vector_env.single_observation_space["image"].shape[:2])
    agents: list[Any] = [
        _frame_policy_agent(run, make_agent, chunk, stats, seed) if run.acts_on_frames else None for run in runs
    ]

    simulated = [
        simulate_policy(run, sim_seeds, num_chunks, chunk, image_size, stats, agent, seed)
        for run, agent in zip(runs, agents)
    ]
    starts = np.concatenate([frames for frames, _, _ in simulated])
    replayed = np.concatenate([actions for _, actions, _ in simulated])

    scorers: dict[str | None, Callable[[np.ndarray], np.ndarray]] = {None: score_frames}  # None: the first scorer's
    scorers.update(extra_scores or {})  # key (no name clash)
    vector_env.reset(seed=seed, options={"frames": list(starts)})
    for agent in agents:
        if callable(getattr(agent, "start_episodes", None)):
            agent.start_episodes()  # the world model's episodes start afresh, as the simulator's did
    frames = starts
    history = {name: [scorer(starts)] for name, scorer in scorers.items()}  # each chunk's last frame
    peaks = {name: list(scores) for name, scores in history.items()}  # each chunk's best frame: success
    for k in range(num_chunks):
        actions = replayed[:, k].copy()
        for index, agent in enumerate(agents):
            if agent is not None:  # closed loop: it acts on the world model's own frames of its slots
                rows = slice(index * len(sim_seeds), (index + 1) * len(sim_seeds))
                actions[rows] = np.clip(agent.act(frames[rows]), -1.0, 1.0)
        observations, *_, info = vector_env.step(actions)
        clip = np.asarray(info["frames"]) if "frames" in info else np.asarray(observations["image"])[:, None]
        frames = clip[:, -1]
        for name, scorer in scorers.items():
            scores = np.asarray(scorer(clip.reshape(-1, *clip.shape[2:]))).reshape(clip.shape[:2])
            history[name].append(scores[:, -1])
            peaks[name].append(scores.max(axis=1))

    def by_policy(scores: dict) -> dict:
        return {
            name: np.stack(chunks, axis=1).reshape(len(runs), len(sim_seeds), num_chunks + 1)
            for name, chunks in scores.items()
        }

    predicted, predicted_peaks = by_policy(history), by_policy(peaks)

    per_policy: dict[str, dict[str, Any]] = {}
    for index, (run, (_, _, coverage)) in enumerate(zip(runs, simulated)):
        per_policy[run.spec] = {
            "world_model": _scores(predicted[None][index], confidence, success_threshold, predicted_peaks[None][index]),
            "simulator": _scores(coverage, confidence),
            "evaluated_in_world_model": "closed loop"
            if run.acts_on_frames
            else "open loop: the simulator's action chunks replayed",
        }
        if extra_scores:
            per_policy[run.spec]["world_model_by_score"] = {
                name: _scores(predicted[name][index], confidence, peaks=predicted_peaks[name][index])
                for name in extra_scores
            }
    real = np.array([entry["simulator"]["final_coverage"] for entry in per_policy.values()])
    guess = np.array([entry["world_model"]["final_coverage"] for entry in per_policy.values()])
    result: dict[str, Any] = {
        "policies": per_policy,
        "num_starts": len(sim_seeds),
        "num_chunks": num_chunks,
        "chunk": chunk,
        "sim_seeds": sim_seeds,
        "agreement": {
            "score": "final coverage: the reward model's estimate on world-model frames vs gym-pusht's true value",
            **ranking_agreement(guess, real),
        },
    }
    if extra_scores:
        result["agreement_by_score"] = {
            name: ranking_agreement(
                np.array([entry["world_model_by_score"][name]["final_coverage"] for entry in per_policy.values()]), real
            )
            for name in extra_scores
        }
    return result


def ranking_agreement(guess: np.ndarray, real: np.ndarray) -> dict[str, float]:
    """Pearson / Spearman / MMRV / mean absolute error of per-policy predicted against real scores."""
    several = len(real) > 1
    return {
        "pearson": pearson(guess, real) if several else math.nan,
        "spearman": spearman(guess, real) if several else math.nan,
        "mmrv": mmrv(guess, real) if several else math.nan,
        "mean_absolute_error": float(np.abs(guess - real).mean()),
    }


def _frame_policy_agent(
    run: PolicySpec, make_agent: Callable[[], Any] | None, chunk: int, stats: Any, seed: int = 0
) -> Any:
    """The agent of a policy that acts on frames (``make_agent()`` for "agent", the frame-reading pusher, else its
    file), which must act in chunks of the world model's length."""
    agent = load_frame_agent(run, make_agent=make_agent, action_stats=stats, chunk=chunk, seed=seed)
    shape = getattr(agent, "action_shape", None)
    if run.kind != "agent" and shape is not None and tuple(shape) != (chunk, 2):
        raise InputError(
            f"policies: {run.spec!r} acts in chunks of shape {list(shape)}; the world model takes [{chunk}, 2]"
        )
    return agent


def _scores(
    coverage: np.ndarray,
    confidence: float,
    success_threshold: float = pusht.SUCCESS_COVERAGE,
    peaks: np.ndarray | None = None,
) -> dict[str, Any]:
    """Coverage ``[starts, T]`` -> final coverage (mean, CI in [0, 1]) and success (rate, Wilson CI): the coverage
    passes ``success_threshold`` at any step, or where ``peaks`` (``[starts, T]``, the best of every frame up to each
    step) is given, the peaks do."""
    final = coverage[:, -1].astype(float)
    successes = int(((coverage if peaks is None else peaks) > success_threshold).any(axis=1).sum())
    return {
        "final_coverage": float(final.mean()),
        "final_coverage_interval": mean_interval(list(final), confidence, bounds=(0.0, 1.0)),
        "success_rate": successes / len(final),
        "success_rate_interval": wilson_interval(successes, len(final), confidence),
    }


def format_comparison(result: dict[str, Any]) -> str:
    """A plain-text table of ``compare_policies``'s result."""
    rows = [("policy", "sim coverage", "WM coverage", "sim success", "WM success")]
    for spec, entry in result["policies"].items():
        sim, model = entry["simulator"], entry["world_model"]
        rows.append(
            (
                spec,
                f"{sim['final_coverage']:.3f}",
                f"{model['final_coverage']:.3f}",
                f"{sim['success_rate']:.2f}",
                f"{model['success_rate']:.2f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)) for row in rows]
    agreement = result["agreement"]
    lines.append(
        "pearson {pearson:.3f}  spearman {spearman:.3f}  mmrv {mmrv:.3f}  mae {mean_absolute_error:.3f}".format(
            **agreement
        )
    )
    return "\n".join(lines)


def compare_with_simulator(
    policies: str | Sequence[str] = "random,scripted:0,scripted:10,scripted:25,scripted:50,agent",
    *,
    num_starts: int = 4,
    num_chunks: int = 3,
    first_sim_seed: int = 10_000,
    assets_dir: Any = None,
    engine: Any = None,
    device: str | None = None,
    seed: int = 0,
    extra_scores: Mapping[str, Callable[[np.ndarray], np.ndarray]] | None = None,
    env_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``compare_policies`` for the PushT world model in ``assets_dir`` (default: the built-in one) from the
    simulator starts ``first_sim_seed .. first_sim_seed + num_starts - 1``; ``engine`` shares a loaded model. The
    world model's frames are scored by the assets' reward model, whose successes pass the checkpoint's
    ``success_threshold``, and by ``extra_scores`` (see ``compare_policies``).
    ``env_options``: more arguments of the world model's env (``make_pusht_vector_env``, e.g. ``rigid_block``).
    Needs gym-pusht."""
    from ...envs.settings import check_int
    from ...processor import ActionStats
    from ...rewards import ClassifierRewardModel
    from .env import load_pusht_assets, make_pusht_vector_env, pusht_env_defaults

    runs = parse_policy_specs(policies)
    pusht.require_gym_pusht()
    num_starts, num_chunks = check_int(num_starts, "num_starts", 1), check_int(num_chunks, "num_chunks", 1)
    assets = load_pusht_assets(assets_dir)
    defaults = pusht_env_defaults(assets)
    stats = ActionStats.from_json(defaults["action_stats"], mode=assets.meta.get("action_normalization", "minmax"))
    overrides = {"engine": engine} if engine is not None else {"device": device}
    env = make_pusht_vector_env(
        len(runs) * num_starts,
        assets_dir=assets.root,
        return_frames=True,  # success is scored on every frame
        reward_model=None,
        success_threshold=None,
        max_episode_steps=None,
        **overrides,
        **(env_options or {}),
    )
    reward_model = ClassifierRewardModel.load(assets.reward_model, device=env.engine.device)

    @torch.no_grad()
    def score_frames(frames: np.ndarray) -> np.ndarray:
        images = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float().div(255.0)
        return reward_model.score_frames(images.to(env.engine.device)).float().cpu().numpy()

    def make_agent() -> Any:
        return _pusht_policy_agent(env.engine, defaults, seed)

    try:
        result = compare_policies(
            [run.spec for run in runs],
            range(first_sim_seed, first_sim_seed + num_starts),
            vector_env=env,
            score_frames=score_frames,
            stats=stats,
            num_chunks=num_chunks,
            make_agent=make_agent,
            seed=seed,
            extra_scores=extra_scores,
            success_threshold=float(defaults["success_threshold"]),
        )
    finally:
        env.close()
    result["assets"] = str(assets.root)
    return result


def _pusht_policy_agent(engine: Any, defaults: dict[str, Any], seed: int) -> Any:
    """The "agent" policy: the PushT checkpoint's own PolicyAgent with its env defaults (``pusht_env_defaults``)."""
    from ...agents import PolicyAgent

    return PolicyAgent(
        engine,
        task=defaults["task"],
        domain=defaults["domain"],
        raw_action_dim=defaults["raw_action_dim"],
        chunk=int(defaults["chunk"]),
        num_steps=defaults["num_steps"],
        guidance_scale=defaults["guidance_scale"],
        resolution_tier=defaults["resolution_tier"],
        fps=defaults["fps"],
        seed=seed,
    )


# ---------------------------------------------------------------------------------------------------------------
# The real simulator alone
# ---------------------------------------------------------------------------------------------------------------


def real_episode_scores(coverage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coverage after every step ``[N, T + 1]`` -> (success ``[N]`` bool, final coverage ``[N]``) of gym-pusht
    episodes: an episode succeeds, and ends, at the first step whose coverage passes ``SUCCESS_COVERAGE``
    (gym-pusht's termination); its final coverage is the coverage where it ended."""
    coverage = np.asarray(coverage, dtype=np.float64)
    passed = coverage > pusht.SUCCESS_COVERAGE
    success = cast(np.ndarray, passed.any(axis=1))  # [N] (numpy's stubs: a bool or an array)
    end = np.where(success, passed.argmax(axis=1), coverage.shape[1] - 1)
    return success, coverage[np.arange(len(coverage)), end]


def evaluate_in_simulator(
    policies: str | Sequence[str],
    *,
    num_episodes: int = 200,
    num_chunks: int | None = None,
    first_sim_seed: int = 10_000,
    assets_dir: Any = None,
    device: str | None = None,
    seed: int = 0,
    confidence: float = 0.95,
    batch_size: int = 50,
    progress: bool = True,
) -> dict[str, Any]:
    """Each policy for ``num_episodes`` episodes in gym-pusht alone, from the reset seeds ``first_sim_seed ..
    first_sim_seed + num_episodes - 1`` (the same starts for every policy): success rate (Wilson interval) and mean
    final coverage (Student-t interval clipped to [0, 1]); see ``real_episode_scores``.

    Episodes last at most ``num_chunks`` chunks (default: the PushT model's ``max_episode_steps``) of the model's
    chunk length; actions are the model's normalised chunks mapped to table pixels by its action statistics, so a
    policy acts exactly as it does in the world model. Runs ``batch_size`` simulators at a time. Deterministic for
    given arguments (file policies act with their mean action, on the CPU). Needs gym-pusht; the world model is
    loaded only for the ``agent`` policy."""
    from tqdm.auto import tqdm

    from ...envs.settings import check_int
    from ...processor import ActionStats
    from .env import load_pusht_assets, pusht_env_defaults

    runs = parse_policy_specs(policies)
    confidence = check_confidence(confidence)
    pusht.require_gym_pusht()
    assets = load_pusht_assets(assets_dir)
    defaults = pusht_env_defaults(assets)
    num_chunks = int(defaults.get("max_episode_steps") or 38) if num_chunks is None else num_chunks
    num_episodes, num_chunks = check_int(num_episodes, "num_episodes", 1), check_int(num_chunks, "num_chunks", 1)
    batch_size = check_int(batch_size, "batch_size", 1)
    chunk = int(defaults["chunk"])
    image_size = tuple(assets.meta.get("image_size", (256, 256)))
    stats = ActionStats.from_json(defaults["action_stats"], mode=assets.meta.get("action_normalization", "minmax"))
    engine = None
    if any(run.kind == "agent" for run in runs):
        from ...engine import Cosmos3Engine

        engine = Cosmos3Engine.from_pretrained(assets.checkpoint, device=device, progress=False)

    def make_agent() -> Any:
        return _pusht_policy_agent(engine, defaults, seed)

    sim_seeds = list(range(first_sim_seed, first_sim_seed + num_episodes))
    per_policy = {}
    try:
        with tqdm(
            total=len(runs) * num_episodes * num_chunks * chunk,
            unit="step",
            desc="gym-pusht (env steps)",
            disable=not progress,
        ) as bar:
            for run in runs:
                agent = _frame_policy_agent(run, make_agent, chunk, stats, seed) if run.acts_on_frames else None
                coverage = []
                for batch, start in enumerate(range(0, num_episodes, batch_size)):
                    # The batch index joins the seed so the random policy's draws differ between batches.
                    _, _, batch_coverage = simulate_policy(
                        run,
                        sim_seeds[start : start + batch_size],
                        num_chunks,
                        chunk,
                        image_size,
                        stats,
                        agent,
                        seed + batch,
                        bar,
                    )
                    coverage.append(batch_coverage)
                success, final = real_episode_scores(np.concatenate(coverage))
                successes = int(success.sum())
                per_policy[run.spec] = {
                    "episodes": num_episodes,
                    "successes": successes,
                    "success_rate": successes / num_episodes,
                    "success_rate_interval": wilson_interval(successes, num_episodes, confidence),
                    "final_coverage": float(final.mean()),
                    "final_coverage_interval": mean_interval(list(final), confidence, bounds=(0.0, 1.0)),
                }
    finally:
        if engine is not None:
            engine.close()
    return {
        "mode": "real_only",
        "simulator": pusht.SIM_ENV_ID,
        "policies": per_policy,
        "num_episodes": num_episodes,
        "num_chunks": num_chunks,
        "chunk": chunk,
        "sim_seeds": [sim_seeds[0], sim_seeds[-1]],
        "seed": seed,
        "confidence": confidence,
        "success": f"coverage > {pusht.SUCCESS_COVERAGE} at any step (the episode ends there)",
        "intervals": {"success_rate": "wilson", "final_coverage": "student_t clipped to [0, 1]"},
        "assets": str(assets.root),
    }


def format_real_only(result: dict[str, Any]) -> str:
    """A plain-text table of ``evaluate_in_simulator``'s result (policy names never cut)."""
    level = f"{round(100 * result['confidence'])}% CI"
    rows = [("policy", "episodes", f"success rate [{level}]", f"final coverage [{level}]")]
    for spec, entry in result["policies"].items():
        interval = entry["final_coverage_interval"]
        coverage = f"{entry['final_coverage']:.3f}" + (" [{:.3f}, {:.3f}]".format(*interval) if interval else "")
        rows.append(
            (
                spec,
                str(entry["episodes"]),
                "{:.3f} [{:.3f}, {:.3f}]".format(entry["success_rate"], *entry["success_rate_interval"]),
                coverage,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width) for i, (cell, width) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]
    lines.append(
        f"{result['simulator']}, seeds {result['sim_seeds'][0]}..{result['sim_seeds'][1]}, "
        f"{result['num_chunks']} chunks of {result['chunk']} steps; success: {result['success']}"
    )
    return "\n".join(lines)
