"""Multi-frame latent context with latent hand-over (issue 42 item 2): ``Cosmos3Request.context_latents``,
``Cosmos3Engine.encode_frames`` / ``decode_latents``, and the envs' ``handover="latent"`` with ``context_frames`` K.

Everything runs the real tiny model on 96x128 frames at tier 256 (a fixed point of the model's frame size: its
latents are 6x8), temporal compression 4: a chunk of 4 frames generates one latent frame, a chunk of 8 two.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cosmos3_gym.checkpoint import checkpoint_defaults
from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.envs import WorldModelEnv, WorldModelSettings, WorldModelVectorEnv
from cosmos3_gym.errors import InputError
from cosmos3_gym.media import to_uint8

TIER = 256
FAST = dict(domain="pusht", chunk=4, num_steps=2, resolution_tier=TIER)
REQUEST = dict(task="push the T", domain="pusht", num_inference_steps=2, resolution_tier=TIER)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)


def image(seed: int, size=(96, 128)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def action(seed: int, chunk: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1, 1, (chunk, 2)).astype(np.float32)


def forward(chunk: int = 4, seed: int = 3, **fields) -> Cosmos3Request:
    fields.setdefault("observation", None)
    return Cosmos3Request(mode="forward_dynamics", action=action(1, chunk), chunk=chunk, seed=seed, **REQUEST, **fields)


def encoded(engine, *frames) -> torch.Tensor:
    """The latents [N, C, 1, h, w] of start frames (past a ``Spy``: the class's method, not the instance's)."""
    return Cosmos3Engine.encode_frames(engine, np.stack(frames), resolution_tier=TIER)


def last_frame(pixels: torch.Tensor) -> np.ndarray:
    """A result's last decoded frame as the env observes it: uint8 [H, W, 3]."""
    return to_uint8(pixels[:, -1].permute(1, 2, 0).numpy())


class Spy:
    """Records what reaches ``engine.step`` (copies of the requests: their frames and contexts are views of the env's
    state, which the step updates in place) and ``engine.encode_frames`` (the number of frames of each call)."""

    def __init__(self, engine, monkeypatch):
        self.requests: list[list[Cosmos3Request]] = []
        self.results: list[list] = []
        self.encoded: list[int] = []
        step, encode = engine.step, engine.encode_frames

        def spy_step(requests, **kwargs):
            self.requests.append([snapshot(request) for request in requests])
            results = step(requests, **kwargs)
            self.results.append(results)
            return results

        def spy_encode(frames, **kwargs):
            self.encoded.append(len(frames))
            return encode(frames, **kwargs)

        monkeypatch.setattr(engine, "step", spy_step)
        monkeypatch.setattr(engine, "encode_frames", spy_encode)

    @property
    def contexts(self) -> list[list[torch.Tensor | None]]:
        return [[request.context_latents for request in requests] for requests in self.requests]


def snapshot(request: Cosmos3Request) -> Cosmos3Request:
    copy = lambda value: value.clone() if isinstance(value, torch.Tensor) else np.copy(value)  # noqa: E731
    return dataclasses.replace(
        request,
        observation=None if request.observation is None else copy(request.observation),
        context_latents=None if request.context_latents is None else copy(request.context_latents),
    )


# ---------------------------------------------------------------------------------------------------- the engine


def test_encode_frames_encodes_as_a_requests_observation(engine):
    """encode_frames gives exactly the clean latent the engine conditions a request on: one frame, a batch of them
    (as a vector env's step batches its requests), a tensor, and a frame that takes the resampling path."""
    frames = np.stack([image(0), image(1), image(2)])
    batch = engine._prepare_batch([forward(observation=frame) for frame in frames])
    latents = engine.encode_frames(frames, resolution_tier=TIER)
    assert latents.shape == (3, 16, 1, 6, 8) and latents.dtype == torch.float32
    assert torch.equal(latents, torch.cat([p.x0_video for p in batch]))
    alone = engine.prepare(forward(observation=frames[0])).x0_video
    assert torch.equal(engine.encode_frames(torch.from_numpy(frames[:1]), resolution_tier=TIER), alone)
    odd = image(3, size=(100, 130))  # not a multiple of 16: the processor's resampling path
    assert torch.equal(encoded(engine, odd), engine.prepare(forward(observation=odd)).x0_video)


def test_a_context_of_the_encoded_frame_conditions_as_the_observation(engine):
    """K = 1: context_latents = [encode(frame)] with observation None gives exactly the same latents and pixels as
    the request on the frame itself (same seed): the context path conditions identically."""
    frame = image(0)
    context = encoded(engine, frame)[0]
    for decode in ("all", "last"):
        by_frame = engine.step(forward(observation=frame), decode=decode)
        by_context = engine.step(forward(context_latents=context), decode=decode)
        assert torch.equal(by_context.video_latents, by_frame.video_latents)
        assert torch.equal(by_context.pixels, by_frame.pixels)
    assert by_frame.video_latents.shape == (16, 2, 6, 8)
    # any device and dtype: cast to float32 on the engine's device
    from_double = engine.step(forward(context_latents=context.double()))
    assert torch.equal(from_double.video_latents, by_context.video_latents)


def test_a_context_of_two_frames(engine):
    """K = 2, chunk 8: K + chunk / 4 latent frames, the first K the context exactly; the pixels decode from the
    last context frame on ([3, chunk + 1, H, W]); the model sees both context frames."""
    start, other = encoded(engine, image(0), image(1))
    context = torch.cat([start, engine.step(forward(observation=image(0))).video_latents[:, 1:]], dim=1)
    result = engine.step(forward(chunk=8, context_latents=context))
    assert result.video_latents.shape == (16, 2 + 2, 6, 8)
    assert torch.equal(result.video_latents[:, :2], context)
    assert result.pixels.shape == (3, 8 + 1, 96, 128)
    decoded = engine.decode_latents(result.video_latents[None, :, 1:])[0]
    assert torch.allclose(result.pixels, decoded, atol=1e-6)
    last = engine.step(forward(chunk=8, context_latents=context), decode="last")
    assert last.pixels.shape == (3, 1, 96, 128) and torch.allclose(last.pixels[:, 0], result.pixels[:, -1], atol=1e-5)
    # the first context frame matters: another one changes the generated latents (the deterministic pass gives the
    # same bits for the same input; the random tiny model moves them by ~1e-4)
    changed = engine.step(forward(chunk=8, context_latents=torch.cat([other, context[:, 1:]], dim=1)))
    assert (changed.video_latents[:, 2:] - result.video_latents[:, 2:]).abs().max() > 1e-5
    # same seed, same outputs
    again = engine.step(forward(chunk=8, context_latents=context))
    assert torch.equal(again.video_latents, result.video_latents) and torch.equal(again.pixels, result.pixels)


def test_policy_mode_takes_a_context(engine):
    context = encoded(engine, image(0))[0].expand(-1, 3, -1, -1)
    request = Cosmos3Request(
        mode="policy", observation=None, context_latents=context, chunk=8, seed=1, **REQUEST
    )
    result = engine.step(request)
    assert result.action.shape == (8, 2) and result.video_latents.shape == (16, 3 + 2, 6, 8)
    assert torch.equal(result.video_latents[:, :3], context) and result.pixels.shape == (3, 9, 96, 128)


def test_context_requests_batch_together_and_as_alone(engine, monkeypatch):
    """Requests with contexts of one K batch in one denoising pass with each other (a K = 1 context with pixel
    requests of its shape too), with the results each gives alone."""
    start = encoded(engine, image(0), image(1))
    requests = [
        forward(context_latents=start[0].expand(-1, 2, -1, -1), seed=1),
        forward(context_latents=start[1].expand(-1, 2, -1, -1), seed=2),
        forward(context_latents=start[0], seed=3),
        forward(observation=image(1), seed=4),
    ]
    groups = []
    denoise = engine._denoise
    monkeypatch.setattr(engine, "_denoise", lambda group, *args: groups.append(len(group)) or denoise(group, *args))
    engine.step(requests)
    assert sorted(groups) == [2, 2]
    # contexts of different K with the same latent and action shapes decode from different frames: not one group
    # (K = 3, chunk 4 and 4 state rows; K = 2, chunk 8: 4 latent frames and 8 action rows each)
    history = dict(action_history=np.zeros((4, 2), np.float32), action_history_length=4)
    requests += [
        forward(context_latents=start[0].expand(-1, 3, -1, -1), seed=5, **history),
        forward(chunk=8, context_latents=start[0].expand(-1, 2, -1, -1), seed=6),
    ]
    groups.clear()
    together = engine.step(requests)
    assert sorted(groups) == [1, 1, 2, 2]
    assert [result.pixels.shape[1] for result in together[-2:]] == [5, 9]
    monkeypatch.undo()
    for request, result in zip(requests, together):
        alone = engine.step(request)
        assert torch.allclose(result.video_latents, alone.video_latents, atol=1e-5)
        assert torch.allclose(result.pixels, alone.pixels, atol=1e-5)


def test_context_request_errors_name_the_field(engine):
    context = encoded(engine, image(0))[0]
    cases = [
        (dict(mode="inverse_dynamics"), r"context_latents: only modes \['forward_dynamics', 'policy'\]"),
        (dict(cond_frame_indexes=[0]), "cond_frame_indexes: not with context_latents"),
        (dict(chunk=6, action=action(1, 6)), r"context_latents: .*multiple of the VAE's temporal compression \(4\)"),
        (dict(context_latents=context[:8]), r"context_latents: expected \[16, K, h, w\]"),
        (dict(context_latents=context[:, :0]), r"context_latents: expected \[16, K, h, w\] with K >= 1"),
        (dict(context_latents=context[0]), r"context_latents: expected a float tensor \[16, K, h, w\]"),
        (dict(context_latents=context.long()), r"context_latents: expected a float tensor"),
        (dict(context_latents=context.numpy()), r"context_latents: expected a float tensor .*got ndarray"),
        # 30x40 latents stand for 480x640 frames, which tier 256 shrinks onto its 256x320 canvas: 15x20 latents
        (dict(context_latents=torch.zeros(16, 1, 30, 40)), r"context_latents: .*expected a tensor \[16, 1, 15, 20\]"),
    ]
    for change, message in cases:
        fields = dict(mode="forward_dynamics", observation=None, context_latents=context, action=action(1), chunk=4)
        with pytest.raises(InputError, match=message):
            engine.step(Cosmos3Request(**{**fields, **REQUEST, **change}))
    with pytest.raises(InputError, match=r"frames: expected uint8 frames \[N, H, W, 3\]"):
        engine.encode_frames(image(0), resolution_tier=TIER)
    with pytest.raises(InputError, match="frames: expected uint8"):
        engine.encode_frames(image(0)[None].astype(np.float32), resolution_tier=TIER)
    with pytest.raises(InputError, match="frames: expected 'all' or 'last'"):
        engine.decode_latents(context[None], frames="first")


def test_a_context_travels_to_worker_processes(tiny_checkpoint, engine):
    """The client-mode engine sends requests to its workers whole (standard pickle, by value): a context goes with
    them and gives the in-process engine's result."""
    from cosmos3_gym.executors.client import start_engine_client
    from cosmos3_gym.parallel.mesh import ParallelConfig

    request = forward(chunk=8, context_latents=encoded(engine, image(0))[0].expand(-1, 2, -1, -1))
    expected = engine.step(request)
    client = start_engine_client(tiny_checkpoint, ParallelConfig(), device="cpu", dtype="fp32", progress=False)
    try:
        result = client.step(request)
    finally:
        client.close()
    assert torch.equal(result.video_latents, expected.video_latents)
    assert torch.allclose(result.pixels, expected.pixels, atol=1e-5)  # another process's decode: float rounding


# ---------------------------------------------------------------------------------------------------- the settings


def test_settings_errors_name_the_field(engine):
    for kwargs, message in [
        (dict(context_frames=0), "context_frames: expected an integer >= 1, got 0"),
        (dict(context_frames=1.5), "context_frames: expected an integer >= 1"),
        (dict(handover="latents"), r"handover: expected one of \['pixels', 'latent'\], got 'latents'"),
        (dict(context_frames=2), "context_frames: 2 latent frames of context need handover='latent'"),
    ]:
        with pytest.raises(InputError, match=message):
            WorldModelSettings(**{**FAST, **kwargs})
    assert WorldModelSettings(**FAST).handover == "pixels" and WorldModelSettings(**FAST).context_frames == 1
    latent = dict(engine=engine, initial_states=image(0), handover="latent")
    with pytest.raises(InputError, match=r"handover: 'latent' .*multiple of the VAE's temporal compression \(4\)"):
        WorldModelEnv(**{**FAST, **latent, "chunk": 6})
    with pytest.raises(InputError, match="handover_projection: .*handover='latent'"):
        WorldModelEnv(**FAST, **latent, handover_projection=lambda frames: (frames, np.zeros(len(frames), bool)))

    # a WorldModelEngine whose model runs elsewhere (worker processes, Ray) has no encode_frames / decode_latents
    members = ("step", "optimize", "offload", "onload", "close")
    remote = SimpleNamespace(action_dim=64, temporal_compression=4, device=torch.device("cpu"), vae=None,
                             is_output_rank=True, closed=False, **dict.fromkeys(members, lambda *args, **kwargs: None))
    with pytest.raises(InputError, match="handover: 'latent' encodes start frames .* SimpleNamespace"):
        WorldModelEnv(**{**FAST, **latent, "engine": remote})


def test_meta_json_gives_the_hand_over(tiny_checkpoint, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint, checkpoint)
    (checkpoint / "meta.json").write_text(json.dumps({**FAST, "raw_action_dim": 2, "context_frames": 2,
                                                      "handover": "latent"}))
    defaults = checkpoint_defaults(checkpoint)
    assert defaults["context_frames"] == 2 and defaults["handover"] == "latent"
    env = WorldModelEnv(checkpoint, device="cpu", dtype="fp32", initial_states=image(0))
    assert (env.settings.handover, env.settings.context_frames) == ("latent", 2)
    env.reset(seed=0)
    assert env.context_latents().shape == (16, 2, 6, 8)
    env.close()
    (checkpoint / "meta.json").write_text(json.dumps({**FAST, "context_frames": 3}))
    with pytest.raises(InputError, match="context_frames: 3 latent frames of context need handover='latent'"):
        WorldModelEnv(checkpoint, device="cpu", dtype="fp32", initial_states=image(0))


# ---------------------------------------------------------------------------------------------------- the envs


def test_env_hands_over_the_last_k_latents(engine, monkeypatch):
    """K = 2, chunk 8: the start context is [E0, E0]; after a step it is the last 2 of [E0, E0, gen1, gen2]; the next
    request carries it; the observations are those of a manual chain of engine steps with the env's seeds."""
    start = encoded(engine, image(0))[0]
    spy = Spy(engine, monkeypatch)
    settings = dict(FAST, chunk=8, handover="latent", context_frames=2)
    env = WorldModelEnv(engine=engine, initial_states=image(0), **settings)
    env.reset(seed=0)
    assert torch.equal(env.context_latents(), start.expand(-1, 2, -1, -1))
    observations, seeds = [], []
    for i in range(3):
        observation, _, _, _, info = env.step(action(10 + i, 8))
        observations.append(observation["image"])
        seeds.append(info["noise_seed"])
        (request,), (result,), (sent,) = spy.requests[-1], spy.results[-1], spy.contexts[-1]
        assert request.observation is None and request.mode == "forward_dynamics"
        assert result.video_latents.shape == (16, 4, 6, 8)
        assert torch.equal(env.context_latents(), result.video_latents[:, 2:])  # gen1, gen2
        if i == 0:
            assert torch.equal(sent, start.expand(-1, 2, -1, -1))
        else:
            assert torch.equal(sent, spy.results[-2][0].video_latents[:, 2:])
    assert spy.encoded == [1]  # the start frame, once

    context = start.expand(-1, 2, -1, -1)
    for i, seed in enumerate(seeds):
        request = Cosmos3Request(
            mode="forward_dynamics",
            observation=None,
            context_latents=context,
            action=action(10 + i, 8),
            seed=seed,
            **env.settings.request_fields(),
        )
        (chained,) = engine.step([request], decode="last")
        assert np.array_equal(observations[i], last_frame(chained.pixels))
        context = chained.video_latents[:, -2:]


def test_k1_latent_env_starts_as_the_pixel_env(engine, monkeypatch):
    """K = 1: the first chunk is the pixel env's exactly (same start latent, same request); the next one is
    conditioned on the generated latent, not on the decoded frame encoded again."""
    spy = Spy(engine, monkeypatch)
    pixel_env = WorldModelEnv(engine=engine, initial_states=image(0), **FAST)
    latent_env = WorldModelEnv(engine=engine, initial_states=image(0), handover="latent", **FAST)
    pixel_env.reset(seed=5)
    latent_env.reset(seed=5)
    pixel_first = pixel_env.step(action(1))[0]["image"]
    latent_first = latent_env.step(action(1))[0]["image"]
    assert np.array_equal(pixel_first, latent_first)
    assert torch.equal(spy.results[0][0].video_latents, spy.results[1][0].video_latents)

    latent_env.step(action(2))
    pixel_env.step(action(2))
    generated = spy.results[1][0].video_latents[:, -1:]  # the latent env's first chunk's generated latent
    assert spy.requests[2][0].observation is None and torch.equal(spy.contexts[2][0], generated)
    assert spy.requests[3][0].context_latents is None and np.array_equal(spy.requests[3][0].observation, pixel_first)
    assert not torch.allclose(generated, encoded(engine, latent_first)[0], atol=1e-3)  # the frame encoded again
    assert torch.equal(latent_env.context_latents(), spy.results[2][0].video_latents[:, -1:])


def test_imagined_samples_continue_from_the_first(engine, monkeypatch):
    spy = Spy(engine, monkeypatch)
    env = WorldModelEnv(engine=engine, initial_states=image(0), handover="latent", imagination_samples=2, **FAST)
    env.reset(seed=0)
    env.step(action(1))
    first, second = spy.results[-1]
    assert torch.equal(spy.contexts[-1][0], spy.contexts[-1][1])  # both samples from the slot's context
    assert torch.equal(env.context_latents(), first.video_latents[:, -1:])
    assert not torch.equal(first.video_latents, second.video_latents)


def test_reset_with_a_context(engine):
    """reset(options={"context_latents": ...}) continues from a context: the observation is its last latent frame
    decoded (or the given frames), and the next chunk equals the one the context's own env would generate."""
    env = WorldModelEnv(engine=engine, initial_states=image(0), handover="latent", context_frames=2, **FAST)
    env.reset(seed=0)
    env.step(action(1))
    saved = env.context_latents()
    rng_state = env.np_random.bit_generator.state
    expected, *_ = env.step(action(2))

    other = WorldModelEnv(engine=engine, initial_states=image(7), handover="latent", context_frames=2, **FAST)
    observation, info = other.reset(seed=0, options={"context_latents": saved})
    assert info["initial_state_index"] == -1
    decoded = engine.decode_latents(saved[None, :, -1:], frames="last")[0]
    assert np.array_equal(observation["image"], last_frame(decoded))
    assert torch.equal(other.context_latents(), saved)
    other.np_random.bit_generator.state = rng_state
    continued, *_ = other.step(action(2))
    assert np.array_equal(continued["image"], expected["image"])
    observation, _ = other.reset(options={"context_latents": saved, "frames": image(3)})
    assert np.array_equal(observation["image"], image(3)) and torch.equal(other.context_latents(), saved)

    for options, message in [
        (dict(context_latents=saved[:, :1]), r"options\['context_latents'\]: expected a float tensor \[16, 2, 6, 8\]"),
        (dict(context_latents=saved.numpy()), r"options\['context_latents'\]: expected a float tensor"),
        (dict(context_latents=saved, initial_state_index=0), "give either 'context_latents' or 'initial_state_index'"),
    ]:
        with pytest.raises(InputError, match=message):
            other.reset(options=options)
    pixel_env = WorldModelEnv(engine=engine, initial_states=image(0), **FAST)
    with pytest.raises(InputError, match=r"options\['context_latents'\]: a latent context needs handover='latent'"):
        pixel_env.reset(options={"context_latents": saved})
    pixel_env.reset(seed=0)
    with pytest.raises(InputError, match="context_latents: this env hands over in pixels"):
        pixel_env.context_latents()


def test_offload_moves_the_context(engine):
    """offload / onload move the context with the model (recorded: on a CPU engine both ends are the CPU)."""
    env = WorldModelEnv(engine=engine, initial_states=image(0), handover="latent", context_frames=2, **FAST)
    env.reset(seed=0)
    env.step(action(1))
    before = env.context_latents()
    moves = []
    context = env._core._context
    context.to = lambda *args, **kwargs: moves.append(args) or torch.Tensor.to(context, *args, **kwargs)
    env.offload()
    assert moves == [("cpu",)]
    env.onload()  # (on a CPU .to gives the tensor itself, with its recording .to)
    assert moves == [("cpu",), (engine.device,)]
    assert torch.equal(env.context_latents(), before)


def test_vector_env_contexts_per_slot(engine, monkeypatch):
    """Per-slot contexts: a reset of N slots is one encoder call; each slot's request carries its own context and
    keeps its own result's latents; an autoreset encodes the new start; reset options set contexts per slot."""
    spy = Spy(engine, monkeypatch)
    env = WorldModelVectorEnv(3, engine=engine, initial_states=[image(0), image(1)], handover="latent",
                              context_frames=2, max_episode_steps=2, **FAST)
    env.reset(seed=0, options={"initial_state_index": [0, 1, 1]})
    actions = np.stack([action(1), action(2), action(3)])
    env.step(actions)
    assert spy.encoded == [3]  # the three start frames in one call
    starts = encoded(engine, image(0), image(1), image(1))
    sent = spy.contexts[-1]
    for slot in range(3):
        assert torch.equal(sent[slot], starts[slot].expand(-1, 2, -1, -1))
    results = spy.results[-1]
    assert not torch.equal(results[1].video_latents, results[2].video_latents)  # own seeds
    for slot in range(3):
        assert torch.equal(env.context_latents(slot), results[slot].video_latents[:, -2:])

    env.step(actions)  # truncated: max_episode_steps 2
    second = spy.results[-1]
    for slot in range(3):
        assert torch.equal(spy.contexts[-1][slot], results[slot].video_latents[:, -2:])
    env.step(actions)  # NEXT_STEP autoreset: every slot restarts from a new start, unstepped
    frames = [env._core.frame(slot) for slot in range(3)]
    restarts = encoded(engine, *frames)  # as the env encodes them: in one batch (the bits depend on it)
    assert torch.equal(env.context_latents(0), restarts[0].expand(-1, 2, -1, -1))
    assert spy.encoded == [3, 3]  # the new starts of all three in one call
    assert not torch.equal(env.context_latents(0), second[0].video_latents[:, -2:])

    saved = env.context_latents(1)
    observations, infos = env.reset(options={"context_latents": [None, saved, None]})
    assert infos["initial_state_index"][1] == -1
    assert torch.equal(env.context_latents(1), saved)
    env.step(actions)
    assert spy.encoded == [3, 3, 2]  # slots 0 and 2, from their new starts
    assert torch.equal(spy.contexts[-1][1], saved)
    restarts = encoded(engine, observations["image"][0], observations["image"][2])
    assert torch.equal(spy.contexts[-1][0], restarts[0].expand(-1, 2, -1, -1))
    with pytest.raises(InputError, match=r"options\['context_latents'\]: expected a list of 3 latent contexts"):
        env.reset(options={"context_latents": saved})


def test_vector_env_groups_share_a_context(engine):
    env = WorldModelVectorEnv(4, engine=engine, initial_states=image(0), handover="latent", context_frames=2,
                              group_size=2, **FAST)
    context = torch.randn(16, 2, 6, 8, generator=torch.Generator().manual_seed(0))
    env.reset(seed=0, options={"context_latents": [context, None]})
    assert torch.equal(env.context_latents(0), context) and torch.equal(env.context_latents(1), context)
    with pytest.raises(InputError, match=r"options\['context_latents'\]: the slots of a group share their start"):
        env.reset(options={"context_latents": [context, context + 1, None, None]})


def test_engine_and_training_place_the_action_rows_alike(engine, monkeypatch):
    """With K context frames the current frame is context frame K - 1 (time 4(K - 1)): the engine starts the action
    rows there (offset 1 + 4(K - 1)), and training's objective does the same, so a model fine-tuned with K frames
    sees its actions where inference puts them; K = 1 and pixel requests keep diffusers' offset 1."""
    from cosmos3_gym.training.flow_matching import FlowMatchingObjective

    offsets: list = []
    gen_layout = type(engine.transformer).gen_layout

    def spy(self, *args, action_start_offset=1, **kwargs):
        offsets.append(action_start_offset)
        return gen_layout(self, *args, action_start_offset=action_start_offset, **kwargs)

    monkeypatch.setattr(type(engine.transformer), "gen_layout", spy)
    start = encoded(engine, image(0))[0]
    engine.step(forward(chunk=8, context_latents=torch.cat([start, start], dim=1)))
    engine.step(forward(chunk=8, context_latents=start))
    engine.step(forward(chunk=8, observation=image(0)))
    assert [set(rows) for rows in offsets] == [{5}, {1}, {1}]  # per row (conditional and unconditional)
    offsets.clear()

    for k in (1, 2, 3):
        objective = FlowMatchingObjective(engine.transformer, context_frames=k)
        with pytest.raises(_Stop):  # only the layout is wanted: stop the forward pass there
            monkeypatch.setattr(type(engine.transformer), "forward", _raise_stop)
            objective(_training_batch(engine, k))
    assert offsets == [1, 5, 9]


class _Stop(Exception):
    pass


def _raise_stop(*args, **kwargs):
    raise _Stop


def _training_batch(engine, context_frames: int):
    from cosmos3_gym.training.flow_matching import FlowMatchingBatch

    c, d = engine.transformer.config.latent_channel, engine.action_dim
    t = context_frames + 2
    return FlowMatchingBatch(
        prompt_ids=[[1, 2, 3]], fps=[10.0], video=torch.zeros(1, c, t, 6, 8), actions=torch.zeros(1, 8, d),
        raw_action_dims=torch.tensor([2]), domain_ids=torch.tensor([0]), modes=torch.tensor([1]),
        sigmas=torch.tensor([0.5]), video_noise=torch.zeros(1, c, t, 6, 8), action_noise=torch.zeros(1, 8, d),
    )
