"""The engine's eager stages around the GEN forward (the VAE encode of the conditioning frames, the light decoder's
decode) replayed as CUDA graphs (``cuda_graphs.GraphedFunction``, ``Cosmos3Engine.optimize(stage_graphs=...)``).

A replay must read each call's inputs (a stale static buffer would give the first call's output again), follow the
Wan encoder's causal feature cache over several chunks (T = 5 pixel frames: two encoder passes, the second reading
what the first cached, both inside one graph), and give what the eager call gives. The comparison is at float32 with
a tolerance of 1e-5: the replay runs the same kernels on the same shapes as the eager call, so the values agree
(bitwise in practice); the tolerance only absorbs cuDNN picking another algorithm for the graph's buffers. The GPU
tests skip without CUDA; on the CPU the option handling and the row padding are checked.
"""

import numpy as np
import pytest
import torch
from test_cuda_graphs import needs_cuda

from cosmos3_gym.cuda_graphs import replay_padded
from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.errors import InputError
from cosmos3_gym.models.light_decoder import LightDecoder, LightDecoderConfig


def test_stage_graphs_on_cpu_name_the_option(tiny_checkpoint):
    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)
    with pytest.raises(InputError, match="stage_graphs"):
        engine.optimize(stage_graphs=True)
    with pytest.raises(InputError, match="stage_graphs"):
        engine.use_stage_graphs(True)
    from cosmos3_gym.cuda_graphs import GraphedFunction

    with pytest.raises(InputError, match="stage_graphs"):
        GraphedFunction(engine.vae.encode, "cpu", name="stage_graphs")


def test_optimize_on_cpu_keeps_the_eager_stages(tiny_checkpoint):
    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)
    engine.optimize()  # the stage graphs are off unless asked for (the PushT env's fast engine asks)
    assert not engine.stage_graphs
    engine.optimize(stage_graphs=False)
    assert not engine.stage_graphs
    pixels = torch.rand(2, 3, 1, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    assert torch.equal(engine._encode(pixels), engine.vae.encode(pixels))


class _CpuGraph:
    """Stands in for a captured ``torch.cuda.CUDAGraph`` on the CPU: a replay recomputes the function from the static
    inputs into the static outputs, which is what a real replay does."""

    def __init__(self, fn, inputs, outputs, options):
        self.fn, self.inputs, self.outputs, self.options, self.replays = fn, inputs, outputs, options, 0

    def replay(self):
        self.outputs.copy_(self.fn(*self.inputs, **self.options))
        self.replays += 1


def cpu_graphed(fn, max_padding=2.0):
    """A ``GraphedFunction`` whose captures are ``_CpuGraph``s: its own caching, padding and buffer handling on a
    machine without CUDA."""
    from cosmos3_gym.cuda_graphs import GraphedFunction, _FunctionGraph, _GraphCache

    graphed = GraphedFunction.__new__(GraphedFunction)
    _GraphCache.__init__(graphed, 8, max_padding)
    graphed.fn, graphed.device = fn, torch.device("cpu")

    def capture(tensors, options):
        static = [t.clone() for t in tensors]
        outputs = fn(*static, **options).clone()
        return _FunctionGraph(_CpuGraph(fn, static, outputs, options), static, outputs)

    graphed._capture = capture
    return graphed


def rowwise(batch, frames="all"):
    return batch * 2 + (1 if frames == "last" else 0)


@pytest.mark.parametrize("rows, kept, padded", [(3, (), 4), (5, (), 8), (5, (8,), 8), (3, (8,), 4), (4, (4,), 4)])
def test_replay_pads_rows_with_zeros_and_crops_them(rows, kept, padded):
    graphed = cpu_graphed(rowwise)
    for count in kept:
        graphed(torch.ones(count, 1, 2, 3), frames="last")
    batch = torch.arange(rows * 6, dtype=torch.float32).reshape(rows, 1, 2, 3) + 1
    out = replay_padded(graphed, batch, frames="last")
    assert torch.equal(out, rowwise(batch, "last"))  # only the real rows come back
    assert graphed.row_counts(batch, frames="last") == {*kept, padded}
    entry = graphed._graphs[(((padded, 1, 2, 3), torch.float32),), (("frames", "last"),)]
    assert torch.equal(entry.inputs[0][:rows], batch) and not entry.inputs[0][rows:].any()


def test_a_smaller_batch_goes_into_the_kept_graphs_buffer_without_a_padded_copy():
    graphed = cpu_graphed(rowwise, max_padding=None)
    first = torch.rand(8, 3, 4)
    assert torch.equal(graphed.call_padded(first, 8), rowwise(first))
    (entry,) = graphed._graphs.values()
    for rows in (3, 1, 8, 5):
        batch = torch.rand(rows, 3, 4)
        out = replay_padded(graphed, batch)
        assert torch.equal(out, rowwise(batch)) and graphed.num_graphs == 1
        assert torch.equal(entry.inputs[0][:rows], batch) and not entry.inputs[0][rows:].any()
        assert out.data_ptr() != entry.outputs.data_ptr()  # a copy: the next replay overwrites the static outputs
    assert entry.graph.replays == 5  # every call replays the one graph (the first right after its capture)


def pixels(batch, frames, seed, size=(64, 64)):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(batch, 3, frames, *size, generator=g) * 2 - 1).cuda()


@needs_cuda
@pytest.mark.parametrize("frames", [1, 5], ids=["one_frame", "two_chunks"])
def test_graphed_encode_matches_eager_and_reads_new_inputs(tiny_checkpoint, frames):
    from cosmos3_gym.cuda_graphs import GraphedFunction

    vae = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="fp32", progress=False).vae
    graphed = GraphedFunction(vae.encode, "cuda")
    with torch.inference_mode():
        for batch in (1, 3):
            outputs = []
            for seed in (0, 1, 2):  # the first call of a shape captures, the others replay
                x = pixels(batch, frames, seed + 10 * batch)
                ours, eager = graphed(x), vae.encode(x)
                torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
                outputs.append(ours)
            # new content, new latents: a replay that read the captured (stale) inputs would repeat the first
            assert (outputs[1] - outputs[0]).abs().max() > 1e-2 and (outputs[2] - outputs[1]).abs().max() > 1e-2
            kept = outputs[2].clone()  # outputs are copies: a later replay leaves earlier results alone
            graphed(pixels(batch, frames, 99))
            assert torch.equal(kept, outputs[2])
    assert graphed.num_graphs == 2
    assert graphed.row_counts(pixels(2, frames, 0)) == {1, 3}


@needs_cuda
def test_graphs_of_several_batch_sizes_share_one_memory_pool_and_stay_exact():
    """A vector env whose slots finish out of step meets several batch sizes, one graph each. The graphs of one
    ``GraphedFunction`` share a memory pool: four graphs of 64, 32, 16 and 8 rows (captured largest first, as a
    vector env meets them) hold about the first one's activation memory, not the 1.9x that separate pools would,
    and replaying them interleaved still gives each call its own eager result (a graph writing into memory another
    graph's result still lived in would not)."""
    from cosmos3_gym.cuda_graphs import GraphedFunction

    torch.manual_seed(0)
    up, down = torch.randn(256, 65536, device="cuda") / 16, torch.randn(65536, 4, device="cuda") / 256

    def mlp(x):  # a rows x 65536 float32 intermediate (16 MB at 64 rows), a rows x 4 output
        return torch.relu(x @ up) @ down

    graphed = GraphedFunction(mlp, "cuda")
    inputs = {rows: torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).cuda()
              for rows in (64, 32, 16, 8)}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_reserved()
    growth = []
    with torch.inference_mode():
        for x in inputs.values():
            graphed(x)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # drops the warm-up's cached blocks; a graph's pool stays while it lives
            growth.append(torch.cuda.memory_reserved() - start)
        assert graphed.num_graphs == 4
        assert growth[0] >= 16 << 20
        # A pool per graph would add 8 + 4 + 2 MB; a side stream per capture, 32 MiB of cuBLAS workspace per graph.
        assert growth[-1] - growth[0] <= 4 << 20, f"reserved bytes after each graph: {growth}"
        for rows in (8, 64, 16, 32, 64, 8):  # interleaved replays, new values each time
            x = inputs[rows] + rows
            ours = graphed(x)
            torch.testing.assert_close(ours, mlp(x), rtol=1e-4, atol=1e-4)
            assert ours.shape == (rows, 4)
    assert graphed.num_graphs == 4


@needs_cuda
@pytest.mark.parametrize("frames", ["all", "last"])
def test_graphed_light_decode_matches_eager(frames):
    from cosmos3_gym.cuda_graphs import GraphedFunction

    torch.manual_seed(0)
    decoder = LightDecoder(LightDecoderConfig(channels=(8, 8, 6, 4), blocks=(1, 0, 0, 1))).eval().cuda()
    graphed = GraphedFunction(decoder.decode, "cuda")
    with torch.inference_mode():
        for batch in (1, 4):
            previous = None
            for seed in (0, 1):
                latents = torch.randn(batch, 16, 3, 2, 3, generator=torch.Generator().manual_seed(seed)).cuda()
                ours = graphed(latents, frames=frames)
                torch.testing.assert_close(ours, decoder.decode(latents, frames=frames), rtol=1e-5, atol=1e-5)
                if previous is not None:
                    assert (ours - previous).abs().max() > 1e-3
                previous = ours
    assert graphed.num_graphs == 2


@needs_cuda
def test_engine_with_stage_graphs_matches_eager_stages_and_survives_offload(tiny_checkpoint):
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(3)]

    def requests(seed):  # 3 requests: the encode pads them to 4 rows
        return [Cosmos3Request(mode="policy", observation=frame, task="push the block", chunk=8,
                               num_inference_steps=3, guidance_scale=2.0, fps=15.0, seed=seed + i,
                               resolution_tier=256, domain="pusht") for i, frame in enumerate(frames)]

    def engine(stage_graphs):
        loaded = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="fp32", progress=False)
        return loaded.optimize(stage_graphs=stage_graphs)

    graphed, eager = engine(True), engine(None)  # None: the default, off
    assert graphed.stage_graphs and not eager.stage_graphs
    # The graphed encode runs the 3 rows padded to 4, so cuBLAS may pick another kernel for it; on an H200 that moved
    # 2 of 768 latents by 1.9e-4 after 3 guided steps. A wrong row or a stale graph input would be off by O(1).
    for seed in (0, 1):
        ours, reference = graphed.step(requests(seed)), eager.step(requests(seed))
        for a, b in zip(ours, reference):
            np.testing.assert_allclose(a.action, b.action, rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(a.video_latents, b.video_latents, rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(a.pixels, b.pixels, rtol=1e-3, atol=1e-3)
    assert graphed._graphed_encode.num_graphs == 1
    graphed.offload()
    assert graphed._graphed_encode.num_graphs == 0
    again = graphed.step(requests(0))
    np.testing.assert_allclose(again[0].action, eager.step(requests(0))[0].action, rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------- the reward model


def test_reward_model_graphs_need_cuda_and_stay_off_on_cpu():
    from types import SimpleNamespace

    from cosmos3_gym.envs.core import _resolve_reward_model
    from cosmos3_gym.rewards.classifier import ClassifierRewardModel

    model = ClassifierRewardModel(input_size=16, channels=(4, 8))
    with pytest.raises(InputError, match="cuda_graphs"):
        model.use_cuda_graphs()
    assert not model.use_cuda_graphs(False).cuda_graphs
    cpu_engine = SimpleNamespace(stage_graphs=True, device=torch.device("cpu"), vae=None)
    assert not _resolve_reward_model(model, cpu_engine).cuda_graphs  # the env turns them on only on a GPU


@needs_cuda
def test_graphed_reward_scores_match_eager_and_survive_a_move():
    from cosmos3_gym.rewards.classifier import ClassifierRewardModel

    torch.manual_seed(0)
    model = ClassifierRewardModel(input_size=32, channels=(8, 16, 32)).eval().cuda().use_cuda_graphs()
    with torch.inference_mode():
        for batch in (1, 3):  # 3 rows replay a graph of 4 (zero-padded)
            previous = None
            for seed in (0, 1):
                images = torch.rand(batch, 3, 48, 48, generator=torch.Generator().manual_seed(seed + batch)).cuda()
                ours = model.score_frames(images)
                # The graph runs the padded batch (4 rows), for which cuDNN may pick another convolution algorithm
                # than for 3: fp32 scores then differ in the 5th decimal (1e-5 measured on an H200).
                torch.testing.assert_close(ours, model._scores(images), rtol=1e-4, atol=1e-4)
                if previous is not None:
                    assert (ours - previous).abs().max() > 1e-4
                previous = ours
        assert model._graphed_scores.num_graphs == 2
        model.cpu()  # the graphs read the weights at their old addresses: dropped, the eager forward runs on the CPU
        assert model._graphed_scores.num_graphs == 0
        images = torch.rand(2, 3, 48, 48, generator=torch.Generator().manual_seed(5))
        eager_cpu = model.score_frames(images)
        model.cuda()
        torch.testing.assert_close(model.score_frames(images.cuda()).cpu(), eager_cpu, rtol=1e-4, atol=1e-5)
        assert model.cuda_graphs and model._graphed_scores.num_graphs == 1


@needs_cuda
def test_pusht_light_env_with_stage_graphs_matches_eager_stages():
    """The light PushT env (the issue's 1-env latency target), graphed stages (its default on a GPU) against eager
    ones, same seed and actions: the same observations up to a uint8 rounding step and the same rewards up to float
    noise."""
    from cosmos3_gym.tasks.pusht import env as pusht_env

    graphed = pusht_env.make_pusht_vector_env(2, device="cuda", decoder="light")
    eager = pusht_env.make_pusht_vector_env(2, device="cuda", decoder="light")
    try:
        assert graphed.engine.stage_graphs and graphed._core.reward_model.cuda_graphs  # the default
        eager.engine.use_stage_graphs(False)
        eager._core.reward_model.use_cuda_graphs(False)
        assert not eager.engine.stage_graphs and not eager._core.reward_model.cuda_graphs
        assert graphed.engine._graphed_light_decode is not None
        for env in (graphed, eager):
            env.reset(seed=3)
        rng = np.random.default_rng(0)
        for _ in range(3):
            actions = rng.uniform(-1, 1, graphed.action_space.shape).astype(np.float32)
            obs, reward, *_ = graphed.step(actions)
            obs_e, reward_e, *_ = eager.step(actions)
            difference = np.abs(obs["image"].astype(np.int16) - obs_e["image"].astype(np.int16))
            assert difference.max() <= 1 and difference.mean() < 1e-2
            np.testing.assert_allclose(reward, reward_e, atol=1e-3)
        assert graphed.engine._graphed_encode.num_graphs >= 1
        assert graphed.engine._graphed_light_decode.num_graphs >= 1
    finally:
        graphed.close()
        eager.close()


@needs_cuda
def test_pusht_vector_env_replays_its_first_graphs_for_smaller_batches():
    """The PushT vector env owns its engine and pads every smaller batch to the graphs of its first, largest step
    (``set_graph_padding(None)``): slots falling out of step capture nothing more, so memory stays flat."""
    from cosmos3_gym.tasks.pusht import env as pusht_env

    env = pusht_env.make_pusht_vector_env(4, device="cuda", decoder="light")
    try:
        assert env.engine.graph_padding is None and env._core.reward_model._graphed_scores.max_padding is None
        env.reset(seed=0)
        env.step(env.action_space.sample())
        graphs = [env.engine._graphed_forward, env.engine._graphed_encode, env.engine._graphed_light_decode,
                  env._core.reward_model._graphed_scores]
        counts = [graphed.num_graphs for graphed in graphs]
        for slots in ([0], [1, 2], [0, 1, 3]):  # what autoreset leaves stepping
            actions = np.stack([env.single_action_space.sample() for _ in slots])
            env._core.step_slots(slots, actions, [np.random.default_rng(s) for s in slots])
        assert [graphed.num_graphs for graphed in graphs] == counts
    finally:
        env.close()
