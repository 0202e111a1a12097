"""The CUDA-graphed GEN forward (``Cosmos3Engine.optimize()`` on a GPU) against the plain forward.

The replay must read each call's inputs (not the ones it was captured with), keep one graph per signature, and give
the engine the same results as without graphs. The GPU tests run on the lent GPUs (skipped here without CUDA); on
CPU only the errors are checked.
"""

import numpy as np
import pytest
import torch

from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.errors import InputError
from cosmos3_gym.models.transformer import TextKV


def needs_cuda(test):
    """GPU tests carry the ``gpu`` marker (``pytest -m "not gpu"`` leaves them out) and skip without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def test_cuda_graphs_on_cpu_name_the_option(tiny_checkpoint):
    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)
    with pytest.raises(InputError, match="cuda_graphs"):
        engine.optimize(cuda_graphs=True)
    from cosmos3_gym.cuda_graphs import GraphedGenForward

    with pytest.raises(InputError, match="cuda_graphs"):
        GraphedGenForward(engine.transformer)


def test_optimize_on_cpu_keeps_the_plain_forward(tiny_checkpoint):
    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)
    engine.optimize()
    assert engine.gen_forward is engine.transformer


def forward_inputs(model, lengths, seed, timestep=900, chunk=8, thw=(3, 4, 6)):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in lengths]
    text = TextKV.stack([model.encode_text([p]) for p in prompts])
    batch = len(lengths)
    layout = model.gen_layout(text.lengths, thw, chunk, 15.0)
    dev = model.device
    video = torch.randn(batch, model.config.latent_channel, *thw, generator=g).to(dev)
    noisy_v = torch.ones(batch, thw[0], dtype=torch.bool, device=dev)
    noisy_v[:, 0] = False
    actions = torch.randn(batch, chunk, model.config.action_dim, generator=g).to(dev)
    noisy_a = torch.ones(batch, chunk, dtype=torch.bool, device=dev)
    ts = torch.full((batch,), timestep, device=dev)
    domains = torch.full((batch,), 3, device=dev)
    return text, layout, video, noisy_v, ts, actions, noisy_a, domains


@needs_cuda
@pytest.mark.parametrize("lengths", [[20], [20, 20], [20, 31]], ids=["one", "same_lengths", "two_lengths"])
def test_graph_replay_reads_new_inputs(tiny_checkpoint, lengths):
    from cosmos3_gym.cuda_graphs import GraphedGenForward

    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="fp32", progress=False)
    model = engine.transformer
    graphed = GraphedGenForward(model)
    with torch.inference_mode():
        for seed, timestep in [(0, 900), (1, 500), (2, 100)]:  # the first call captures, the others replay
            inputs = forward_inputs(model, lengths, seed, timestep)
            v_graph, a_graph = graphed(*inputs)
            v_plain, a_plain = model(*inputs)
            torch.testing.assert_close(v_graph, v_plain, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a_graph, a_plain, rtol=1e-5, atol=1e-5)
    assert graphed.num_graphs == 1
    with torch.inference_mode():  # outputs are copies: a later replay leaves earlier results alone
        kept = v_graph.clone()
        graphed(*forward_inputs(model, lengths, 7))
    assert torch.equal(kept, v_graph)


@needs_cuda
def test_one_graph_per_signature_and_lru_bound(tiny_checkpoint):
    from cosmos3_gym.cuda_graphs import GraphedGenForward

    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="fp32", progress=False)
    graphed = GraphedGenForward(engine.transformer, max_graphs=2)
    with torch.inference_mode():
        for lengths in ([20], [21], [20], [20, 20]):
            graphed(*forward_inputs(engine.transformer, lengths, 0))
    assert graphed.num_graphs == 2  # [20] reused, then [20, 20] evicts the least recently used [21]


@needs_cuda
def test_engine_with_cuda_graphs_matches_plain_engine_and_survives_offload(tiny_checkpoint):
    rng = np.random.default_rng(0)
    frame = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)

    def request(seed, context_noise=0.0):
        return Cosmos3Request(mode="policy", observation=frame, task="push the block", chunk=8, num_inference_steps=3,
                              guidance_scale=2.0, fps=15.0, seed=seed, resolution_tier=256, domain="pusht",
                              context_noise=context_noise)

    plain = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="fp32", progress=False)
    graphed = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="fp32", progress=False).optimize()
    assert graphed.gen_forward is not graphed.transformer
    for seed, context_noise in ((0, 0.0), (1, 0.0), (0, 0.2)):  # the graph replays a context's timesteps too
        ours = graphed.step(request(seed, context_noise), decode=False)
        reference = plain.step(request(seed, context_noise), decode=False)
        np.testing.assert_allclose(ours.action, reference.action, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.video_latents, reference.video_latents, rtol=1e-4, atol=1e-4)
    graphed.offload()
    assert graphed.gen_forward.num_graphs == 0
    graphed.onload()
    again = graphed.step(request(0), decode=False)
    np.testing.assert_allclose(again.action, plain.step(request(0), decode=False).action, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_workers_with_graphs_and_symmetric_memory_survive_offload(tiny_checkpoint):
    """load_engine(tp=2, optimize=True) from this process: two worker processes, CUDA graphs over the
    symmetric-memory all-reduces. offload() drops the graphs and the symmetric buffers; the next step onloads by
    itself, re-makes them and gives the same result as before, and as one GPU."""
    from cosmos3_gym import load_engine

    frame = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    request = Cosmos3Request(mode="policy", observation=frame, task="push the block", chunk=8, num_inference_steps=3,
                             guidance_scale=2.0, fps=15.0, seed=0, resolution_tier=256, domain="pusht")
    single = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cuda", dtype="fp32", progress=False)
    reference = single.step(request, decode=False)
    engine = load_engine(tiny_checkpoint, tp=2, device="cuda", dtype="fp32", progress=False, optimize=True)
    try:
        first = engine.step(request, decode=False)
        engine.offload()
        again = engine.step(request, decode=False)
    finally:
        engine.close()
    np.testing.assert_allclose(first.action, reference.action, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(again.action, first.action, rtol=1e-5, atol=1e-5)
