"""``cosmos3-gym infer`` / ``make-tiny-checkpoint``: outputs, parity of saved frames with diffusers, bad input."""

import argparse
import json
import shutil
import subprocess
import sys

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
from PIL import Image

from cosmos3_gym.cli import main

COMMON = ["--domain-name", "pusht", "--resolution-tier", "256", "--chunk", "4", "--num-steps", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def image_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("inputs") / "frame.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)).save(path)
    return path


def infer(ckpt, out, *extra):
    return main(["infer", "--checkpoint", str(ckpt), "--out", str(out), *COMMON, *extra])


def test_infer_writes_actions_video_and_arrays_equal_to_pipeline(tiny_checkpoint, image_path, tmp_path):
    assert infer(tiny_checkpoint, tmp_path / "run", "--image", str(image_path), "--prompt", "push the block",
                 "--guidance-scale", "2.0", "--seed", "3", "--save-arrays") == 0
    action = json.loads((tmp_path / "run_action.json").read_text())
    assert action["shape"] == [4, 2] and action["dtype"] == "float32"
    frames = np.load(tmp_path / "run_video.npy")
    assert iio.imread(tmp_path / "run.mp4").shape[0] == frames.shape[0] == 5

    pipe = Cosmos3OmniPipeline.from_pretrained(tiny_checkpoint, enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(
        prompt="push the block",
        action=CosmosActionCondition(mode="policy", chunk_size=4, domain_name="pusht", resolution_tier=256,
                                     image=Image.open(image_path)),
        num_inference_steps=2, guidance_scale=2.0, fps=15.0, generator=torch.Generator().manual_seed(3),
        output_type="np", enable_safety_check=False,
    )
    assert frames.shape == ref.video.shape and frames.dtype == np.float32
    assert np.abs(frames - ref.video).max() < 1e-4
    assert np.allclose(np.array(action["data"]), ref.action[0].numpy(), atol=1e-4)


def test_optimize_and_vae_dtype_flags(tiny_checkpoint, image_path, tmp_path):
    args = ["--image", str(image_path), "--prompt", "push the block", "--seed", "3", "--save-arrays"]
    assert infer(tiny_checkpoint, tmp_path / "eager", *args) == 0
    assert infer(tiny_checkpoint, tmp_path / "fast", *args, "--optimize") == 0
    assert infer(tiny_checkpoint, tmp_path / "bf16", *args, "--vae-dtype", "bf16") == 0
    eager, fast, bf16 = (np.load(tmp_path / f"{name}_video.npy") for name in ("eager", "fast", "bf16"))
    assert np.abs(fast - eager).max() < 1e-4  # compiled and fused: the same numbers
    assert 1e-4 < np.abs(bf16 - eager).max() < 0.1  # a bf16 VAE: visibly the same video, not the same bits
    assert infer(tiny_checkpoint, tmp_path / "bad", *args, "--vae-dtype", "fp8") == 2


def test_forward_dynamics_with_both_action_file_formats(tiny_checkpoint, image_path, tmp_path):
    data = np.random.default_rng(1).uniform(-1, 1, (4, 2)).round(4).tolist()
    (tmp_path / "a.json").write_text(json.dumps({"shape": [4, 2], "dtype": "float32", "data": data}))
    (tmp_path / "b.json").write_text(json.dumps({"action_chunks": [[[0, 0]] * 4, data]}))
    assert infer(tiny_checkpoint, tmp_path / "a", "--image", str(image_path), "--mode", "forward_dynamics",
                 "--action-file", str(tmp_path / "a.json"), "--save-arrays", "--no-decode") == 0
    assert infer(tiny_checkpoint, tmp_path / "b", "--image", str(image_path), "--mode", "forward_dynamics",
                 "--action-file", str(tmp_path / "b.json"), "--action-chunk-index", "1", "--save-arrays") == 0
    assert not (tmp_path / "a.mp4").exists() and (tmp_path / "b.mp4").exists()
    assert json.loads((tmp_path / "a_action.json").read_text())["data"] == \
        json.loads((tmp_path / "b_action.json").read_text())["data"]


def test_inverse_dynamics_from_video(tiny_checkpoint, tmp_path):
    video = np.random.default_rng(2).integers(0, 256, (5, 64, 64, 3), dtype=np.uint8)
    iio.imwrite(tmp_path / "clip.gif", video, duration=60, loop=0)
    assert infer(tiny_checkpoint, tmp_path / "inv", "--video", str(tmp_path / "clip.gif"),
                 "--mode", "inverse_dynamics", "--no-decode") == 0
    assert json.loads((tmp_path / "inv_action.json").read_text())["shape"] == [4, 2]


def _bad_inputs(tmp_path, ckpt, image_path):
    """(argv overrides, text the error must contain)."""
    nan_file = tmp_path / "nan.json"
    nan_file.write_text('{"shape": [1, 2], "dtype": "float32", "data": [[NaN, 0.0]]}')
    wide_file = tmp_path / "wide.json"
    wide_file.write_text(json.dumps({"shape": [1, 3], "dtype": "float32", "data": [[0, 0, 0]]}))
    odd_file = tmp_path / "odd.json"
    odd_file.write_text(json.dumps({"actions": [[0, 0]]}))
    not_image = tmp_path / "not_image.png"
    not_image.write_text("this is not a PNG")
    empty_video = tmp_path / "empty.mp4"
    empty_video.write_bytes(b"")
    corrupt = tmp_path / "corrupt_ckpt"
    shutil.copytree(ckpt, corrupt)
    weights = next((corrupt / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    img = ["--image", str(image_path)]
    fd = ["--mode", "forward_dynamics"]
    return [
        (["--checkpoint", str(tmp_path / "missing"), *img], "missing"),
        (["--checkpoint", str(corrupt), *img], "safetensors"),
        ([*img, "--mode", "dream"], "mode"),
        ([*img, "--domain-name", "no_such_robot"], "domain"),
        ([*img, "--domain-name", "4"], "raw_action_dim"),
        ([*img, "--raw-action-dim", "65"], "raw_action_dim"),
        ([*img, *fd], "action-file"),
        ([*img, *fd, "--action-file", str(odd_file)], str(odd_file)),
        ([*img, *fd, "--action-file", str(nan_file)], str(nan_file)),
        ([*img, *fd, "--action-file", str(wide_file)], "actions"),
        (["--image", str(not_image)], "not_image.png"),
        (["--video", str(empty_video)], "empty.mp4"),
        ([*img, "--condition-frames", "0,7"], "cond_frame_indexes"),
        ([*img, "--num-steps", "0"], "num_inference_steps"),
        ([*img, "--chunk", "0"], "chunk"),
    ]


def test_bad_input_exits_2_with_one_line_naming_the_field(tiny_checkpoint, image_path, tmp_path, capsys):
    for overrides, expected in _bad_inputs(tmp_path, tiny_checkpoint, image_path):
        argv = ["infer", "--checkpoint", str(tiny_checkpoint), "--out", str(tmp_path / "x"), *COMMON]
        argv += overrides  # later flags win in argparse
        capsys.readouterr()
        assert main(argv) == 2, overrides
        err = capsys.readouterr().err.strip().splitlines()
        errors = [line for line in err if "error:" in line]
        assert len(errors) == 1 and expected in errors[0], (overrides, err)
        assert "Traceback" not in "\n".join(err)


def test_console_script_prints_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cosmos3_gym.cli", "infer", "--checkpoint", str(tmp_path / "nope"), "--image",
         str(tmp_path / "nope.png"), "--out", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_make_tiny_checkpoint_command(tmp_path, capsys):
    assert main(["make-tiny-checkpoint", str(tmp_path / "ckpt")]) == 0
    assert "RANDOM" in capsys.readouterr().out
    assert (tmp_path / "ckpt" / "transformer" / "config.json").exists()
    assert main(["make-tiny-checkpoint", str(tmp_path / "ckpt")]) == 2  # refuses to overwrite


def test_inverse_dynamics_video_of_the_wrong_length_is_an_error_naming_the_count(tiny_checkpoint, tmp_path, capsys):
    """Issue 20: a video whose frame count does not match the chunk ran anyway."""
    video = np.random.default_rng(2).integers(0, 256, (7, 64, 64, 3), dtype=np.uint8)
    iio.imwrite(tmp_path / "clip.gif", video, duration=60, loop=0)
    assert infer(tiny_checkpoint, tmp_path / "inv", "--video", str(tmp_path / "clip.gif"),
                 "--mode", "inverse_dynamics", "--no-decode") == 2
    err = capsys.readouterr().err.strip()
    assert "--video: inverse_dynamics with chunk 4 needs 5 frames" in err and "has 7" in err
    assert len(err.splitlines()) == 1


def _all_parsers():
    from cosmos3_gym.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, subparsers.choices


def test_every_option_has_help_and_a_shown_default_and_no_rst_markup():
    from cosmos3_gym.cli import HelpFormatter

    parser, commands = _all_parsers()
    assert "`" not in parser.format_help()
    for name, command in commands.items():
        text = command.format_help()
        assert "`" not in text, name
        formatter = HelpFormatter(name)
        for action in command._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, (name, action.option_strings)
            shown = formatter._get_help_string(action)
            assert action.required or "default" in shown, (name, action.option_strings, shown)


def test_version_flag(capsys):
    from cosmos3_gym import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"cosmos3-gym {__version__}"


def test_cli_import_help_and_argument_errors_do_not_import_torch(tmp_path):
    """Issue 20: the CLI imported torch (12-19 s on a loaded machine) before checking that a file exists."""
    script = (
        "import sys\n"
        "from cosmos3_gym.cli import build_parser, main\n"
        "build_parser().format_help()\n"
        f"codes = [main(['infer', '--checkpoint', 'pusht', '--image', {str(tmp_path / 'no.png')!r}, '--out', 'x']),\n"
        f"         main(['eval', '--initial-states', {str(tmp_path / 'none')!r}, '--out', 'x']),\n"
        f"         main(['eval', '--checkpoint', {str(tmp_path / 'no' / 'ckpt')!r}, '--out', 'x']),\n"
        "         main(['eval-real', '--policies', 'nope'])]\n"
        "heavy = ('torch', 'diffusers', 'stable_baselines3', 'cosmos3_gym.engine')\n"
        "heavy = sorted(m for m in heavy if m in sys.modules)\n"
        "print(codes, heavy)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[2, 2, 2, 2] []"
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 4 and all("error:" in line for line in errors)
    assert "no.png" in errors[0] and "--initial-states" in errors[1] and "--checkpoint" in errors[2]


def test_count_flags_are_checked_first_and_named_as_flags(tmp_path, capsys):
    # eval-real and demo pass --starts / --chunks / --episodes on under other names (num_episodes, num_chunks,
    # episodes); the error must name the flag the user typed, before any model or simulator loads.
    out = ["--out", str(tmp_path / "o")]
    for argv, flag in (
        (["eval-real", "--real-only", "--starts", "0"], "--starts"),
        (["eval-real", "--chunks", "0"], "--chunks"),
        (["demo", "--episodes", "0", *out], "--episodes"),
        (["demo", "--steps-per-episode", "0", *out], "--steps-per-episode"),
    ):
        capsys.readouterr()
        assert main(argv) == 2, argv
        errors = [line for line in capsys.readouterr().err.strip().splitlines() if "error:" in line]
        assert len(errors) == 1 and errors[0].split("error: ", 1)[1].startswith(flag + ":"), (argv, errors)


def test_a_checkpoint_that_does_not_exist_is_reported_before_torch_loads(image_path, tmp_path):
    """Issue 41: `infer --checkpoint /nonexistent` imported torch (4.8 s) before it said the path does not exist."""
    missing = str(tmp_path / "nonexistent")
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"")
    script = (
        "import sys\n"
        "from cosmos3_gym.cli import main\n"
        f"codes = [main(['infer', '--checkpoint', {missing!r}, '--image', {str(image_path)!r}, '--out', 'x']),\n"
        f"         main(['infer', '--checkpoint', 'no_such_model', '--image', {str(image_path)!r}, '--out', 'x']),\n"
        f"         main(['infer', '--checkpoint', {str(a_file)!r}, '--image', {str(image_path)!r}, '--out', 'x']),\n"
        f"         main(['infer', '--checkpoint', 'pusht', '--image', {str(image_path)!r}, '--mode',\n"
        f"               'forward_dynamics', '--action-file', {missing + '.json'!r}, '--out', 'x']),\n"
        f"         main(['demo', '--checkpoint', {missing!r}, '--out', 'x']),\n"
        f"         main(['eval', '--checkpoint', {missing!r}, '--out', 'x'])]\n"
        "print(codes, sorted(m for m in ('torch', 'diffusers') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[2, 2, 2, 2, 2, 2] []"
    errors = result.stderr.strip().splitlines()
    assert len(errors) == 6, errors
    assert errors[0] == f"cosmos3-gym infer: error: --checkpoint: not found: {missing} (expected a checkpoint " \
        "directory, a hub id 'org/name' or a built-in model (pusht))"
    assert "--checkpoint: not found: no_such_model" in errors[1]
    assert "--checkpoint: " + str(a_file) + " is a file" in errors[2]
    assert "--action-file: file not found" in errors[3]
    assert errors[4].startswith("cosmos3-gym demo: error: --checkpoint: not found")
    assert errors[5].startswith("cosmos3-gym eval: error: --checkpoint: not found")


def test_train_help_shows_the_config_defaults():
    """Issue 41: `train --help` said "(default: WorldModelTrainConfig's)" instead of the values. They are read from
    the source (importing the configs imports torch) and must be the dataclasses' own."""
    import dataclasses

    from cosmos3_gym.cli import config_defaults
    from cosmos3_gym.training import VAETrainConfig, WorldModelTrainConfig

    _, commands = _all_parsers()
    for command, config in (("train", WorldModelTrainConfig), ("train-vae", VAETrainConfig)):
        read = config_defaults(config.__name__)
        actual = {f.name: getattr(config(), f.name) for f in dataclasses.fields(config)}
        assert read == {name: actual[name] for name in read}, config.__name__
        text = commands[command].format_help()
        assert "TrainConfig's" not in text
        shown = [a for a in commands[command]._actions if getattr(a, "config_field", None)]
        assert shown and all(a.config_field[1] in read for a in shown), command  # every flag's default was found
    help_text = " ".join(commands["train"].format_help().split())
    assert "--steps STEPS total optimizer steps (default: 20000)" in help_text
    assert '(default: {"policy": 0.4, "forward_dynamics": 0.4, "inverse_dynamics": 0.2})' in help_text
    assert "--state-key STATE_KEY LeRobot datasets: the state feature (read and checked, not trained on) " \
        "(default: none)" in help_text
    assert "--kl-weight KL_WEIGHT weight of the KL term (default: 0.0001)" in " ".join(
        commands["train-vae"].format_help().split())


def test_eval_help_states_no_number_the_checkpoint_decides():
    """Issue 41: --success-threshold's help said 0.95 for PushT while the checkpoint says 0.92. Defaults that come from
    the checkpoint say so; the fallbacks it shows are evaluation's own."""
    from cosmos3_gym.evaluation import FALLBACK_ENV_SETTINGS

    _, commands = _all_parsers()
    text = " ".join(commands["eval"].format_help().split())
    assert "reaches this (default: the checkpoint's meta.json success_threshold, for its own reward model; else " \
        "none)" in text
    assert "0.95" not in text and "0.92" not in text
    helps = {a.option_strings[0]: a.help for a in commands["eval"]._actions if a.option_strings}
    for flag, key in (("--max-episode-steps", "max_episode_steps"), ("--chunk", "chunk"), ("--num-steps", "num_steps"),
                      ("--guidance-scale", "guidance_scale"), ("--resolution-tier", "resolution_tier"),
                      ("--fps", "fps"), ("--domain-name", "domain")):
        assert "(default: the checkpoint's, else " in helps[flag], flag
        fallback = helps[flag].rsplit("else ", 1)[1].rstrip(")")
        assert fallback == FALLBACK_ENV_SETTINGS[key] if key == "domain" else float(fallback) == FALLBACK_ENV_SETTINGS[
            key], (flag, helps[flag])
