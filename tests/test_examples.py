"""The examples run top to bottom with tiny settings and write their outputs (loaded with runpy, so they share this
process's imports; each is called through its ``main(argv)``)."""

import json
import runpy
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = ["--domain", "pusht", "--chunk", "4", "--num-steps", "2", "--resolution-tier", "256", "--device", "cpu"]


@pytest.fixture(scope="module")
def start_image(tmp_path_factory):
    path = tmp_path_factory.mktemp("examples") / "start.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(path)
    return str(path)


def run_example(name: str, argv: list[str]) -> None:
    runpy.run_path(str(EXAMPLES / name))["main"](argv)


def test_train_ppo_in_world_model(tiny_checkpoint, start_image, tmp_path, capsys):
    run_example("train_ppo_in_world_model.py", [
        "--checkpoint", str(tiny_checkpoint), "--initial-states", start_image, "--goal", start_image,
        "--num-envs", "2", "--n-steps", "2", "--total-timesteps", "4", "--max-episode-steps", "2",
        "--observation-size", "36", "--eval-episodes", "2", "--policy-device", "cpu", "--out",
        str(tmp_path / "ppo.safetensors"), *TINY,
    ])
    from cosmos3_gym.policy_specs import parse_policy_spec

    assert parse_policy_spec(f"file:{tmp_path / 'ppo.safetensors'}").is_sb3_file  # loadable by eval / eval-real
    assert "success rate" in capsys.readouterr().out


def test_evaluate_policy(tiny_checkpoint, start_image, tmp_path, capsys):
    run_example("evaluate_policy.py", [
        "--checkpoint", str(tiny_checkpoint), "--initial-states", start_image, "--goal", start_image,
        "--episodes", "2", "--num-envs", "2", "--max-episode-steps", "1", "--out", str(tmp_path), *TINY,
    ])
    for policy in ("agent", "random"):
        report = json.loads((tmp_path / policy / "report.json").read_text())
        assert len(report["episodes"]) == 2
        assert (tmp_path / policy / "episode_0000.mp4").is_file()
    printed = capsys.readouterr().out
    assert "== agent ==" in printed and "== random ==" in printed


def test_inverse_dynamics_labels(tiny_checkpoint, start_image, tmp_path, capsys):
    out = tmp_path / "labels.json"
    run_example("inverse_dynamics_labels.py", [
        "--checkpoint", str(tiny_checkpoint), "--initial-states", start_image, "--generate-steps", "2",
        "--out", str(out), *TINY,
    ])
    labels = json.loads(out.read_text())
    assert labels["shape"] == [2 * 4, 2] and np.isfinite(labels["data"]).all()  # one action per transition
    assert out.with_suffix(".mp4").is_file()
    assert "labels vs commanded actions" in capsys.readouterr().out
