"""Issue 21: the released checkpoints' processor options (PhyAI PR49) and the presets that bundle them.

The expected prompt text is PR49's ``Cosmos3TextTokenizeStep._augment`` written out by hand, the composite follows
``Cosmos3RoboLabPolicyProcessor._compose_roboarena_views``, the sigmas are the native RoboLab server's; the JSON path
and the Edge (relu2) checkpoints are compared with diffusers' ``Cosmos3OmniPipeline``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from diffusers import Cosmos3OmniPipeline
from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import CosmosActionCondition
from PIL import Image
from reference import relative_error
from transformers import AutoTokenizer

from cosmos3_gym import presets, processor
from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.errors import InputError
from cosmos3_gym.sampling import make_schedule
from cosmos3_gym.testing import build_tiny_checkpoint

TASK = "put the marker in the bowl"
# PR49's plain prompt for TASK, concat_view + the RoboLab camera description, 33 frames at 15 fps, 544x736 canvas.
PLAIN_PROMPT = (
    "put the marker in the bowl. This video contains concatenated views from multiple camera perspectives. "
    "The top row is from the wrist-mounted camera. The bottom row contains two horizontally concatenated "
    "third-person perspective views of the scene from opposite sides, with the robot visible. "
    "The video is 2.0 seconds long and is of 15 FPS. This video is of 544x736 resolution."
)
# The same input in the JSON format (diffusers' caption + PR49's extra view description in the framing).
JSON_PROMPT = (
    '{"cinematography": {"framing": "This video contains concatenated views from multiple camera perspectives. '
    "The top row is from the wrist-mounted camera. The bottom row contains two horizontally concatenated "
    'third-person perspective views of the scene from opposite sides, with the robot visible."}, '
    '"actions": [{"time": "0:00-0:02", "description": "put the marker in the bowl."}], "duration": "2s", '
    '"fps": 15.0, "resolution": {"H": 544, "W": 736}, "aspect_ratio": "4,3"}'
)


def chat_ids(tokenizer, user_text: str, system: str | None = None) -> list[int]:
    """The Qwen chat layout written out (no chat template involved), then eos and <|vision_start|>."""
    text = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    text += f"<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return ids + [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|vision_start|>")]


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint / "text_tokenizer"))


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):  # hidden_act "silu": a tiny Nano
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def edge_checkpoint(tmp_path_factory):  # hidden_act "relu2": a tiny Edge
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_edge"), seed=3, hidden_act="relu2")


@pytest.fixture(scope="module")
def edge_engine(edge_checkpoint):
    return Cosmos3Engine.from_pretrained(edge_checkpoint, device="cpu", dtype="fp32", progress=False)


def cameras(wrist_hw=(180, 320), exterior_hw=(180, 320), seed=0):
    rng = np.random.default_rng(seed)
    return {
        "observation/wrist_image_left": rng.integers(0, 256, (*wrist_hw, 3), dtype=np.uint8),
        "observation/exterior_image_1_left": rng.integers(0, 256, (*exterior_hw, 3), dtype=np.uint8),
        "observation/exterior_image_2_left": rng.integers(0, 256, (*exterior_hw, 3), dtype=np.uint8),
    }


# ----------------------------------------------------------------------------------------------------------------
# Prompts
# ----------------------------------------------------------------------------------------------------------------


def prompt_ids(tokenizer, prompt_format, use_system_prompt=None, task=TASK):
    return processor.build_prompt_token_ids(
        tokenizer, task, negative_prompt=None, view_point="concat_view", num_frames=33, fps=15.0, height=544,
        width=736, prompt_format=prompt_format, use_system_prompt=use_system_prompt,
        additional_view_description=presets.ROBOLAB_CONCAT_VIEW_DESCRIPTION,
    )


def test_plain_prompt_token_ids_are_pr49s(tokenizer):
    assert processor.build_prompt_text(
        TASK, prompt_format="plain", view_point="concat_view", num_frames=33, fps=15.0, height=544, width=736,
        additional_view_description=presets.ROBOLAB_CONCAT_VIEW_DESCRIPTION,
    ) == PLAIN_PROMPT
    cond, uncond = prompt_ids(tokenizer, "plain")
    assert cond == chat_ids(tokenizer, PLAIN_PROMPT)  # no system prompt by default for plain
    assert uncond == chat_ids(tokenizer, "")
    with_system = prompt_ids(tokenizer, "plain", use_system_prompt=True)[0]
    assert with_system == chat_ids(tokenizer, PLAIN_PROMPT, system=processor._SYSTEM_PROMPT_VIDEO)


def test_plain_prompt_joins_sentences_like_pr49():
    kwargs = dict(prompt_format="plain", view_point="wrist_view", num_frames=17, fps=24.0, height=480, width=832)
    # A task ending in a full stop is joined with a space, an empty task keeps PR49's leading ". ".
    assert processor.build_prompt_text("Stack the blocks.", **kwargs) == (
        "Stack the blocks. This video is captured from a wrist-mounted camera. "
        "The video is 0.0 seconds long and is of 24 FPS. This video is of 480x832 resolution."
    )
    assert processor.build_prompt_text("", **kwargs).startswith(". This video is captured from a wrist-mounted")


def test_json_prompt_with_view_description(tokenizer):
    cond, uncond = prompt_ids(tokenizer, "json", use_system_prompt=False)
    assert cond == chat_ids(tokenizer, JSON_PROMPT) and uncond == chat_ids(tokenizer, "")
    # Without the extra description the JSON prompt is diffusers' caption, system prompt included by default.
    ids = processor.build_prompt_token_ids(
        tokenizer, TASK, negative_prompt=None, view_point="ego_view", num_frames=33, fps=15.0, height=544, width=736
    )[0]
    caption = Cosmos3OmniPipeline._build_action_json_prompt(
        TASK, view_point="ego_view", num_frames=33, fps=15.0, height=544, width=736
    )
    assert ids == chat_ids(tokenizer, caption, system=processor._SYSTEM_PROMPT_VIDEO)


def test_prompt_format_auto_follows_hidden_act():
    assert processor.resolve_prompt_format("auto", "silu") == "plain"
    assert processor.resolve_prompt_format("auto", "relu2") == "json"
    assert processor.resolve_prompt_format("json", "silu") == "json"
    with pytest.raises(InputError, match="prompt_format"):
        processor.resolve_prompt_format("yaml", "silu")
    with pytest.raises(InputError, match="prompt_format"):
        processor.resolve_prompt_format("auto", "gelu")


@pytest.mark.parametrize("which", ["nano", "edge"])
def test_auto_detection_on_tiny_checkpoints(which, engine, edge_engine, tokenizer):
    eng = engine if which == "nano" else edge_engine
    expected_format = "plain" if which == "nano" else "json"
    request = Cosmos3Request(
        mode="policy", observation=np.zeros((64, 64, 3), np.uint8), task=TASK, domain="pusht", chunk=4,
        resolution_tier=256, prompt_format="auto", use_system_prompt=False, seed=0,
    )
    prepared = eng.prepare(request, encode=False)
    expected = processor.build_prompt_token_ids(
        eng.tokenizer, TASK, negative_prompt=None, view_point="ego_view", num_frames=5, fps=15.0, height=256,
        width=256, prompt_format=expected_format, use_system_prompt=False,
    )
    assert (prepared.cond_ids, prepared.uncond_ids) == expected
    other = processor.build_prompt_token_ids(
        eng.tokenizer, TASK, negative_prompt=None, view_point="ego_view", num_frames=5, fps=15.0, height=256,
        width=256, prompt_format="json" if expected_format == "plain" else "plain", use_system_prompt=False,
    )
    assert prepared.cond_ids != other[0]


# ----------------------------------------------------------------------------------------------------------------
# State rows and the gripper flip
# ----------------------------------------------------------------------------------------------------------------


def test_flip_round_trips_and_touches_only_the_gripper():
    actions = np.random.default_rng(0).uniform(0, 1, (5, 8)).astype(np.float32)
    flipped = processor.flip_gripper(actions)
    np.testing.assert_array_equal(flipped[:, :7], actions[:, :7])
    np.testing.assert_array_equal(flipped[:, 7], 1.0 - actions[:, 7])
    np.testing.assert_allclose(processor.flip_gripper(flipped), actions, atol=1e-7)
    tensor = torch.from_numpy(actions.copy())
    assert torch.equal(processor.flip_gripper(tensor)[:, 7], 1.0 - tensor[:, 7])
    assert torch.equal(tensor, torch.from_numpy(actions))  # inputs are never modified


def test_history_rows_are_clean_and_come_first():
    state = np.array([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.9], [1, 2, 3, 4, 5, 6, 7, 0.25]], np.float32)
    rows, clean = processor.prepare_action_rows("policy", 4, 8, history=state, history_length=1, flip=True)
    assert rows.shape == (5, 64) and clean == [0]
    np.testing.assert_allclose(rows[0, :8].numpy(), [1, 2, 3, 4, 5, 6, 7, 0.75])  # the LAST state row, flipped
    assert torch.count_nonzero(rows[0, 8:]) == 0 and torch.count_nonzero(rows[1:]) == 0

    chunk = np.random.default_rng(1).uniform(0, 1, (3, 8)).astype(np.float32)
    rows, clean = processor.prepare_action_rows(
        "forward_dynamics", 4, 8, actions=chunk, history=state, history_length=2, flip=False
    )
    assert rows.shape == (6, 64) and clean == list(range(6))
    np.testing.assert_array_equal(rows[:2, :8].numpy(), state)
    np.testing.assert_array_equal(rows[2:5, :8].numpy(), chunk)
    np.testing.assert_array_equal(rows[5, :8].numpy(), chunk[-1])  # a short chunk repeats its last row

    # No history: exactly diffusers' layout.
    rows, clean = processor.prepare_action_rows("forward_dynamics", 4, 8, actions=chunk)
    assert torch.equal(rows, processor.prepare_action_chunk(chunk, 4, 8)) and clean == [0, 1, 2, 3]
    with pytest.raises(InputError, match="action_history"):
        processor.prepare_action_rows("policy", 4, 8, history_length=1)
    with pytest.raises(InputError, match="action_history"):
        processor.prepare_action_rows("policy", 4, 8, history=state[:, :7], history_length=1)
    with pytest.raises(InputError, match="action_history"):
        processor.prepare_action_rows("policy", 4, 8, history=state, history_length=3)


def test_state_rows_take_the_positions_before_the_chunk(engine):
    """With one state row the action positions start at 0 (PR49: 1 - history): the chunk keeps diffusers'
    positions and the state row sits at video frame 0's time."""
    model = engine.transformer
    text_lengths, thw, chunk = [7], (2, 2, 2), 8
    plain = model.gen_layout(text_lengths, thw, chunk, 15.0)
    with_state = model.gen_layout(text_lengths, thw, chunk + 1, 15.0, action_start_offset=0)
    video = plain.num_video_tokens
    assert torch.equal(with_state.cos[..., video + 1 :, :], plain.cos[..., video:, :])
    assert torch.equal(with_state.cos[..., :video, :], plain.cos[..., :video, :])
    # The state row has time position of video frame 0 and h = w = 0, i.e. the first video token's rotation.
    assert torch.allclose(with_state.cos[..., video, :], plain.cos[..., 0, :])


def test_engine_drops_state_rows_and_flips_back(engine):
    state = np.array([[0.1, -0.2, 0.3, 0.0, 0.5, -0.6, 0.7, 0.8]], np.float32)
    chunk_actions = np.random.default_rng(2).uniform(0, 1, (4, 8)).astype(np.float32)
    base = dict(observation=np.full((64, 64, 3), 90, np.uint8), task="push", domain=8, raw_action_dim=8, chunk=4,
                num_inference_steps=2, resolution_tier=256, seed=5, action_history_length=1, flip_gripper=True)

    prepared = engine.prepare(Cosmos3Request(mode="policy", action_history=state, **base), encode=False)
    assert prepared.x0_actions.shape == (5, 64) and prepared.clean_rows == [0] and prepared.history_rows == 1
    np.testing.assert_allclose(prepared.x0_actions[0, :8].numpy(), [0.1, -0.2, 0.3, 0.0, 0.5, -0.6, 0.7, 0.2])

    result = engine.step(Cosmos3Request(mode="policy", action_history=state, **base), decode=False)
    assert result.action.shape == (4, 8)  # the state row is dropped
    moved = engine.step(Cosmos3Request(mode="policy", action_history=state + 0.5, **base), decode=False)
    assert np.abs(moved.action - result.action).max() > 1e-4  # the state conditions the policy

    forward = engine.step(
        Cosmos3Request(mode="forward_dynamics", action=chunk_actions, action_history=state, **base), decode=False
    )
    np.testing.assert_allclose(forward.action, chunk_actions, atol=1e-6)  # flipped in, flipped back out


# ----------------------------------------------------------------------------------------------------------------
# The RoboLab composite and the native canvas
# ----------------------------------------------------------------------------------------------------------------


def server_resize(image: np.ndarray, size) -> np.ndarray:
    """The RoboLab server's resize: torch bilinear, half-pixel centres, then a truncating uint8 cast."""
    tensor = torch.from_numpy(image).permute(2, 0, 1)[None].float()
    out = torch.nn.functional.interpolate(tensor, size=size, mode="bilinear", align_corners=False)
    return out[0].permute(1, 2, 0).numpy().astype(np.uint8)


def test_composite_geometry_wrist_on_top():
    obs = cameras(wrist_hw=(360, 640), exterior_hw=(720, 1280))  # composite is exactly 540x640: no final resize
    image = presets.robolab_composite(obs)
    assert image.shape == (540, 640, 3) and image.dtype == np.uint8
    np.testing.assert_array_equal(image[:360], obs["observation/wrist_image_left"])
    left, right = obs["observation/exterior_image_1_left"], obs["observation/exterior_image_2_left"]
    np.testing.assert_array_equal(image[360:, :320], server_resize(left, (180, 320)))
    np.testing.assert_array_equal(image[360:, 320:], server_resize(right, (180, 320)))

    # DROID's own 180x320 cameras: the 270x320 composite is resized to 540x640; the short names work the same.
    small = cameras(seed=1)
    short = dict(zip(presets.ROBOLAB_CAMERA_KEYS[1], small.values()))
    composite = np.concatenate([
        small["observation/wrist_image_left"],
        np.concatenate([server_resize(small["observation/exterior_image_1_left"], (90, 160)),
                        server_resize(small["observation/exterior_image_2_left"], (90, 160))], axis=1),
    ])
    expected = server_resize(composite, (540, 640))
    np.testing.assert_array_equal(presets.robolab_composite(small), expected)
    np.testing.assert_array_equal(presets.robolab_composite(short), expected)
    np.testing.assert_array_equal(presets.robolab_composite({"observation/image": composite}), expected)
    with pytest.raises(InputError, match="observation"):
        presets.robolab_composite({"observation/wrist_image_left": composite})


def test_native_canvas_keeps_the_composite_unscaled():
    image = presets.robolab_composite(cameras(seed=2))
    native = processor.prepare_conditioning(image, 480, 1, canvas="native")
    assert native.canvas_hw == (544, 736) and native.content_hw == (540, 640) and native.latent_hw == (33, 40)
    content = torch.from_numpy(image.astype(np.float32) / 255.0 * 2.0 - 1.0).permute(2, 0, 1)
    pixels = native.pixels[0, :, 0]
    assert torch.equal(pixels[:, :540, :640], content)  # no resampling of the content
    assert torch.equal(pixels[:, 540:, :640], content.flip(1)[:, 1:5])  # reflect pad of the bottom 4 rows
    assert torch.equal(pixels[:, :540, 640:], content.flip(2)[:, :, 1:97])  # and of the right 96 columns
    # diffusers' canvas first snaps the frame down to 528 rows, a different content grid.
    assert processor.prepare_conditioning(image, 480, 1).content_hw == (528, 640)
    with pytest.raises(InputError, match="canvas"):
        processor.prepare_conditioning(image, 480, 1, canvas="stretch")


def test_native_flow_schedule_is_the_robolab_servers(engine):
    """Native cosmos' linear flow grid, shift 5, 4 steps (cosmos3.md section 4), not the config's Karras sigmas."""
    robolab = presets.get_preset("droid_robolab")
    schedule = make_schedule(
        robolab.num_inference_steps, {**engine.scheduler_config, "use_karras_sigmas": True},
        flow_shift=robolab.flow_shift, use_karras_sigmas=robolab.use_karras_sigmas,
        use_native_flow_schedule=robolab.use_native_flow_schedule,
    )
    np.testing.assert_allclose(schedule.sigmas, [0.9998, 0.9373, 0.8331, 0.6247, 0.0], atol=5e-5)
    assert schedule.timesteps.tolist() == [999, 937, 833, 624]


# ----------------------------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------------------------


def test_presets_fill_defaults_and_explicit_values_win():
    request = Cosmos3Request(mode="policy", observation=None, preset="droid_robolab", num_inference_steps=8)
    resolved = presets.resolve_request(request)
    assert resolved.preset is None and resolved.num_inference_steps == 8  # set by the caller: kept
    assert (resolved.raw_action_dim, resolved.chunk, resolved.fps, resolved.guidance_scale) == (8, 32, 15.0, 3.0)
    assert (resolved.flow_shift, resolved.use_karras_sigmas, resolved.use_native_flow_schedule) == (5.0, False, True)
    assert (resolved.prompt_format, resolved.use_system_prompt, resolved.view_point) == ("auto", False, "concat_view")
    assert (resolved.action_history_length, resolved.flip_gripper, resolved.canvas) == (1, True, "native")
    # A new field set explicitly wins even when it is diffusers' value.
    explicit = Cosmos3Request(mode="policy", observation=None, preset="droid_robolab", prompt_format="json",
                              flip_gripper=False, action_history_length=0)
    resolved = presets.resolve_request(explicit)
    assert (resolved.prompt_format, resolved.flip_gripper, resolved.action_history_length) == ("json", False, 0)
    # Without a preset the unset fields mean diffusers' behaviour, which is also what the "diffusers" preset says.
    plain = Cosmos3Request(mode="policy", observation=None)
    diffusers_like = dataclasses.replace(plain, prompt_format="json", canvas="diffusers", action_history_length=0,
                                         flip_gripper=False, use_native_flow_schedule=False)
    assert presets.resolve_request(plain) == diffusers_like
    assert presets.resolve_request(plain, "diffusers") == dataclasses.replace(diffusers_like, use_system_prompt=True)
    settings = presets.resolve_settings("droid_robolab", {"domain": "droid_lerobot", "chunk": 16})
    assert settings["chunk"] == 16 and settings["raw_action_dim"] == 8 and settings["domain"] == "droid_lerobot"
    with pytest.raises(InputError, match="preset"):
        presets.resolve_request(Cosmos3Request(mode="policy", observation=None, preset="nano"))
    with pytest.raises(InputError, match="preset"):
        Cosmos3Engine.from_pretrained("/nonexistent", preset="nano")


def test_droid_robolab_request_is_pr49s(engine, tokenizer):
    """One RoboLab observation through the preset: PR49's prompt tokens, clean-row layout, action width, canvas."""
    obs = cameras(seed=4)
    state = np.array([[0.0, -0.5, 0.1, -2.0, 0.05, 1.8, 0.7, 0.3]], np.float32)
    request = Cosmos3Request(mode="policy", observation=obs, task=TASK, action_history=state, preset="droid_robolab",
                             seed=0)
    prepared = engine.prepare(request, encode=False)
    assert (prepared.cond_ids, prepared.uncond_ids) == (chat_ids(tokenizer, PLAIN_PROMPT), chat_ids(tokenizer, ""))
    assert prepared.raw_action_dim == 8 and prepared.domain_id == 8
    assert prepared.x0_actions.shape == (33, 64) and prepared.clean_rows == [0] and prepared.history_rows == 1
    np.testing.assert_allclose(prepared.x0_actions[0, :8].numpy(), [0.0, -0.5, 0.1, -2.0, 0.05, 1.8, 0.7, 0.7])
    assert prepared.latent_thw == (9, 33, 40) and prepared.clean_frames == [0]
    assert tuple(prepared.pixels.shape[-2:]) == (544, 736)
    expected = processor.prepare_conditioning(presets.robolab_composite(obs), 480, 1, canvas="native").pixels
    assert torch.equal(prepared.pixels, expected)
    assert prepared.schedule.timesteps.tolist() == [999, 937, 833, 624]

    # The engine-wide preset gives the same request.
    robolab_engine = Cosmos3Engine(engine.transformer, engine.vae, engine.tokenizer, engine.scheduler_config,
                                   progress=False)
    robolab_engine.preset = "droid_robolab"
    again = robolab_engine.prepare(dataclasses.replace(request, preset=None), encode=False)
    assert again.cond_ids == prepared.cond_ids and torch.equal(again.x0_actions, prepared.x0_actions)


# ----------------------------------------------------------------------------------------------------------------
# Edge (relu2) checkpoints: the engine against diffusers' pipeline, in every mode
# ----------------------------------------------------------------------------------------------------------------


def image(seed: int, size=(200, 280)) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def edge_pipeline(edge_checkpoint):
    pipe = Cosmos3OmniPipeline.from_pretrained(edge_checkpoint, enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.parametrize("prompt_format", ["json", "auto", "plain"])
@pytest.mark.parametrize("mode", ["policy", "forward_dynamics", "inverse_dynamics"])
def test_edge_engine_matches_pipeline(edge_pipeline, edge_engine, mode, prompt_format, monkeypatch):
    """"json" and "auto" (JSON on relu2) are diffusers exactly; for "plain" the pipeline is handed the same plain
    text without the system prompt, so only the prompt may differ between the two paths."""
    chunk, seed, guidance, steps, fps = 4, 7, 2.0, 2, 15.0
    actions = np.random.default_rng(0).uniform(-1, 1, (chunk, 2)).astype(np.float32)
    obs = [image(s) for s in range(chunk + 1)] if mode == "inverse_dynamics" else image(1)
    use_system_prompt = None
    if prompt_format == "plain":
        use_system_prompt = False
        monkeypatch.setattr(Cosmos3OmniPipeline, "_build_action_json_prompt", staticmethod(
            lambda description, **kw: processor.build_prompt_text(description, prompt_format="plain", **kw)))
    condition = CosmosActionCondition(
        mode=mode, chunk_size=chunk, domain_name="pusht", resolution_tier=256,
        raw_actions=torch.as_tensor(actions) if mode == "forward_dynamics" else None,
        image=None if isinstance(obs, list) else obs, video=obs if isinstance(obs, list) else None,
    )
    reference = edge_pipeline(
        prompt="push the block", action=condition, num_inference_steps=steps, guidance_scale=guidance, fps=fps,
        generator=torch.Generator().manual_seed(seed), output_type="latent", enable_safety_check=False,
        use_system_prompt=use_system_prompt,
    )
    ours = edge_engine.step(Cosmos3Request(
        mode=mode, observation=obs, task="push the block", domain="pusht", chunk=chunk, num_inference_steps=steps,
        guidance_scale=guidance, fps=fps, seed=seed, resolution_tier=256, prompt_format=prompt_format,
        action=actions if mode == "forward_dynamics" else None,
    ), decode=False)
    assert relative_error(ours.video_latents, reference.video[0]) < 1e-4
    if mode != "forward_dynamics":
        assert relative_error(ours.action, reference.action[0]) < 1e-4


# ----------------------------------------------------------------------------------------------------------------
# The policy agent with a preset
# ----------------------------------------------------------------------------------------------------------------


def test_policy_agent_with_the_robolab_preset(engine):
    from cosmos3_gym.agents import PolicyAgent

    obs = {**cameras(seed=6), "observation/joint_position": np.linspace(-1, 1, 7, dtype=np.float32),
           "observation/gripper_position": np.array([0.25], np.float32)}
    agent = PolicyAgent(engine, TASK, preset="droid_robolab", num_steps=1, seed=0)
    assert (agent.raw_action_dim, agent.chunk, agent.fps, agent.action_history_length) == (8, 32, 15.0, 1)
    action = agent.act(obs)
    assert action.shape == (32, 8)
    seed = int(np.random.default_rng(0).integers(0, 2**63))
    state = np.concatenate([obs["observation/joint_position"], obs["observation/gripper_position"]])[None]
    direct = engine.step(Cosmos3Request(mode="policy", observation=obs, task=TASK, action_history=state,
                                        num_inference_steps=1, seed=seed, preset="droid_robolab"), decode=False)
    np.testing.assert_array_equal(action, direct.action)  # raw actions: not clipped
    with pytest.raises(InputError, match="state"):
        agent.act(cameras(seed=6))
    # An engine loaded with the preset gives its agents the same settings.
    preset_engine = Cosmos3Engine(engine.transformer, engine.vae, engine.tokenizer, engine.scheduler_config,
                                  progress=False)
    preset_engine.preset = "droid_robolab"
    inherited = PolicyAgent(preset_engine, TASK, num_steps=1, seed=0)
    assert inherited.preset == "droid_robolab" and inherited.raw_action_dim == 8
    np.testing.assert_array_equal(inherited.act(obs), action)


# ----------------------------------------------------------------------------------------------------------------
# The env with a preset keeps the executed actions as the state rows
# ----------------------------------------------------------------------------------------------------------------


def test_env_sends_the_last_executed_rows_as_state(engine, monkeypatch):
    import gymnasium as gym

    import cosmos3_gym  # noqa: F401  (registers the envs)
    from cosmos3_gym.engine import Cosmos3Result

    sent = []

    def record(requests, decode=None):  # the env's bookkeeping only: the model's frames do not matter here
        sent.extend(requests)
        return [Cosmos3Result(r.mode, r.action, torch.zeros(1), torch.rand(3, r.chunk + 1, 528, 640), r.seed)
                for r in requests]

    monkeypatch.setattr(engine, "step", record)
    frame = np.random.default_rng(7).integers(0, 256, (540, 640, 3), dtype=np.uint8)
    env = gym.make("cosmos3_gym/WorldModel-v0", engine=engine, preset="droid_robolab", initial_states=frame,
                   chunk=8, num_steps=1, task=TASK)
    assert env.action_space.shape == (8, 8)  # the preset's 8-D joint positions
    env.reset(seed=0)
    first = np.random.default_rng(0).uniform(-1, 1, (8, 8)).astype(np.float32)
    second = np.random.default_rng(1).uniform(-1, 1, (8, 8)).astype(np.float32)
    obs, *_ = env.step(first)
    env.step(second)
    assert [r.preset for r in sent] == ["droid_robolab"] * 2 and all(r.action_history_length == 1 for r in sent)
    np.testing.assert_array_equal(sent[0].action_history, first[:1])  # episode start: the first target
    np.testing.assert_array_equal(sent[1].action_history, first[-1:])  # then the last executed row
    assert obs["image"].shape == (528, 640, 3)
    prepared = engine.prepare(sent[1], encode=False)  # what the real engine makes of the request
    assert prepared.history_rows == 1 and prepared.latent_thw == (3, 33, 40) and prepared.raw_action_dim == 8
    np.testing.assert_allclose(prepared.x0_actions[0, :8].numpy(), processor.flip_gripper(first[-1]))
    env.reset(seed=1)
    env.step(second)
    np.testing.assert_array_equal(sent[2].action_history, second[:1])  # a new episode forgets the old state
    env.close()


# ----------------------------------------------------------------------------------------------------------------
# The CLI
# ----------------------------------------------------------------------------------------------------------------


def test_cli_preset_prompt_format_and_state(tiny_checkpoint, engine, tmp_path):
    from cosmos3_gym.cli import main

    frame = tmp_path / "robolab.png"
    Image.fromarray(presets.robolab_composite(cameras(seed=8))).save(frame)
    state = [0.1, -0.4, 0.0, -2.1, 0.0, 1.9, 0.8, 0.05]
    args = ["infer", "--checkpoint", str(tiny_checkpoint), "--image", str(frame), "--prompt", TASK, "--device", "cpu",
            "--no-decode", "--num-steps", "1", "--chunk", "8", "--seed", "3"]
    assert main([*args, "--out", str(tmp_path / "robolab"), "--preset", "droid_robolab",
                 "--state", ",".join(map(str, state))]) == 0
    written = processor.load_action_file(tmp_path / "robolab_action.json")
    expected = engine.step(Cosmos3Request(mode="policy", observation=str(frame), task=TASK, preset="droid_robolab",
                                          action_history=[state], num_inference_steps=1, chunk=8, seed=3), decode=False)
    assert written.shape == (8, 8)
    np.testing.assert_allclose(written, expected.action, atol=1e-6)

    assert main([*args, "--out", str(tmp_path / "plain"), "--domain-name", "pusht", "--resolution-tier", "256",
                 "--prompt-format", "plain"]) == 0
    plain = engine.step(Cosmos3Request(mode="policy", observation=str(frame), task=TASK, domain="pusht",
                                       resolution_tier=256, prompt_format="plain", num_inference_steps=1, chunk=8,
                                       seed=3),
                        decode=False)
    np.testing.assert_allclose(processor.load_action_file(tmp_path / "plain_action.json"), plain.action, atol=1e-6)
    assert main([*args, "--out", str(tmp_path / "bad"), "--preset", "droid_robolab", "--state", "a,b"]) == 2


# ----------------------------------------------------------------------------------------------------------------
# WorldModelSettings carries the preset fields (envs and agents)
# ----------------------------------------------------------------------------------------------------------------


def test_settings_apply_a_preset_and_explicit_values_win():
    from cosmos3_gym.envs import WorldModelSettings

    robolab = WorldModelSettings(preset="droid_robolab", chunk=16)
    assert (robolab.raw_action_dim, robolab.chunk, robolab.action_history_length, robolab.flip_gripper) == \
        (8, 16, 1, True)  # the preset's width and state row; the explicit chunk kept
    assert robolab.history_length == 1 and WorldModelSettings().history_length == 0
    fields = robolab.request_fields()
    assert (fields["preset"], fields["num_inference_steps"], fields["prompt_format"]) == ("droid_robolab", 4, "auto")
    assert "num_steps" not in fields
    # A preset given later (build / replace) replaces a width derived from the domain, not an explicit one.
    assert WorldModelSettings().replace(preset="droid_robolab").raw_action_dim == 8
    assert WorldModelSettings(domain="pusht").replace(preset="diffusers").raw_action_dim == 2
    assert WorldModelSettings(preset="droid_robolab", flip_gripper=False).flip_gripper is False
    request = Cosmos3Request(mode="policy", observation=None, **robolab.request_fields())
    assert presets.resolve_request(request).canvas == "native"  # the engine fills the rest of the preset
    for bad, match in ((dict(preset="nano"), "preset"), (dict(prompt_format="yaml"), "prompt_format"),
                       (dict(flip_gripper="yes"), "flip_gripper"), (dict(action_history_length=-1),
                                                                    "action_history_length")):
        with pytest.raises(InputError, match=match):
            WorldModelSettings(**bad)


def test_load_engine_gives_the_preset_to_the_workers(tiny_checkpoint, stub_engine_client):
    from cosmos3_gym import launcher

    started = stub_engine_client
    assert launcher.load_engine(tiny_checkpoint, dp=2, preset="droid_robolab") == "client"
    assert started[0][2]["preset"] == "droid_robolab"
    with pytest.raises(InputError, match="preset"):  # before any worker starts
        launcher.load_engine(tiny_checkpoint, dp=2, preset="nano")
    assert len(started) == 1
    assert launcher.load_engine(tiny_checkpoint, device="cpu", dtype="fp32", progress=False,
                                preset="droid_robolab").preset == "droid_robolab"
