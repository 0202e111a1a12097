"""The loss focus: latent cells where a task's mask is set in a window weigh more in the video loss
(``training.data.window_focus``, ``FlowMatchingObjective(focus_weight=...)``), and PushT's block mask."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_training import FPS, TIER, make_dataset, read_log, world_model_config

from cosmos3_gym.errors import InputError
from cosmos3_gym.models.transformer import Cosmos3Transformer, Cosmos3TransformerConfig
from cosmos3_gym.models.vae import Cosmos3VAE
from cosmos3_gym.tasks.pusht.readoff import block_mask
from cosmos3_gym.testing import TINY_TRANSFORMER_CONFIG
from cosmos3_gym.tokenizer import build_tiny_tokenizer
from cosmos3_gym.training.data import build_training_windows, load_focus_mask, read_dataset, window_focus
from cosmos3_gym.training.distributed import init_distributed
from cosmos3_gym.training.flow_matching import FlowMatchingBatch, FlowMatchingObjective
from cosmos3_gym.training.world_model import WorldModelTrainer, sample_batch

RED_SQUARE = "test_loss_focus:red_square"
SIZE = 128  # the dataset's frames: the tiny VAE's latent grid is 8 x 8 cells of 16 px


def red_square(frames: np.ndarray) -> np.ndarray:
    """The focus mask of ``make_dataset``'s episodes: the square's red pixels."""
    return (frames[..., 0] > 200) & (frames[..., 1] < 100)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("focus") / "dataset", num_episodes=2, steps=12, size=SIZE)


@pytest.fixture(scope="module")
def windows(dataset, tiny_checkpoint, tmp_path_factory):
    vae_dir = tiny_checkpoint / "vae"
    return build_training_windows(
        read_dataset(dataset), Cosmos3VAE.from_pretrained(vae_dir), vae_dir, build_tiny_tokenizer(), chunk=4,
        stride=4, resolution_tier=TIER, view_point="ego_view", fps=FPS,
        cache_dir=tmp_path_factory.mktemp("focus_cache"), progress=False,
    )


def expected_focus(frames: np.ndarray, start: int, chunk: int, grid: int) -> np.ndarray:
    """The cells any red pixel of frames start..start+chunk falls in, grown by one cell: pixel by pixel, loops."""
    cell = SIZE // grid
    cells = np.zeros((grid, grid), bool)
    for frame in frames[start : start + chunk + 1]:
        for y, x in zip(*np.nonzero(red_square(frame))):
            cells[y // cell, x // cell] = True
    grown = cells.copy()
    for y, x in zip(*np.nonzero(cells)):
        grown[max(0, y - 1) : y + 2, max(0, x - 1) : x + 2] = True
    return grown


def test_window_focus_marks_where_the_square_is_was_and_goes(dataset, windows):
    info = read_dataset(dataset)
    focus = window_focus(info, windows, red_square, chunk=4, progress=False)
    grid = windows.latent_thw[1]
    assert grid == 8 and focus.shape == (len(windows), grid, grid) and focus.dtype == torch.bool
    for row in range(len(windows)):
        frames = info.episodes.read_frames(int(windows.episode_index[row]))
        want = expected_focus(frames, int(windows.start[row]), 4, grid)
        assert np.array_equal(focus[row].numpy(), want), row
        assert 0 < want.sum() < want.size  # neither empty nor everything: the comparison can fail
    assert len({tuple(f.flatten().tolist()) for f in focus}) > 1  # squares move: windows differ
    # With K = 2 context latents a window also spans the 4 frames before its start (clamped at frame 0).
    with_context = window_focus(info, windows, red_square, chunk=4, context_frames=2, progress=False)
    for row in range(len(windows)):
        frames = info.episodes.read_frames(int(windows.episode_index[row]))
        start = int(windows.start[row])
        first = max(0, start - 4)
        assert np.array_equal(with_context[row].numpy(), expected_focus(frames, first, start + 4 - first, grid)), row


def test_a_mask_of_the_wrong_shape_or_name_is_refused(dataset, windows):
    info = read_dataset(dataset)
    with pytest.raises(InputError, match=r"video_loss_focus: expected a bool mask of shape"):
        window_focus(info, windows, lambda frames: frames[..., 0], chunk=4, progress=False)
    for spec, message in (("red_square", "expected 'module:function'"), ("no_such_module:f", "cannot load"),
                          ("test_loss_focus:SIZE", "is not a function")):
        with pytest.raises(InputError, match=f"video_loss_focus: .*{message}"):
            load_focus_mask(spec)
    assert load_focus_mask(RED_SQUARE) is red_square


def _batch(focus: torch.Tensor) -> FlowMatchingBatch:
    generator = torch.Generator().manual_seed(0)
    b = focus.shape[0]
    return FlowMatchingBatch(
        prompt_ids=[list(range(1, 8))] * b, fps=[FPS] * b, video=torch.randn(b, 16, 3, 4, 4, generator=generator),
        actions=torch.zeros(b, 4, 64), raw_action_dims=torch.full((b,), 2), domain_ids=torch.full((b,), 4),
        modes=torch.tensor([0, 1][:b]), sigmas=torch.tensor([0.7, 0.4][:b]),
        video_noise=torch.randn(b, 16, 3, 4, 4, generator=generator),
        action_noise=torch.randn(b, 4, 64, generator=generator), video_focus=focus,
    )


def test_focused_cells_weigh_more_in_the_video_loss():
    """With weight w the video loss is the mean over noisy entries with the focused ones counted 1 + w times:
    (N L + w n l) / (N + w n), where l is the mean over the focused entries alone (w -> infinity)."""
    cfg = Cosmos3TransformerConfig.from_dict({**TINY_TRANSFORMER_CONFIG, "vocab_size": 64})
    torch.manual_seed(0)
    transformer = Cosmos3Transformer(cfg)
    focus = torch.zeros(2, 4, 4)
    focus[:, 1:3, 0:2] = 1.0  # 4 of 16 cells
    batch = _batch(focus)

    def video_loss(weight: float) -> float:
        objective = FlowMatchingObjective(transformer, action_loss_weight=0.0, focus_weight=weight)
        with torch.no_grad():
            out = objective(batch)
        return float(out["loss"]), out["video_mse"]

    plain, plain_mse = video_loss(0.0)
    only_focus, _ = video_loss(1e9)
    weighted, weighted_mse = video_loss(3.0)
    total, focused = 16, 4  # per noisy latent frame and channel: the ratio is all that matters
    assert weighted == pytest.approx((total * plain + 3.0 * focused * only_focus) / (total + 3.0 * focused), rel=1e-5)
    assert abs(only_focus - plain) > 0.01 * plain  # the focused cells' error differs: the check above can fail
    torch.testing.assert_close(weighted_mse, plain_mse)  # the per-sample MSE reported stays the plain mean
    no_focus = _batch(focus)
    no_focus.video_focus = None
    with torch.no_grad():
        assert float(FlowMatchingObjective(transformer, action_loss_weight=0.0, focus_weight=3.0)(no_focus)["loss"]) \
            == pytest.approx(plain, rel=1e-6)


def test_batches_carry_the_focus_of_their_windows(tmp_path, windows):
    windows.focus = torch.rand(len(windows), 8, 8, generator=torch.Generator().manual_seed(0)) > 0.5
    try:
        batch = sample_batch(windows, torch.Generator().manual_seed(1), world_model_config(tmp_path, batch_size=6),
                             domain_id=4, raw_action_dim=2, action_dim=32, fps=FPS)
        assert torch.equal(batch.video_focus, windows.focus[batch.window_index])
    finally:
        windows.focus = None


def test_the_trainer_computes_the_focus_and_names_bad_settings(tmp_path, dataset, tiny_checkpoint):
    config = world_model_config(tmp_path, steps=2, video_loss_focus=RED_SQUARE, video_loss_focus_weight=4.0)
    trainer = WorldModelTrainer(dataset, tmp_path / "out", config, tiny_checkpoint / "vae", init_distributed("cpu"))
    assert trainer.objective.focus_weight == 4.0
    focus = trainer.windows.focus
    assert focus is not None and focus.shape[0] == len(trainer.windows) and 0 < focus.float().mean() < 1
    trainer.train()
    log = read_log(tmp_path / "out" / "training" / "log.jsonl")
    assert [r["step"] for r in log] == [1, 2] and all(np.isfinite(r["loss"]) for r in log)
    with pytest.raises(InputError, match="video_loss_focus: expected a 'module:function' focus mask"):
        world_model_config(tmp_path, video_loss_focus_weight=1.0).validate()
    with pytest.raises(InputError, match="video_loss_focus_weight: expected a number >= 0"):
        world_model_config(tmp_path, video_loss_focus=RED_SQUARE, video_loss_focus_weight=-1.0).validate()
    with pytest.raises(InputError, match="video_loss_focus: cannot load"):
        WorldModelTrainer(dataset, tmp_path / "bad", world_model_config(
            tmp_path, video_loss_focus="no_such_module:f", video_loss_focus_weight=1.0), tiny_checkpoint / "vae",
            init_distributed("cpu"))


def test_pusht_block_mask_is_the_blocks_pixels():
    frames = np.full((1, 32, 32, 3), 255, np.uint8)
    frames[0, 10:20, 4:8] = (143, 163, 184)  # the block's fill
    frames[0, 2:5, 2:5] = (78, 126, 255)  # the agent
    frames[0, 25:30, 25:30] = (144, 238, 144)  # the target
    mask = block_mask(frames)
    assert mask.dtype == np.bool_ and mask.sum() == 40 and mask[0, 10:20, 4:8].all()
    with pytest.raises(ValueError, match="frames"):
        block_mask(frames[0])


def test_the_train_command_takes_the_focus(tmp_path, dataset, tiny_checkpoint, capsys):
    import json

    from test_training import TINY_MODEL

    from cosmos3_gym import cli

    common = ["train", "--dataset", str(dataset), "--vae", str(tiny_checkpoint / "vae"), "--steps", "1",
              "--batch-size", "2", "--chunk", "4", "--model", json.dumps(TINY_MODEL), "--device", "cpu",
              "--config", json.dumps({"progress": False, "save_every": 0})]
    assert cli.main([*common, "--out", str(tmp_path / "ok"), "--video-loss-focus", RED_SQUARE,
                     "--video-loss-focus-weight", "4"]) == 0
    assert json.loads((tmp_path / "ok" / "training" / "log.jsonl").read_text().splitlines()[-1])["step"] == 1
    assert cli.main([*common, "--out", str(tmp_path / "bad"), "--video-loss-focus", "no_such_module:f",
                     "--video-loss-focus-weight", "4"]) == 2
    assert "video_loss_focus: cannot load 'no_such_module:f'" in capsys.readouterr().err
