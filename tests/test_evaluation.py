"""Policy evaluation: confidence intervals (bounded where the values are), episode counting over vector-env slots in
every autoreset mode, per-task statistics, the report JSON, videos, policy loading, and the ``eval`` / ``demo``
commands.

Episodes end deterministically: a reward model scores 1 for the task "finish" and 0 otherwise; with
``success_threshold=0.5`` a "finish" slot terminates (successfully) after every chunk and the others run to
``max_episode_steps``. Without a success definition there is no success rate.
"""

import json
import shutil
import time

import gymnasium as gym
import imageio.v3 as iio
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode
from PIL import Image

from cosmos3_gym import evaluation, policy_specs, statistics
from cosmos3_gym.agents import PolicyAgent
from cosmos3_gym.checkpoint import checkpoint_defaults
from cosmos3_gym.cli import main
from cosmos3_gym.engine import Cosmos3Engine
from cosmos3_gym.envs import WorldModelEnv, WorldModelVectorEnv
from cosmos3_gym.errors import InputError
from cosmos3_gym.evaluation import (
    RandomPolicy,
    evaluate_policy,
    load_policy,
    mean_interval,
    student_t_quantile,
    wilson_interval,
)
from cosmos3_gym.testing import cached_tiny_checkpoint, tiny_checkpoint_cache_dir

FAST = dict(domain="pusht", chunk=4, num_steps=2, resolution_tier=256)
FAST_FLAGS = ["--domain-name", "pusht", "--chunk", "4", "--num-steps", "2", "--resolution-tier", "256",
              "--device", "cpu"]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def image_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("states") / "start.png"
    Image.fromarray(image(0)).save(path)
    return path


def image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (96, 128, 3), dtype=np.uint8)


def finish_task(frames, tasks):
    return [1.0 if task == "finish" else 0.0 for task in tasks]


def make_vec_env(engine, num_envs=3, **kwargs):
    defaults = dict(engine=engine, initial_states=image(0), task=["finish", "go", "go"][:num_envs],
                    reward_model=finish_task, success_threshold=0.5, max_episode_steps=2, return_frames=True)
    return WorldModelVectorEnv(num_envs, **{**FAST, **defaults, **kwargs})


def zero_actions(observations):
    return np.zeros((observations["image"].shape[0], 4, 2), dtype=np.float32)


# ------------------------------------------------------------------ confidence intervals


@pytest.mark.parametrize(
    "successes, trials, expected",
    # Newcombe (1998), Stat. Med. 17:857, Table I, method 3 (Wilson score, no continuity correction); and 5/10.
    [(81, 263, (0.2553, 0.3662)), (15, 148, (0.0624, 0.1605)), (0, 20, (0.0, 0.1611)), (1, 29, (0.0061, 0.1718)),
     (5, 10, (0.2366, 0.7634))],
)
def test_wilson_interval_matches_published_values(successes, trials, expected):
    low, high = wilson_interval(successes, trials)
    assert low == pytest.approx(expected[0], abs=6e-5) and high == pytest.approx(expected[1], abs=6e-5)


def test_wilson_interval_edges_and_errors():
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    narrow, wide = wilson_interval(5, 10, confidence=0.5), wilson_interval(5, 10, confidence=0.99)
    assert wide[0] < narrow[0] < 0.5 < narrow[1] < wide[1]
    with pytest.raises(InputError, match="trials"):
        wilson_interval(3, 0)
    with pytest.raises(InputError, match="confidence"):
        wilson_interval(3, 5, confidence=1.0)


@pytest.mark.parametrize(
    "probability, df, expected",  # Student-t tables (scipy.stats.t.ppf)
    [(0.975, 1, 12.706204736), (0.975, 2, 4.302652730), (0.975, 5, 2.570581836), (0.975, 10, 2.228138852),
     (0.975, 30, 2.042272456), (0.95, 4, 2.131846786)],
)
def test_student_t_quantile_matches_tables(probability, df, expected):
    assert student_t_quantile(probability, df) == pytest.approx(expected, rel=1e-8)


def test_mean_interval_is_the_student_t_interval():
    low, high = mean_interval([1.0, 2.0, 3.0, 4.0])
    half_width = 3.182446305 * np.std([1, 2, 3, 4], ddof=1) / 2  # t(0.975, 3) * s / sqrt(4)
    assert low == pytest.approx(2.5 - half_width) and high == pytest.approx(2.5 + half_width)
    assert mean_interval([1.0]) is None


def test_mean_interval_respects_known_bounds():
    """Issue 20: two returns 0.0 and 0.007 of rewards in [0, 1] gave [-1.458, 1.713]; with the bounds it stays in."""
    plain = mean_interval([0.0, 0.007])
    assert plain[0] < 0
    low, high = mean_interval([0.0, 0.007], bounds=(0.0, 1.0))
    assert low == 0.0 and high == pytest.approx(plain[1])
    assert mean_interval([0.9, 1.0, 1.0], bounds=(0.0, 1.0))[1] == 1.0
    with pytest.raises(InputError, match="outside the given bounds"):
        mean_interval([0.5, 2.0], bounds=(0.0, 1.0))
    summary = statistics.mean_summary([0.0, 0.007], bounds=(0.0, 1.0))
    assert (summary["low"], summary["n"]) == (0.0, 2) and "clipped" in summary["interval"]
    assert "approximate" in statistics.mean_summary([1.0, 2.0])["interval"]


def test_one_interval_implementation_everywhere():
    """The evaluation, the simulator comparison and the benchmarks use the statistics module's functions."""
    from cosmos3_gym.tasks.pusht import compare

    assert evaluation.wilson_interval is statistics.wilson_interval
    assert evaluation.mean_interval is compare.mean_interval is statistics.mean_interval
    assert compare.parse_policy_specs is policy_specs.parse_policy_specs


# ------------------------------------------------------------------ evaluate_policy


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_counts_exactly_n_episodes_with_per_slot_quotas(engine, tmp_path, mode):
    """7 episodes over 3 slots: episode k*3+s is slot s's k-th, so slot 0 ("finish", 1 step per episode) runs 3
    counted episodes and the slower slots 1 and 2 two each, whatever order they finish in."""
    env = make_vec_env(engine, autoreset_mode=mode)
    report = evaluate_policy(env, zero_actions, 7, video_dir=tmp_path, max_videos=2, progress=False)
    assert [e.episode for e in report.episodes] == list(range(7))
    assert [e.slot for e in report.episodes] == [0, 1, 2, 0, 1, 2, 0]
    for e in report.episodes:
        finish = e.slot == 0
        assert e.task == ("finish" if finish else "go")
        assert (e.length, e.episode_return, e.success, e.terminated, e.truncated) == (
            (1, 1.0, True, True, False) if finish else (2, 0.0, False, False, True)
        )
        assert e.initial_state_index == 0
    assert report.per_task["finish"].episodes == 3 and report.per_task["finish"].success_rate == 1.0
    assert report.per_task["go"].episodes == 4 and report.per_task["go"].success_rate == 0.0
    assert report.overall.successes == 3 and report.overall.mean_return == pytest.approx(3 / 7)
    assert report.overall.success_rate_interval == pytest.approx(wilson_interval(3, 7))
    # Videos of episodes 0 and 1 only: the start image plus every generated chunk (info["frames"]).
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == ["episode_0000.mp4", "episode_0001.mp4"]
    assert [e.video for e in report.episodes[:3]] == ["episode_0000.mp4", "episode_0001.mp4", None]
    assert iio.imread(tmp_path / "episode_0000.mp4").shape == (1 + 4, 96, 128, 3)
    assert iio.imread(tmp_path / "episode_0001.mp4").shape == (1 + 2 * 4, 96, 128, 3)
    env.close()


def test_report_json_schema(engine, tmp_path):
    env = make_vec_env(engine, num_envs=2)
    report = evaluate_policy(env, zero_actions, 3, seed=5, progress=False)
    document = json.loads(report.to_json(tmp_path / "report.json").read_text())
    assert set(document) == {"format", "settings", "overall", "per_task", "episodes"}
    assert document["format"] == "cosmos3_gym.eval_report/1"
    settings = document["settings"]
    assert settings["episodes"] == 3 and settings["num_envs"] == 2 and settings["seed"] == 5
    assert settings["success_rate_interval"] == "wilson"
    assert settings["mean_return_interval"].startswith("student_t (approximate")  # no reward bounds given
    assert settings["confidence"] == 0.95 and settings["policy"] == "function"
    summary_keys = {"episodes", "successes", "success_rate", "success_rate_interval", "mean_return", "return_std",
                    "mean_return_interval", "mean_length"}
    assert set(document["overall"]) == summary_keys
    assert set(document["per_task"]) == {"finish", "go"}
    assert all(set(summary) == summary_keys for summary in document["per_task"].values())
    assert document["per_task"]["finish"]["mean_return_interval"] == [1.0, 1.0]  # two identical returns
    assert document["per_task"]["go"]["return_std"] is None  # one episode: no spread, no interval
    assert len(document["episodes"]) == 3
    assert set(document["episodes"][0]) == {"episode", "slot", "task", "episode_return", "length", "success",
                                            "terminated", "truncated", "initial_state_index", "video"}
    assert "go" in report.table() and "(all)" in report.table()
    env.close()


def test_no_success_rate_without_a_success_definition(engine):
    """Issue 20: without a threshold, success was "return > 0" and a mean return of 0.0035 read as 100 % success."""
    env = make_vec_env(engine, num_envs=2, success_threshold=None, reward_model=None, task="go")
    report = evaluate_policy(env, zero_actions, 2, progress=False)
    assert [e.success for e in report.episodes] == [None, None]
    assert report.overall.success_rate is None and report.overall.success_rate_interval is None
    assert report.settings["success"] is None
    assert "n/a" in report.table() and "no success definition" in report.table()
    explicit = evaluate_policy(env, zero_actions, 2, progress=False, success_return_threshold=-1.0)
    assert explicit.overall.success_rate == 1.0 and "return > -1.0" in explicit.settings["success"]
    env.close()


def test_return_interval_is_clipped_to_the_return_bounds(engine):
    """Per-step rewards in [0, 1] over at most 2 steps: the mean return's interval lies in [0, 2]."""
    env = make_vec_env(engine, num_envs=3)
    report = evaluate_policy(env, zero_actions, 4, progress=False, reward_bounds=(0.0, 1.0))
    assert report.settings["return_bounds"] == [0.0, 2.0]
    low, high = report.overall.mean_return_interval
    assert low == 0.0 and high <= 2.0
    assert low == max(0.0, mean_interval([e.episode_return for e in report.episodes])[0])
    assert "clipped" in report.settings["mean_return_interval"] and "~" not in report.table()
    env.close()


def test_table_never_cuts_task_names(engine):
    long_task = "push the T-shaped block onto the green target and keep it there until the episode ends"
    env = make_vec_env(engine, num_envs=1, task=long_task)
    assert long_task in evaluate_policy(env, zero_actions, 1, progress=False).table()
    env.close()


def test_progress_counts_env_steps_with_a_total_that_ends_at_100_percent(engine, monkeypatch):
    """Issue 20: the bar counted whole episodes, 0 % for a whole batched run. Now: env steps of the counted episodes
    out of episodes x max_episode_steps; an episode that ends early adds the steps it will not take."""
    bars = []

    class RecordingBar:
        def __init__(self, total=None, **kwargs):
            self.total, self.n, self.history = total, 0, []
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            self.n += n
            self.history.append(self.n)

        def set_postfix(self, **kwargs):
            pass

    monkeypatch.setattr(evaluation, "tqdm", RecordingBar)
    env = make_vec_env(engine, num_envs=3)  # "finish" ends after 1 of 2 steps, "go" runs 2
    evaluate_policy(env, zero_actions, 6)
    (bar,) = bars
    assert bar.total == 6 * 2 and bar.n == bar.total
    # The first vector step already moves the bar (3 slots x 1 step, plus the finished episode's unused step).
    assert bar.history[:4] == [1, 2, 3, 4]
    env.close()


def test_single_env_success_from_return_and_render_frames(engine, tmp_path):
    """A single env runs as one slot; the policy sees unbatched observations. Without a success threshold,
    success is return > success_return_threshold; without info["frames"] the video comes from render()."""
    seen = []

    def policy(observation):
        seen.append(observation["image"].shape)
        return np.zeros((4, 2), dtype=np.float32)

    env = WorldModelEnv(engine=engine, initial_states=image(1), task="finish", reward_model=finish_task,
                        max_episode_steps=2, render_mode="rgb_array", **FAST)
    report = evaluate_policy(env, policy, 2, video_dir=tmp_path, success_return_threshold=1.5, progress=False)
    assert seen == [(96, 128, 3)] * 4  # no policy call for the reset steps
    assert [(e.length, e.episode_return, e.success, e.truncated) for e in report.episodes] == [(2, 2.0, True, True)] * 2
    assert iio.imread(tmp_path / "episode_0001.mp4").shape == (1 + 2, 96, 128, 3)  # start + one frame per step


def test_policy_agent_is_prompted_with_each_slot_task(engine, monkeypatch):
    env = make_vec_env(engine, num_envs=2, max_episode_steps=1)
    agent = load_policy("agent", env, seed=0)
    assert isinstance(agent, PolicyAgent)
    assert (agent.chunk, agent.raw_action_dim, agent.num_steps, agent.resolution_tier) == (4, 2, 2, 256)
    policy_tasks = []
    original = engine.step

    def step(requests, **kwargs):
        policy_tasks.extend(r.task for r in requests if r.mode == "policy")
        return original(requests, **kwargs)

    monkeypatch.setattr(engine, "step", step)
    report = evaluate_policy(env, agent, 2, progress=False)
    assert policy_tasks == ["finish", "go"]
    assert report.settings["policy"] == "PolicyAgent"


def test_sb3_style_predict_gets_episode_starts(engine):
    class Recorder:
        def __init__(self):
            self.starts = []

        def predict(self, observation, state=None, episode_start=None, deterministic=False):
            assert deterministic
            self.starts.append(np.asarray(episode_start).tolist())
            return zero_actions(observation), "state"

    model = Recorder()
    env = make_vec_env(engine, num_envs=2, task="go", max_episode_steps=1)
    evaluate_policy(env, model, 4, progress=False)
    # NEXT_STEP: step 1 ends both episodes, step 2 resets both without asking the policy (the env ignores its
    # actions), step 3 runs the new episodes.
    assert model.starts == [[True, True], [True, True]]


# ------------------------------------------------------------------ load_policy


def test_load_policy_builtins_and_factories(engine, tmp_path, monkeypatch):
    env = make_vec_env(engine, num_envs=2)
    random_policy = load_policy("random", env, seed=3)
    assert isinstance(random_policy, RandomPolicy)
    actions = random_policy(None)
    assert actions.shape == (2, 4, 2) and env.action_space.contains(actions)
    assert np.array_equal(load_policy("random", env, seed=3)(None), actions)  # seeded

    (tmp_path / "my_policies.py").write_text(
        "import numpy as np\n"
        "class Factories:\n"
        "    @staticmethod\n"
        "    def zeros(env):\n"
        "        return lambda obs: np.zeros(env.action_space.shape, np.float32)\n"
        "def not_a_policy(env):\n"
        "    return 3\n"
        "constant = 3\n"
    )
    from_file = load_policy(f"{tmp_path / 'my_policies.py'}:Factories.zeros", env)
    assert from_file(None).shape == (2, 4, 2)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_policy("my_policies:Factories.zeros", env)(None).shape == (2, 4, 2)

    for spec, message in [
        ("", "expected 'random', 'agent'"),
        ("greedy", "is not one of 'random', 'agent'"),
        ("scripted:0", "eval-real"),
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
        ("my_policies:missing", "has no attribute 'missing'"),
        ("my_policies:constant", "not a callable factory"),
        ("my_policies:not_a_policy", "returned a int"),
        (f"{tmp_path / 'absent.py'}:make", "file not found"),
    ]:
        with pytest.raises(InputError, match=message):
            load_policy(spec, env)
    with pytest.raises(InputError, match="needs a cosmos3_gym world-model env"):
        load_policy("agent", gym.make("CartPole-v1"))
    with pytest.raises(InputError, match="episodes"):
        evaluate_policy(env, zero_actions, 0)
    with pytest.raises(InputError, match="policy: expected a callable"):
        evaluate_policy(env, object(), 1)
    env.close()


# ------------------------------------------------------------------ CLI


def test_eval_command_writes_report_and_videos(tiny_checkpoint, image_path, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(tiny_checkpoint), "--policy", "random", "--episodes", "3",
                 "--num-envs", "2", "--initial-states", str(image_path), "--task", "go", "--max-episode-steps", "1",
                 "--max-videos", "2", "--out", str(out), *FAST_FLAGS]) == 0
    document = json.loads((out / "report.json").read_text())
    assert len(document["episodes"]) == 3 and document["settings"]["policy"] == "random"
    assert document["settings"]["checkpoint"] == str(tiny_checkpoint)
    assert sorted(p.name for p in out.glob("*.mp4")) == ["episode_0000.mp4", "episode_0001.mp4"]
    printed = capsys.readouterr().out
    assert "success rate" in printed and "report.json" in printed

    assert main(["eval", "--checkpoint", str(tiny_checkpoint), "--policy", "nope", "--initial-states",
                 str(image_path), "--out", str(out), *FAST_FLAGS]) == 2
    assert "cosmos3-gym eval: error: policy: 'nope' is not one of 'random', 'agent'" in capsys.readouterr().err


def test_eval_takes_env_settings_from_meta_json(tiny_checkpoint, image_path, tmp_path):
    checkpoint = shutil.copytree(tiny_checkpoint, tmp_path / "trained")
    (checkpoint / "meta.json").write_text(json.dumps({"domain": "pusht", "raw_action_dim": 2, "chunk": 4,
                                                      "resolution_tier": 256, "fps": 10.0, "image_size": [96, 128]}))
    assert checkpoint_defaults(checkpoint) == {"domain": "pusht", "raw_action_dim": 2, "chunk": 4,
                                                   "resolution_tier": 256, "fps": 10.0}
    out = tmp_path / "eval"
    assert main(["eval", "--checkpoint", str(checkpoint), "--policy", "random", "--episodes", "1", "--initial-states",
                 str(image_path), "--max-episode-steps", "1", "--num-steps", "2", "--max-videos", "0",
                 "--out", str(out), "--device", "cpu"]) == 0
    env_settings = json.loads((out / "report.json").read_text())["settings"]["env"]
    assert (env_settings["domain"], env_settings["chunk"], env_settings["resolution_tier"], env_settings["fps"]) == (
        "pusht", 4, 256, 10.0
    )
    assert not list(out.glob("*.mp4"))


def test_eval_reports_each_override_once(tiny_checkpoint, image_path, tmp_path, capsys, caplog):
    """Issue 41: an override was printed twice, by eval and again by the env in other words."""
    checkpoint = shutil.copytree(tiny_checkpoint, tmp_path / "trained")
    (checkpoint / "meta.json").write_text(json.dumps({"domain": "pusht", "raw_action_dim": 2, "chunk": 4,
                                                      "resolution_tier": 256, "guidance_scale": 1.0, "fps": 10.0,
                                                      "score_name": "coverage"}))
    out = tmp_path / "eval"
    with caplog.at_level("WARNING"):
        assert main(["eval", "--checkpoint", str(checkpoint), "--policy", "random", "--episodes", "1",
                     "--initial-states", str(image_path), "--max-episode-steps", "1", "--num-steps", "2",
                     "--guidance-scale", "2.0", "--max-videos", "0", "--out", str(out), "--device", "cpu"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "guidance_scale" in line]
    said += [record.getMessage() for record in caplog.records if "guidance_scale" in record.getMessage()]
    assert said == ["eval: using guidance_scale=2.0 instead of the checkpoint's 1.0"]
    document = json.loads((out / "report.json").read_text())["settings"]
    assert document["overrides"] == {"guidance_scale": {"checkpoint": 1.0, "used": 2.0}}
    assert document["env"]["guidance_scale"] == 2.0 and document["env"]["fps"] == 10.0


def test_eval_of_a_folder_that_is_not_a_checkpoint_says_so(image_path, tmp_path, capsys):
    """Issue 41: it said the checkpoint ships no start states."""
    folder = tmp_path / "not_a_checkpoint"
    folder.mkdir()
    assert main(["eval", "--checkpoint", str(folder), "--initial-states", str(image_path), "--out",
                 str(tmp_path / "out")]) == 2
    (error,) = capsys.readouterr().err.strip().splitlines()
    assert "is not a usable Cosmos3 checkpoint" in error and "missing directory" in error and "transformer" in error
    assert "initial_states" not in error


def test_demo_report_and_message_agree_on_what_drives_the_side_by_side(tiny_checkpoint, tmp_path, monkeypatch,
                                                                        capsys):
    """Issue 41: without gym-pusht the demo said the side-by-side was driven by the model's own policy while
    report.json said random (the episodes' policy). report.json records the video's driver, the CLI prints it."""
    from test_pusht import build_tiny_pusht_assets

    from cosmos3_gym.tasks.pusht import episodes
    from cosmos3_gym.tasks.pusht.demo import SIDE_BY_SIDE_DRIVERS

    monkeypatch.setenv("COSMOS3_GYM_PUSHT_ASSETS", str(build_tiny_pusht_assets(tmp_path / "assets", tiny_checkpoint)))
    monkeypatch.setattr(episodes, "has_gym_pusht", lambda: False)  # as without the sim extra
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--device", "cpu", "--episodes", "1", "--steps-per-episode", "1"]) == 0
    printed = capsys.readouterr().out
    settings = json.loads((out / "report.json").read_text())["settings"]
    assert settings["policy"] == "random"  # the episodes'
    video = settings["side_by_side"]
    assert video["mode"] == "world_model_only" and video["policy"] == "agent"
    assert video == {**video, **SIDE_BY_SIDE_DRIVERS["world_model_only"]}
    assert f"{video['path']}: {video['description']}" in printed
    assert "own policy (agent), not the episodes' policy" in video["description"]


def test_demo_command_uses_the_builtin_pusht_model(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--device", "cpu", "--steps-per-episode", "2"]) == 0
    assert "built-in PushT world model" in capsys.readouterr().out
    document = json.loads((out / "report.json").read_text())
    assert document["settings"]["random_weights"] is False
    assert [e["length"] for e in document["episodes"]] == [2, 2]
    assert document["settings"]["side_by_side"]["num_frames"] == 1 + 2 * 8
    assert iio.imread(out / "episode_0000.mp4").shape[0] == 1 + 2 * 8
    assert (out / "side_by_side.mp4").stat().st_size > 0


def test_demo_on_the_builtin_model_refuses_a_chunk_instead_of_ignoring_it(tmp_path):
    from cosmos3_gym.tasks.pusht.demo import run_demo

    with pytest.raises(InputError, match="^chunk:"):
        run_demo(tmp_path / "demo", chunk=16)
    assert not (tmp_path / "demo").exists()  # refused before anything ran


def test_demo_command_builds_the_cached_tiny_checkpoint_once(tmp_path, monkeypatch, capsys, record_property):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("COSMOS3_GYM_PUSHT_ASSETS", str(tmp_path / "no_builtin_model"))  # the fallback path
    out = tmp_path / "demo"
    start = time.perf_counter()
    assert main(["demo", "--out", str(out), "--device", "cpu"]) == 0
    seconds = time.perf_counter() - start
    record_property("demo_seconds", seconds)
    assert "RANDOM weights" in capsys.readouterr().out
    with capsys.disabled():  # reported, not asserted: CI machines differ
        print(f"\ndemo on the tiny checkpoint (2 episodes x 3 steps, cache build included): {seconds:.1f} s")

    cache = tiny_checkpoint_cache_dir()
    assert cache.parent == tmp_path / "cache" / "cosmos3_gym"
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]  # no half-built folders left behind
    built = (cache / "model_index.json").stat().st_mtime_ns
    assert cached_tiny_checkpoint() == cache and (cache / "model_index.json").stat().st_mtime_ns == built

    document = json.loads((out / "report.json").read_text())
    assert document["settings"]["random_weights"] is True and document["settings"]["policy"] == "random"
    assert [e["length"] for e in document["episodes"]] == [3, 3]
    for name in ("episode_0000.mp4", "episode_0001.mp4"):
        assert iio.imread(out / name).shape == (1 + 3 * 8, 240, 320, 3)  # start + 3 chunks of 8 frames

    with pytest.raises(SystemExit):  # argparse: the demo takes only the built-in policies
        main(["demo", "--out", str(out), "--policy", "my_module:make"])


# ------------------------------------------------------------------ policy specs: files, mismatches


class ConstantFileAgent:
    """A frame agent as a policy-file loader returns it: act(frames [N, H, W, 3]) -> [N, chunk, 2]."""

    def __init__(self, path, chunk=4):
        self.path, self.action_shape, self.frames_seen = path, (chunk, 2), []

    def act(self, frames):
        self.frames_seen.append(np.asarray(frames).shape)
        return np.full((len(frames), *self.action_shape), 0.5, np.float32)


def write_policy_file(path, **metadata):
    import safetensors.numpy

    safetensors.numpy.save_file({"weight": np.zeros(2, np.float32)}, str(path), metadata=metadata)
    return path


def test_file_spec_dispatches_on_the_file_metadata(engine, tmp_path, monkeypatch):
    loaded = []

    def load_fake(path):
        loaded.append(ConstantFileAgent(path))
        return loaded[-1]

    monkeypatch.setitem(policy_specs.POLICY_FILE_LOADERS, "fake_for_test", load_fake)
    good = write_policy_file(tmp_path / "bc.safetensors", format="cosmos3_gym.policy", kind="fake_for_test")
    spec = policy_specs.parse_policy_spec(f"file:{good}")
    assert (spec.kind, spec.file_kind, spec.acts_on_frames) == ("file", "fake_for_test", True)

    env = make_vec_env(engine, num_envs=2)
    report = evaluate_policy(env, load_policy(f"file:{good}", env), 2, progress=False)
    assert loaded[0].path == str(good) and loaded[0].frames_seen[0] == (2, 96, 128, 3)  # batched frames
    assert report.settings["policy"] == f"file:{good}"
    env.close()

    # Loaders are named by a module path string and imported lazily: "module:function".
    monkeypatch.setitem(policy_specs.POLICY_FILE_LOADERS, "fake_for_test", "tests.no_such_module:load")
    with pytest.raises(InputError, match="'tests.no_such_module:load' of kind 'fake_for_test' is not available"):
        policy_specs.load_frame_agent(f"file:{good}")
    # The built-in kind points at the RL package's loader.
    assert policy_specs.POLICY_FILE_LOADERS["pixel_gaussian"] == "cosmos3_gym.rl.policy:load_policy_file"

    unknown = write_policy_file(tmp_path / "x.safetensors", format="cosmos3_gym.policy", kind="transformer_xl")
    foreign = write_policy_file(tmp_path / "y.safetensors", format="someone_else")
    not_safetensors = tmp_path / "z.safetensors"
    not_safetensors.write_text("garbage")
    for text, message in [(f"file:{unknown}", "kind 'transformer_xl'; known kinds"),
                          (f"file:{foreign}", "no policy metadata this package knows"),
                          (f"file:{not_safetensors}", "not a readable safetensors file"),
                          (f"file:{tmp_path / 'absent.safetensors'}", "file not found"),
                          (f"sb3:{good}", "not written by save_sb3_policy")]:
        with pytest.raises(InputError, match=message):
            policy_specs.parse_policy_spec(text)


def test_sb3_policy_files_load_through_file_and_sb3_specs(engine, tiny_ppo_model, tmp_path):
    """An SB3 PPO trained at another observation size gives a one-line InputError naming the fix, not a traceback."""
    from cosmos3_gym.agents import save_sb3_policy

    path = save_sb3_policy(tiny_ppo_model, tmp_path / "ppo.safetensors")  # 48 x 48 images, [8, 2] actions
    assert policy_specs.parse_policy_spec(f"file:{path}").file_kind == "sb3"
    assert policy_specs.parse_policy_spec(f"ppo:{path}").is_sb3_file
    fits = make_vec_env(engine, num_envs=2, chunk=8, observation_size=(48, 48))
    for spec in (f"file:{path}", f"sb3:{path}"):
        report = evaluate_policy(fits, load_policy(spec, fits), 2, progress=False)
        assert len(report.episodes) == 2
    fits.close()

    other_size = make_vec_env(engine, num_envs=2, chunk=8, observation_size=(32, 32))
    with pytest.raises(InputError) as error:
        load_policy(f"file:{path}", other_size)
    assert "[48, 48, 3], the env gives [32, 32, 3]; pass --observation-size 48" in str(error.value)
    assert "\n" not in str(error.value)
    other_size.close()
    other_chunk = make_vec_env(engine, num_envs=2, chunk=4, observation_size=(48, 48))
    with pytest.raises(InputError, match=r"actions of shape \[8, 2\], the env takes \[4, 2\]"):
        load_policy(f"sb3:{path}", other_chunk)
    other_chunk.close()


def test_eval_command_with_an_sb3_policy_and_observation_size(tiny_checkpoint, image_path, tiny_ppo_model, tmp_path,
                                                              capsys):
    from cosmos3_gym.agents import save_sb3_policy

    path = save_sb3_policy(tiny_ppo_model, tmp_path / "ppo.safetensors")
    flags = ["eval", "--checkpoint", str(tiny_checkpoint), "--policy", f"sb3:{path}", "--episodes", "1",
             "--initial-states", str(image_path), "--max-episode-steps", "1", "--max-videos", "0",
             "--out", str(tmp_path / "eval"), "--domain-name", "pusht", "--chunk", "8", "--num-steps", "2",
             "--resolution-tier", "256", "--device", "cpu"]
    assert main(flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cosmos3-gym eval: error: policy:") and "--observation-size 48" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert main([*flags, "--observation-size", "48"]) == 0
    assert json.loads((tmp_path / "eval" / "report.json").read_text())["settings"]["observation_size"] == [48, 48]


def test_eval_command_on_the_builtin_model_uses_its_settings(tmp_path, capsys):
    """Issue 20: eval on the built-in model needed --checkpoint and --initial-states, started every episode from
    state 0 and used guidance 3.0 instead of the model's 1.0."""
    out = tmp_path / "eval"
    assert main(["eval", "--policy", "random", "--episodes", "4", "--num-envs", "4", "--max-episode-steps", "1",
                 "--num-steps", "1", "--max-videos", "0", "--device", "cpu", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "using num_steps=1 instead of the checkpoint's 4" in captured.err
    settings = json.loads((out / "report.json").read_text())["settings"]
    assert settings["checkpoint"].endswith("pusht/assets/checkpoint")
    assert (settings["env"]["guidance_scale"], settings["env"]["success_threshold"], settings["env"]["chunk"]) == (
        1.0, 0.92, 8)  # the checkpoint's calibrated success_threshold
    assert set(settings["overrides"]) == {"num_steps", "max_episode_steps"}
    assert settings["return_bounds"] == [0.0, 1.0]  # the classifier reward model scores in [0, 1]
    assert settings["decoder"] == "light"  # the checkpoint's meta.json, as gym.make("cosmos3_gym/PushT-v0")
    episodes = json.loads((out / "report.json").read_text())["episodes"]
    assert len({e["initial_state_index"] for e in episodes}) > 1
    assert "success rate" in captured.out and "n/a" not in captured.out
    exact = tmp_path / "exact"
    assert main(["eval", "--policy", "random", "--episodes", "1", "--max-episode-steps", "1", "--num-steps", "1",
                 "--max-videos", "0", "--device", "cpu", "--decoder", "vae", "--out", str(exact)]) == 0
    assert json.loads((exact / "report.json").read_text())["settings"]["decoder"] == "vae"
