"""Remote policies over openpi's websocket protocol (issue 45 items 1 and 2): the message format against an
independent implementation of openpi's ``msgpack_numpy`` written here from its specification, our client against a
server written here the way openpi's ``WebsocketPolicyServer`` works and an openpi-style client against our
``PolicyServer``; evaluation through a loopback server equal to evaluating in process (same seeds, same numbers),
``serve-policy`` as a subprocess, and every error case: server down, no reply (timeout), a lost connection, malformed
replies, a refused API key, and episodes in flight failed (not hung) when a server stops answering.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from test_evaluation import FAST_FLAGS, image, make_vec_env

from cosmos3_gym import policy_specs
from cosmos3_gym.agents import PolicyServer, RemotePolicyAgent, RemotePolicyError
from cosmos3_gym.agents.remote import ObservationAdapter, pack, parse_remote_spec, unpack
from cosmos3_gym.cli import main
from cosmos3_gym.errors import InputError

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ openpi's format, from its specification


def spec_pack(value) -> bytes:
    """openpi_client.msgpack_numpy.packb as specified: arrays as {__ndarray__, data, dtype, shape}, numpy scalars as
    {__npgeneric__, data, dtype}, keys as bytes, through msgpack's Packer."""

    def default(item):
        if isinstance(item, (np.ndarray, np.generic)) and item.dtype.kind in ("V", "O", "c"):
            raise ValueError(f"Unsupported dtype: {item.dtype}")
        if isinstance(item, np.ndarray):
            return {b"__ndarray__": True, b"data": item.tobytes(), b"dtype": item.dtype.str, b"shape": item.shape}
        if isinstance(item, np.generic):
            return {b"__npgeneric__": True, b"data": item.item(), b"dtype": item.dtype.str}
        return item

    return msgpack.Packer(default=default).pack(value)


def spec_unpack(data: bytes):
    def hook(item):
        if b"__ndarray__" in item:
            return np.ndarray(buffer=item[b"data"], dtype=np.dtype(item[b"dtype"]), shape=item[b"shape"])
        if b"__npgeneric__" in item:
            return np.dtype(item[b"dtype"]).type(item[b"data"])
        return item

    return msgpack.unpackb(data, object_hook=hook)


def test_messages_are_byte_for_byte_openpis_msgpack_numpy():
    rng = np.random.default_rng(0)
    message = {
        "observation/image": rng.integers(0, 256, (5, 7, 3), dtype=np.uint8),
        "observation/state": rng.normal(size=4).astype(np.float32),
        "actions": rng.normal(size=(8, 2)),
        "mask": np.array([True, False]),
        "scalar": np.float32(0.25),
        "count": np.int64(-3),
        "prompt": "push the block",
        "nested": {"list": [1, 2.5, "x"], "none": None, "big_endian": np.arange(3, dtype=">i4")},
    }
    ours = pack(message)
    assert ours == spec_pack(message)  # the same bytes, so any openpi peer reads them
    for decoded in (unpack(ours), spec_unpack(ours), unpack(spec_pack(message))):
        assert decoded["prompt"] == "push the block" and decoded["nested"]["list"] == [1, 2.5, "x"]
        for key in ("observation/image", "observation/state", "actions", "mask"):
            assert decoded[key].dtype == message[key].dtype and np.array_equal(decoded[key], message[key])
        assert type(decoded["scalar"]) is np.float32 and decoded["scalar"] == np.float32(0.25)
        assert type(decoded["count"]) is np.int64 and decoded["count"] == -3
        assert np.array_equal(decoded["nested"]["big_endian"], np.arange(3))
    non_contiguous = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    assert np.array_equal(unpack(pack(non_contiguous)), non_contiguous)
    for refused in (np.array([object()]), np.zeros(2, np.complex64)):
        with pytest.raises(ValueError, match="unsupported dtype"):
            pack({"x": refused})


# ------------------------------------------------------------------ servers and agents used below


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SpecServer:
    """A policy server written the way openpi's WebsocketPolicyServer works (metadata first; a packed action map
    with "actions" and "server_timing" per packed observation; a failing policy's traceback as text, then close
    1011), with ``answer(observation, count) -> reply`` deciding each reply: a dict (packed), bytes or str (sent as
    they are), "silence" (never answers) or "close" (closes the connection)."""

    def __init__(self, answer, metadata=None):
        self.answer, self.metadata = answer, metadata or {"action_horizon": 8}
        self.headers, self.observations = [], []
        self.port = free_port()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self):
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def url(self):
        return f"ws://127.0.0.1:{self.port}"

    async def _main(self):
        from websockets.asyncio.server import serve

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        async with serve(self._handler, "127.0.0.1", self.port, compression=None, max_size=None):
            self._ready.set()
            await self._stop.wait()

    async def _handler(self, websocket):
        from websockets.exceptions import ConnectionClosed

        self.headers.append(websocket.request.headers.get("Authorization"))
        await websocket.send(spec_pack(self.metadata))
        try:
            while True:
                observation = spec_unpack(await websocket.recv())
                self.observations.append(observation)
                reply = self.answer(observation, len(self.observations))
                if isinstance(reply, tuple):  # ("delay", seconds, reply): answer later, other connections go on
                    await asyncio.sleep(reply[1])
                    reply = reply[2]
                if reply == "silence":  # until the server stops: a sleeping handler would hold its close 10 s
                    await self._stop.wait()
                    return
                elif reply == "close":
                    await websocket.close()
                    return
                elif isinstance(reply, dict):
                    reply = dict(reply, server_timing={"infer_ms": 0.1})
                    await websocket.send(spec_pack(reply))
                else:
                    await websocket.send(reply)
                    if isinstance(reply, str):
                        await websocket.close(code=1011, reason="Internal server error.")
                        return
        except ConnectionClosed:
            pass


def openpi_client_call(url, observation, api_key=None):
    """What openpi_client.WebsocketClientPolicy does: connect (with the API-key header), read the metadata, send one
    packed observation, read the packed reply."""
    from websockets.sync.client import connect

    headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
    with connect(url, compression=None, max_size=None, additional_headers=headers) as connection:
        metadata = spec_unpack(connection.recv())
        connection.send(spec_pack(observation))
        return metadata, spec_unpack(connection.recv())


class MeanColourAgent:
    """A deterministic frame agent whose rows do not depend on the batch: each slot's mean colour as its actions.
    It records the tasks it was given."""

    def __init__(self, chunk=4):
        self.action_shape, self.tasks = (chunk, 2), []

    def act(self, frames, task=None):
        means = np.asarray(frames, np.float32).mean(axis=(1, 2))[:, :2] / 127.5 - 1.0
        if task is not None:
            self.tasks.extend(task)
        return np.repeat(means[:, None], self.action_shape[0], axis=1).astype(np.float32)


def frames(count=3, size=(12, 16), seed=0):
    return np.random.default_rng(seed).integers(0, 256, (count, *size, 3), dtype=np.uint8)


# ------------------------------------------------------------------ interoperation


def test_our_agent_calls_a_server_written_like_openpis():
    def answer(observation, count):
        image = observation["observation/image"]
        assert image.dtype == np.uint8 and image.shape == (12, 16, 3)
        return {"actions": np.full((10, 2), 0.1 * count, np.float32)}  # a longer chunk than the env's

    with SpecServer(answer) as server:
        agent = RemotePolicyAgent(server.url, api_key="k1", timeout=10, chunk=4, task="push")
        assert agent.connect() == {"action_horizon": 8}
        actions = agent.act(frames(3), state=np.ones((3, 5)))
        assert actions.shape == (3, 4, 2) and actions.dtype == np.float32  # cut to the env's 4 steps
        assert sorted(np.round(actions[:, 0, 0], 3)) == [0.1, 0.2, 0.3]  # three concurrent requests
        assert agent.act(frames(1)[0]).shape == (4, 2)  # one image: one chunk
        agent.close()
    assert set(server.headers) == {"Api-Key k1"}  # every connection carries the key
    seen = server.observations[0]
    assert seen["prompt"] == "push" and seen["observation/state"].dtype == np.float32
    assert np.array_equal(seen["observation/state"], np.ones(5))
    assert set(seen) == {"observation/image", "observation/state", "prompt"}


def test_the_rows_of_a_batch_are_sent_concurrently():
    """One request per slot, all in flight at once: 4 rows answered after 0.6 s each take about 0.6 s, not 2.4 s."""

    def answer(observation, count):
        return ("delay", 0.6, {"actions": np.full((4, 2), float(observation["observation/image"][0, 0, 0]) / 255)})

    with SpecServer(answer) as server:
        agent = RemotePolicyAgent(server.url, timeout=10)
        agent.connect()
        images = frames(4)
        started = time.perf_counter()
        actions = agent.act(images)
        elapsed = time.perf_counter() - started
        agent.close()
    assert elapsed < 1.8, elapsed
    assert np.allclose(actions[:, 0, 0], images[:, 0, 0, 0] / 255)  # each row's reply in its row
    assert len(server.headers) == 4  # one connection per slot


def test_an_openpi_style_client_calls_our_server_with_an_api_key():
    agent = MeanColourAgent(chunk=8)
    image = frames(1)[0]
    with PolicyServer(agent, port=0, api_key="s3cret", name="mean-colour") as server:
        metadata, reply = openpi_client_call(server.url, {"observation/image": image, "prompt": "go"}, "s3cret")
        assert metadata["policy"] == "mean-colour" and metadata["action_shape"] == [8, 2]
        assert metadata["observation_keys"] == {
            "image": "observation/image",
            "state": "observation/state",
            "prompt": "prompt",
        }
        assert np.array_equal(reply["actions"], agent.act(image[None])[0])
        assert reply["actions"].dtype == np.float32 and reply["server_timing"]["infer_ms"] >= 0
        # channels-first and float images are read too
        _, chw = openpi_client_call(server.url, {"observation/image": image.transpose(2, 0, 1)}, "s3cret")
        _, floats = openpi_client_call(server.url, {"observation/image": image / 255.0}, "s3cret")
        assert np.array_equal(chw["actions"], reply["actions"])
        assert np.allclose(floats["actions"], reply["actions"], atol=1e-2)
        import urllib.request

        assert urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5).status == 200
    assert agent.tasks == ["go"]


def test_wrong_or_missing_api_key_is_refused_in_one_line(monkeypatch):
    with PolicyServer(MeanColourAgent(), port=0, api_key="right") as server:
        for key in ("wrong", None):
            monkeypatch.delenv("COSMOS3_GYM_POLICY_API_KEY", raising=False)
            with pytest.raises(RemotePolicyError) as error:
                RemotePolicyAgent(server.url, api_key=key, timeout=5).connect()
            message = str(error.value)
            assert (
                message == f"policy server {server.url}: refused the connection: HTTP 401 (a wrong or missing API key?)"
            )
        monkeypatch.setenv("COSMOS3_GYM_POLICY_API_KEY", "right")  # what a ws:// spec uses
        agent = RemotePolicyAgent.from_spec(server.url)
        assert agent.act(frames(2)).shape == (2, 4, 2)
        agent.close()


def test_server_down_is_one_line_naming_the_server(tmp_path, capsys):
    url = f"ws://127.0.0.1:{free_port()}"
    with pytest.raises(RemotePolicyError) as error:
        RemotePolicyAgent(url, timeout=2).act(frames(2))
    assert (
        str(error.value) == f"policy server {url}: cannot connect (connection refused: is the server running?) "
        "(rows 0, 1 of 2)"
    )
    assert error.value.failed.tolist() == [True, True]
    # eval checks the server before any model loads
    started = time.perf_counter()
    assert main(["eval", "--policy", url, "--out", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"cosmos3-gym eval: error: policy server {url}: cannot connect (connection refused: is the "
        "server running?)"
    )
    assert time.perf_counter() - started < 30


def test_no_reply_is_a_timeout_not_a_hang():
    with SpecServer(lambda observation, count: "silence") as server:
        agent = RemotePolicyAgent(server.url, timeout=0.5)
        started = time.perf_counter()
        with pytest.raises(RemotePolicyError, match=r"no reply within 0.5 s waiting for actions \(timeout\)"):
            agent.act(frames(2))
        assert time.perf_counter() - started < 5
    # a peer that accepts the connection but never completes the handshake
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"ws://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(RemotePolicyError, match=r"cannot connect \(TimeoutError"):
            RemotePolicyAgent(url, timeout=0.5).connect()


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (b"\xc1", "malformed reply to actions: not openpi's msgpack"),
        (spec_pack([1, 2]), "malformed reply to actions: expected a map, got list"),
        ({"action": np.zeros((4, 2))}, "malformed reply: no 'actions' entry"),
        ({"actions": np.zeros((4, 3), np.float32)}, "malformed reply: actions of width 3, expected 2"),
        ({"actions": np.zeros((2, 2), np.float32)}, "malformed reply: 2 action steps, the env takes 4 per step"),
        ({"actions": np.zeros(8, np.float32)}, r"malformed reply: 'actions' must be \[steps, dim\]"),
        ({"actions": np.full((4, 2), np.nan, np.float32)}, "malformed reply: 'actions' contains NaN"),
        ({"actions": "left"}, "malformed reply: 'actions' is not a numeric array"),
        (
            "Traceback (most recent call last):\n  ...\nValueError: bad prompt\n",
            "the server's policy failed: ValueError: bad prompt",
        ),
        ("close", "lost the connection waiting for actions"),
    ],
)
def test_malformed_replies_and_lost_connections_are_one_line_errors(reply, message):
    with SpecServer(lambda observation, count: reply) as server:
        agent = RemotePolicyAgent(server.url, timeout=5, action_shape=(4, 2))
        with pytest.raises(RemotePolicyError, match=message) as error:
            agent.act(frames(1))
        text = str(error.value)
        assert text.startswith(f"policy server {server.url}: ") and "\n" not in text
        agent.close()


def test_spec_options_raw_actions_and_parsing():
    assert parse_remote_spec("ws://host:8000/infer#image=cam&timeout=2.5&actions=raw") == (
        "ws://host:8000/infer",
        {"image": "cam", "timeout": "2.5", "actions": "raw"},
    )
    spec = policy_specs.parse_policy_spec("wss://policy.example.org:443")
    assert (spec.kind, spec.path, spec.acts_on_frames) == ("remote", "wss://policy.example.org:443", True)
    assert [s.kind for s in policy_specs.parse_policy_specs("random,ws://h:1")] == ["random", "remote"]
    for bad, message in [
        ("ws://", "expected ws://HOST:PORT"),
        ("ws://h:99999", "not a websocket URL"),
        ("ws://h:1#colour=red", "unknown option"),
        ("ws://h:1#timeout=-1", "timeout="),
        ("ws://h:1#actions=pixels", "actions="),
    ]:
        with pytest.raises(InputError, match=message):
            policy_specs.parse_policy_spec(bad)
    with pytest.raises(InputError, match="actions=raw needs the env's action statistics"):
        RemotePolicyAgent.from_spec("ws://h:1#actions=raw")

    class Stats:
        def normalize(self, actions):
            return actions / 100.0 - 1.0

    def answer(observation, count):
        assert set(observation) == {"cam", "extra"}  # the adapter's keys only
        return {"actions": np.full((4, 2), 150.0, np.float32)}

    with SpecServer(answer) as server:
        adapter = ObservationAdapter(image_key="cam", state_key=None, prompt_key=None, extra={"extra": 1})
        agent = RemotePolicyAgent(server.url, observation_adapter=adapter, raw_actions=True, action_stats=Stats())
        assert np.allclose(agent.act(frames(1), task="ignored", state=np.zeros((1, 2))), 0.5)
        agent.close()
        from_spec = RemotePolicyAgent.from_spec(f"{server.url}#image=cam&actions=raw", action_stats=Stats())
        assert from_spec.observation_adapter.image_key == "cam" and from_spec.raw_actions


def test_one_agent_per_connection_for_stateful_policies():
    made = []

    def make_agent(index):
        made.append(MeanColourAgent())
        return made[-1]

    with PolicyServer(make_agent=make_agent, port=0) as server:
        first, second = RemotePolicyAgent(server.url), RemotePolicyAgent(server.url)
        first.act(frames(1), task="a")
        second.act(frames(1), task="b")
        first.close(), second.close()
    assert [agent.tasks for agent in made] == [["a"], ["b"]]
    with pytest.raises(InputError, match="exactly one of agent"):
        PolicyServer(MeanColourAgent(), make_agent=make_agent)


def test_an_sb3_policy_file_served_acts_as_in_process(tiny_ppo_model, tmp_path):
    from cosmos3_gym.agents import save_sb3_policy

    path = save_sb3_policy(tiny_ppo_model, tmp_path / "ppo.safetensors")
    local = policy_specs.load_frame_agent(f"sb3:{path}")
    images = frames(1, size=(48, 48))
    with PolicyServer(policy_specs.load_frame_agent(f"file:{path}"), port=0) as server:
        remote = policy_specs.load_frame_agent(server.url)  # a ws:// spec connects when loaded
        assert remote.metadata["action_shape"] == [8, 2] and remote.action_shape == (8, 2)
        assert np.array_equal(remote.act(images), local.act(images))
        remote.close()


# ------------------------------------------------------------------ evaluation through a server


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


def outcome(report):
    return [
        (e.episode, e.slot, e.task, e.episode_return, e.length, e.success, e.terminated, e.truncated)
        for e in report.episodes
    ]


def test_evaluation_through_a_loopback_server_equals_in_process(engine):
    from cosmos3_gym.evaluation import evaluate_policy, load_policy

    served = MeanColourAgent()
    in_process = evaluate_policy(
        make_vec_env(engine), policy_specs.FramePolicy(MeanColourAgent(), "local"), 5, seed=3, progress=False
    )
    with PolicyServer(served, port=0) as server:
        env = make_vec_env(engine)
        policy = load_policy(server.url, env)
        assert isinstance(policy, policy_specs.RemoteFramePolicy) and policy.agent.action_shape == (4, 2)
        remote = evaluate_policy(env, policy, 5, seed=3, progress=False)
        policy.agent.close()
        env.close()
    assert outcome(remote) == outcome(in_process)  # same seeds, same numbers
    assert remote.overall == in_process.overall and remote.settings["policy_errors"] == 0
    assert {"finish", "go"} == set(served.tasks)  # each slot's task went out as its prompt
    assert server.requests_served == len(served.tasks)


def test_a_failing_slot_fails_its_episode_and_the_evaluation_goes_on(engine):
    from cosmos3_gym.evaluation import evaluate_policy, load_policy

    failed = []

    def answer(observation, count):
        if observation["prompt"] == "go" and not failed:
            failed.append(count)
            return {"no_actions": True}
        return {"actions": np.zeros((4, 2), np.float32)}

    with SpecServer(answer) as server:
        env = make_vec_env(engine)
        report = evaluate_policy(env, load_policy(f"{server.url}#timeout=10", env), 6, progress=False)
        env.close()
    errors = [e for e in report.episodes if e.error is not None]
    assert len(report.episodes) == 6 and len(errors) == 1 and errors[0].task == "go"
    assert errors[0].success is False and errors[0].length == 2  # it ran to its end, counted as failed
    assert errors[0].error.startswith(f"policy server {server.url}#timeout=10: malformed reply: no 'actions'")
    assert report.settings["policy_errors"] == 1 and "aborted" not in report.settings
    assert "1 episode(s) failed on a policy error" in report.table()
    document = report.to_dict()
    assert [("error" in e) for e in document["episodes"]] == [e.error is not None for e in report.episodes]
    # the finish slot succeeds every step, unaffected
    assert all(e.success for e in report.episodes if e.task == "finish")


def test_a_server_that_stops_answering_fails_the_episodes_in_flight(engine, tiny_checkpoint, tmp_path, capsys):
    from cosmos3_gym.evaluation import EvaluationAborted, evaluate_policy, load_policy

    def answer(observation, count):
        return {"actions": np.zeros((4, 2), np.float32)} if count <= 3 else "silence"

    with SpecServer(answer) as server:
        env = make_vec_env(engine)
        started = time.perf_counter()
        with pytest.raises(EvaluationAborted) as error:
            evaluate_policy(env, load_policy(f"{server.url}#timeout=0.5", env), 20, progress=False, max_failed_calls=2)
        env.close()
    assert time.perf_counter() - started < 60
    message = str(error.value)
    assert message.startswith(f"policy server {server.url}#timeout=0.5: no reply within 0.5 s") and "\n" not in message
    assert "2 calls in a row failed for every slot" in message
    report = error.value.report
    in_flight = [e for e in report.episodes if e.error is not None]
    assert in_flight and all(e.success is False for e in in_flight)
    assert len(report.episodes) < 20 and report.settings["aborted"] == message

    # The CLI: one line naming the server, and the report so far written.
    from PIL import Image

    Image.fromarray(image(0)).save(tmp_path / "start.png")
    with SpecServer(answer) as server:
        out = tmp_path / "eval"
        code = main(
            [
                "eval",
                "--checkpoint",
                str(tiny_checkpoint),
                "--policy",
                f"{server.url}#timeout=0.5",
                "--episodes",
                "20",
                "--num-envs",
                "2",
                "--initial-states",
                str(tmp_path / "start.png"),
                "--task",
                "go",
                "--max-episode-steps",
                "2",
                "--max-videos",
                "0",
                "--out",
                str(out),
                *FAST_FLAGS,
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and err.startswith(f"cosmos3-gym eval: error: policy server {server.url}#timeout=0.5: no reply")
    assert f"the report so far: {out / 'report.json'}" in err
    document = json.loads((out / "report.json").read_text())
    assert document["settings"]["aborted"] and any("error" in e for e in document["episodes"])


# ------------------------------------------------------------------ serve-policy as a process


@pytest.fixture
def bc_policy_file(tmp_path):
    import torch

    from cosmos3_gym.rl.policy import PixelGaussianPolicy, PolicyConfig, save_policy_file

    torch.manual_seed(0)
    policy = PixelGaussianPolicy(PolicyConfig(image_size=32, chunk=8, channels=(8, 8), hidden=16))
    return save_policy_file(policy, tmp_path / "bc.safetensors")


def start_server(*arguments):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "cosmos3_gym.cli", "serve-policy", "--port", "0", *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    line = process.stdout.readline()
    if not line.startswith("serving "):
        process.kill()
        raise AssertionError(f"serve-policy did not start: {line}{process.stderr.read()}")
    return process, line.strip().split(" on ")[1].split(" ")[0]


def test_serve_policy_evaluates_like_the_file_in_process(bc_policy_file, tmp_path, capsys):
    """The built-in PushT model, 1 sampling step: `eval --policy ws://...` against `serve-policy --policy file:...`
    gives the numbers of `eval --policy file:...` (one slot, so the served policy sees the same batches)."""
    process, url = start_server("--policy", f"file:{bc_policy_file}", "--api-key", "k")
    try:
        assert url.startswith("ws://127.0.0.1:")
        flags = [
            "--episodes",
            "2",
            "--max-episode-steps",
            "2",
            "--num-steps",
            "1",
            "--max-videos",
            "0",
            "--device",
            "cpu",
            "--seed",
            "4",
        ]
        assert main(["eval", "--policy", f"file:{bc_policy_file}", *flags, "--out", str(tmp_path / "local")]) == 0
        os.environ["COSMOS3_GYM_POLICY_API_KEY"] = "k"
        try:
            assert main(["eval", "--policy", url, *flags, "--out", str(tmp_path / "remote")]) == 0
        finally:
            del os.environ["COSMOS3_GYM_POLICY_API_KEY"]
        local, remote = (json.loads((tmp_path / name / "report.json").read_text()) for name in ("local", "remote"))
        assert remote["episodes"] == local["episodes"] and remote["overall"] == local["overall"]
        assert remote["settings"]["policy"] == url
        if _has_gym_pusht():  # eval-real takes the spec too: the same gym-pusht episodes
            os.environ["COSMOS3_GYM_POLICY_API_KEY"] = "k"
            try:
                for spec, name in ((f"file:{bc_policy_file}", "local.json"), (url, "remote.json")):
                    assert (
                        main(
                            [
                                "eval-real",
                                "--real-only",
                                "--policies",
                                spec,
                                "--starts",
                                "1",
                                "--chunks",
                                "2",
                                "--device",
                                "cpu",
                                "--out",
                                str(tmp_path / name),
                            ]
                        )
                        == 0
                    )
            finally:
                del os.environ["COSMOS3_GYM_POLICY_API_KEY"]
            scores = [
                next(iter(json.loads((tmp_path / n).read_text())["policies"].values()))
                for n in ("local.json", "remote.json")
            ]
            assert scores[0] == scores[1]
    finally:
        process.terminate()
        process.wait(30)
    assert main(["serve-policy", "--policy", "scripted:0", "--port", "0"]) == 2
    assert "runs in gym-pusht only" in capsys.readouterr().err


def _has_gym_pusht() -> bool:
    try:
        import gym_pusht  # noqa: F401
    except ImportError:
        return False
    return True


def test_serve_policy_serves_the_checkpoints_own_policy_random_and_task_frame_policies():
    """`--policy agent` (the built-in model's policy mode, 1 step) as a process; random and a task's frame policy
    (one per connection) as the command builds them."""
    import argparse

    from cosmos3_gym.cli import _served_agent

    process, url = start_server("--policy", "agent", "--num-steps", "1", "--device", "cpu")
    try:
        agent = RemotePolicyAgent(url, timeout=120)
        actions = agent.act(
            np.full((2, 256, 256, 3), 200, np.uint8), task="push the T-shaped block onto the green target"
        )
        assert actions.shape == (2, 8, 2) and np.abs(actions).max() <= 1.0
        assert agent.metadata["policy"] == "agent" and agent.metadata["action_shape"] == [8, 2]
        agent.close()
    finally:
        process.terminate()
        process.wait(30)
    args = argparse.Namespace(seed=3, device="cpu", dtype=None, num_steps=None)
    random_agent, make_agent, metadata = _served_agent(policy_specs.parse_policy_spec("random"), args, "pusht")
    assert make_agent is None and random_agent.act(frames(2)).shape == (2, 8, 2)
    if _has_gym_pusht():
        agent, make_agent, metadata = _served_agent(policy_specs.parse_policy_spec("scripted-frames:0"), args, "pusht")
        assert agent is None and metadata == {"action_shape": [8, 2]}
        first, second = make_agent(0), make_agent(1)
        assert first is not second and first.act(np.full((1, 256, 256, 3), 255, np.uint8)).shape == (1, 8, 2)
