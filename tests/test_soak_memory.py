"""Memory that must not grow over a long run (issue 24's soak, ``benchmarks/soak_pusht.py``).

On a GPU the soak's host RSS and GPU memory grew in steps, each at a new CUDA-graph capture: a vector env whose
number of stepping slots changes (autoreset) padded its rows to the next multiple of 8, so every new count captured
(and compiled) another graph. A batch now replays a kept graph of up to twice its rows. Checked on CPU with a
stand-in for ``GraphedGenForward`` that records the signatures a real one would capture (counts, not memory).
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
import torch

from cosmos3_gym.cuda_graphs import DEFAULT_MAX_PADDING, _flat_inputs, _signature, check_max_padding
from cosmos3_gym.cuda_graphs import graph_rows as _graph_rows
from cosmos3_gym.engine import Cosmos3Engine, Cosmos3Request
from cosmos3_gym.envs import WorldModelVectorEnv
from cosmos3_gym.errors import InputError


class RecordingGraphs:
    """``GraphedGenForward``'s bookkeeping without CUDA: the plain forward, and the set of signatures it would have
    captured a graph for."""

    def __init__(self, transformer):
        self.transformer = transformer
        self.signatures: set[tuple] = set()
        self.max_padding = DEFAULT_MAX_PADDING

    @property
    def num_graphs(self) -> int:
        return len(self.signatures)

    @property
    def row_counts(self) -> set[int]:
        return {len(key[0]) for key in self.signatures}

    def __call__(self, text, layout, *tensors):
        self.signatures.add(_signature(text, _flat_inputs(text, layout, *tensors)))
        return self.transformer(text, layout, *tensors)


def test_graph_rows_reuse_a_kept_graph_of_at_most_twice_the_rows():
    assert _graph_rows(64, set()) == 64
    assert [_graph_rows(n, {64}) for n in (63, 57, 56, 33, 32, 31)] == [64, 64, 64, 64, 64, 32]
    assert _graph_rows(20, {64, 24, 32}) == 24  # the smallest that fits
    assert _graph_rows(5, {64}) == 8  # nothing within 2x: the bucket
    assert _graph_rows(3, set()) == 4 and _graph_rows(17, set()) == 24


def test_graph_rows_without_a_padding_limit_reuse_any_kept_graph_that_holds_the_batch():
    assert [_graph_rows(n, {64}, None) for n in (63, 31, 5, 1)] == [64, 64, 64, 64]
    assert _graph_rows(5, {64, 16}, None) == 16  # the smallest that holds it
    assert _graph_rows(65, {64}, None) == 72  # larger than every kept graph: a new bucket
    assert [_graph_rows(5, {64}, padding) for padding in (2, 16)] == [8, 64]
    for bad in (0.5, True, "all"):
        with pytest.raises(InputError, match="max_padding"):
            check_max_padding(bad)


def test_changing_batch_sizes_replay_one_graph(tiny_checkpoint):
    torch.manual_seed(0)
    frame = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)

    def requests(count):
        return [Cosmos3Request(mode="policy", observation=frame, task="push the block", chunk=8,
                               num_inference_steps=2, guidance_scale=1.0, seed=seed, resolution_tier=256,
                               domain="pusht") for seed in range(count)]

    engine = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)
    plain = [r.action for r in engine.step(requests(5), decode=False)]
    graphs = RecordingGraphs(engine.transformer)
    engine._graphed_forward = graphs
    # a vector env of 8 slots as autoreset leaves 8, 7, 5, 6, 4 of them stepping: one graph, 8 rows
    for count in (8, 7, 5, 6, 4):
        results = engine.step(requests(count), decode=False)
        assert len(results) == count
    assert graphs.row_counts == {8} and graphs.num_graphs == 1  # buckets alone: two graphs (8 and 4 rows)
    # the padding rows change nothing in the real ones
    for ours, reference in zip(engine.step(requests(5), decode=False), plain):
        np.testing.assert_allclose(ours.action, reference, rtol=1e-4, atol=1e-5)
    engine.step(requests(3), decode=False)  # 8 > 2 * 3: a batch this small gets its own graph
    assert graphs.row_counts == {8, 4}
    # as the PushT env sets its own engine: any kept graph that holds the batch, so no new one up to 8 rows
    engine.set_graph_padding(None)
    assert graphs.max_padding is None
    for count in (1, 2, 7):
        assert len(engine.step(requests(count), decode=False)) == count
    assert graphs.row_counts == {8, 4}
    for ours, reference in zip(engine.step(requests(1), decode=False), plain):  # padded 1 -> 4 rows: still exact
        np.testing.assert_allclose(ours.action, reference, rtol=1e-4, atol=1e-5)
    with pytest.raises(InputError, match="max_padding"):
        engine.set_graph_padding(0)


# Deep enough that every allocation under env.step still has this test's frame in its traceback.
TRACEBACK_FRAMES = 50


def finish_task(frames, tasks):
    return [1.0 if task == "finish" else 0.0 for task in tasks]


def live_objects() -> int:
    """Objects the garbage collector tracks, after a collection."""
    gc.collect()
    return len(gc.get_objects())


def memory_held_by_this_test() -> tuple[int, list[str]]:
    """(bytes Python and numpy hold now that were allocated under this test's own calls, the largest holders by line).
    Only this file's allocations count: threads earlier tests left running (two tqdm monitors at this point of the
    suite) allocate without this file on their stack (the likely cause of a CI failure on 170 kB unaccounted for)."""
    gc.collect()
    # Without what torch._dynamo allocates: once dynamo is loaded (earlier tests compile), it tags every nn.Module
    # created in a process-wide weak table, whose one-off resizes (72+ kB) land on whichever test grows it.
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, __file__, all_frames=True), tracemalloc.Filter(False, "*/torch/_dynamo/*")]
    )
    return sum(trace.size for trace in snapshot.traces), [str(stat) for stat in snapshot.statistics("lineno")[:5]]


def test_a_long_vector_env_run_keeps_what_it_holds(tiny_checkpoint):
    """Episode bookkeeping, infos (frames included), per-step requests and the engine's caches: after warm-up, more
    steps and episodes (autoreset every other step, ``return_frames`` on) hold no more Python objects or memory, and
    new prompts stay within the caches' bound."""
    loaded = Cosmos3Engine.from_pretrained(tiny_checkpoint, device="cpu", dtype="fp32", progress=False)
    engine = Cosmos3Engine(loaded.transformer, loaded.vae, loaded.tokenizer, loaded.scheduler_config,
                           progress=False, text_cache_size=2)
    frame = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    env = WorldModelVectorEnv(3, engine=engine, initial_states=frame, task=["finish", "go", "go"],
                              reward_model=finish_task, success_threshold=0.5, max_episode_steps=2,
                              return_frames=True, domain="pusht", chunk=4, num_steps=2, resolution_tier=256)
    env.reset(seed=0)
    env.action_space.seed(0)
    # Traced at our depth even under ``python -X tracemalloc`` (1 frame: too few to tell whose memory it is); the
    # outer tracing resumes afterwards, without what it had traced so far.
    outer_frames = tracemalloc.get_traceback_limit() if tracemalloc.is_tracing() else None
    tracemalloc.stop()
    tracemalloc.start(TRACEBACK_FRAMES)
    try:
        # Warm-up: every batch size autoreset gives (3 and 2 slots stepping) seen, first-call caches filled (torch's,
        # Python's free lists: about 100 kB in the first steps, a few hundred bytes a step after 10).
        for _ in range(10):
            env.step(env.action_space.sample())
        objects = live_objects()
        memory = [memory_held_by_this_test()[0]]
        frames_bytes = 0  # of one step's info["frames"]
        for window in range(2):  # two windows of 12 steps
            for _ in range(12):
                info = env.step(env.action_space.sample())[-1]
                frames_bytes = max(frames_bytes, info["frames"].nbytes if "frames" in info else 0)
            del info
            if window == 0:
                objects_after = live_objects()
            memory_after, largest = memory_held_by_this_test()
            memory.append(memory_after)
    finally:
        tracemalloc.stop()
        if outer_frames is not None:
            tracemalloc.start(outer_frames)
    # One step's frames kept anywhere would add frames_bytes a step (12 x in a window); a per-step dict or list,
    # objects every step. A leak grows in both windows; a one-off (a global table's resize: CI saw 157-167 kB in the
    # full suite only, in either window) stays below one step's frames.
    assert memory[1] - memory[0] < frames_bytes, (memory, frames_bytes, largest)
    assert memory[2] - memory[1] < frames_bytes, (memory, frames_bytes, largest)
    assert objects_after - objects < 12, (objects, objects_after)
    assert len(engine._text_cache) == 2 and len(engine._prompt_ids) == 2 and len(engine._schedules) == 1  # 2 tasks

    for i in range(4):  # new instructions: each a new prompt, the caches keep the last text_cache_size
        env.reset(seed=i, options={"task": f"task {i}"})
        env.step(env.action_space.sample())
    assert len(engine._text_cache) <= 2 and len(engine._prompt_ids) <= 2
    env.close()
