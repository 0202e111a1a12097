"""``PolicyServer``: serve a frame agent over openpi's websocket protocol (``cosmos3-gym serve-policy``).

Any frame agent (``act(frames uint8 [N, H, W, 3]) -> [N, chunk, dim]``: a BC / GRPO / SB3 policy file, the
checkpoint's ``PolicyAgent``, a task's frame policy) becomes a policy server that an unmodified openpi client
(``openpi_client.WebsocketClientPolicy``), this package's ``RemotePolicyAgent`` (``ws://`` policy specs) or any
evaluation harness speaking openpi's protocol can call. The protocol is ``agents.remote``'s (openpi's
``WebsocketPolicyServer``): the metadata map first, then one packed action map (``"actions"`` ``[chunk, dim]``
float32 in the env's normalised space, and ``"server_timing"``) per packed observation map; a request the policy
cannot answer gets its traceback as a text frame and the connection is closed (code 1011), as openpi does.
``GET /healthz`` answers 200.

Requests are read with an ``ObservationAdapter`` (default: the image under ``"observation/image"``, an optional
state under ``"observation/state"``, the task under ``"prompt"``; images ``[H, W, 3]`` uint8, or channels first, or
float in [0, 1]). An agent that takes ``task`` / ``state`` (``PolicyAgent``) gets them.

Batching. The policy runs on one worker thread. Requests that arrive while it is busy (several clients, or the slots
of one vector env) are answered by one batched ``act`` of up to ``max_batch`` rows, in arrival order. A sampling
agent (``PolicyAgent``) therefore draws its seeds in arrival order, and a network's float rounding may depend on the
batch's size (about 1e-8 on a CPU); ``max_batch=1`` serves one request at a time. An agent with per-episode state
(``make_agent``, e.g. a scripted pusher that remembers its contact) gets one instance per connection instead.

Security. The server binds 127.0.0.1 unless told otherwise; with ``api_key`` a handshake without the header
``Authorization: Api-Key KEY`` is refused with HTTP 401. Messages are msgpack (no pickle), arrays of object dtype
are refused.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import inspect
import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..errors import InputError
from .remote import ObservationAdapter, pack, unpack

__all__ = ["DEFAULT_PORT", "PolicyServer"]

DEFAULT_PORT = 8000  # openpi's
logger = logging.getLogger(__name__)


class PolicyServer:
    """Serves ``agent`` (or one ``make_agent(connection_index)`` per connection) on ``ws://host:port``.

    ``start()`` serves from a background thread (``port=0``: a free port, read back from ``.port``) and returns once
    it listens; ``serve_forever()`` serves in the foreground until interrupted; ``stop()`` ends it (also as a context
    manager). ``metadata``: extra entries of the handshake's metadata, which always holds ``"server"``,
    ``"policy"`` (``name``), ``"action_shape"`` (the agent's, when known) and ``"observation_keys"``.
    """

    def __init__(
        self,
        agent: Any = None,
        *,
        make_agent: Callable[[int], Any] | None = None,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        api_key: str | None = None,
        name: str = "policy",
        metadata: Mapping[str, Any] | None = None,
        observation_adapter: ObservationAdapter | None = None,
        max_batch: int = 16,
    ):
        if (agent is None) == (make_agent is None):
            raise InputError("agent: give exactly one of agent= (shared) and make_agent= (one per connection).")
        if agent is not None and not callable(getattr(agent, "act", None)):
            raise InputError(f"agent: expected a frame agent with act(frames), got {type(agent).__name__}.")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise InputError(f"port: expected an integer in 0 .. 65535, got {port!r}.")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise InputError(f"max_batch: expected an integer >= 1, got {max_batch!r}.")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise InputError("api_key: expected a non-empty string or None.")
        self.agent, self.make_agent = agent, make_agent
        self.host, self.port, self.api_key, self.name = host, port, api_key, name
        self.adapter = observation_adapter or ObservationAdapter()
        self.max_batch = max_batch
        shape = getattr(agent, "action_shape", None)
        if shape is None and getattr(agent, "chunk", None) and getattr(agent, "raw_action_dim", None):
            shape = (agent.chunk, agent.raw_action_dim)  # PolicyAgent: its settings'
        from .. import __version__

        self.metadata: dict[str, Any] = {
            "server": f"cosmos3_gym {__version__}",
            "policy": name,
            "action_shape": None if shape is None else [int(size) for size in shape],
            "actions": "normalized to [-1, 1] (the world-model env's action space)",
            "observation_keys": {
                "image": self.adapter.image_key,
                "state": self.adapter.state_key,
                "prompt": self.adapter.prompt_key,
            },
            **dict(metadata or {}),
        }
        self.requests_served = 0
        self._pending: list[tuple[tuple[np.ndarray, Any, str | None], asyncio.Future]] = []
        self._draining = False
        self._connections = 0
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._executor: Any = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"ws://{host}:{self.port}"

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> PolicyServer:
        """Serve from a background thread; returns once listening (``InputError`` if the address is taken)."""
        if self._thread is not None:
            raise InputError("server: already started.")
        ready = threading.Event()
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._main(ready)), name="policy-server", daemon=True
        )
        self._thread.start()
        if not ready.wait(timeout):
            raise InputError(f"server: did not start listening on {self.host}:{self.port} within {timeout:g} s.")
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise InputError(f"server: cannot listen on {self.host}:{self.port} ({self._error}).")
        return self

    def serve_forever(self, on_listening: Callable[[PolicyServer], None] | None = None) -> None:
        """Serve in this thread until interrupted (Ctrl-C); ``on_listening(self)`` once it listens."""
        ready = threading.Event()

        async def main() -> None:
            task = asyncio.create_task(self._main(ready))
            while not ready.is_set() and not task.done():
                await asyncio.sleep(0.01)
            if self._error is None and on_listening is not None:
                on_listening(self)
            await task

        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            pass
        if self._error is not None:
            raise InputError(f"server: cannot listen on {self.host}:{self.port} ({self._error}).")

    def stop(self) -> None:
        loop, stopped = self._loop, self._stopped
        if loop is not None and stopped is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stopped.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def __enter__(self) -> PolicyServer:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    async def _main(self, ready: threading.Event) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from websockets.asyncio.server import serve

        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy")
        try:
            try:
                server = await serve(
                    self._handle,
                    self.host,
                    self.port,
                    compression=None,
                    max_size=None,
                    process_request=self._process_request,
                )
            except OSError as error:
                self._error = error
                ready.set()
                return
            async with server:
                self.port = int(server.sockets[0].getsockname()[1])
                ready.set()
                await self._stopped.wait()
        finally:
            self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------------------------------ protocol

    def _process_request(self, connection: Any, request: Any) -> Any:
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        if self.api_key is not None:
            given = request.headers.get("Authorization") or ""
            if not hmac.compare_digest(given.encode(), f"Api-Key {self.api_key}".encode()):
                return connection.respond(http.HTTPStatus.UNAUTHORIZED, "wrong or missing API key\n")
        return None

    async def _handle(self, connection: Any) -> None:
        from websockets.exceptions import ConnectionClosed

        loop = asyncio.get_running_loop()
        index = self._connections
        self._connections += 1
        logger.info("connection %d from %s opened", index, connection.remote_address)
        agent = self.agent
        previous_total: float | None = None
        try:
            if self.make_agent is not None:
                agent = await loop.run_in_executor(self._executor, self.make_agent, index)
            await connection.send(pack(self.metadata))
            while True:
                started = time.monotonic()
                message = await connection.recv()
                if isinstance(message, str):
                    raise InputError("request: expected a binary msgpack frame, got text")
                row = self._read(unpack(message))
                infer_started = time.monotonic()
                if self.make_agent is not None:
                    (actions,) = await loop.run_in_executor(self._executor, _act_rows, agent, [row])
                else:
                    actions = await self._batched(row)
                timing = {"infer_ms": (time.monotonic() - infer_started) * 1000}
                if previous_total is not None:
                    timing["prev_total_ms"] = previous_total * 1000
                await connection.send(pack({"actions": actions, "server_timing": timing}))
                self.requests_served += 1
                previous_total = time.monotonic() - started
        except ConnectionClosed:
            logger.info("connection %d closed", index)
        except Exception as error:  # noqa: BLE001 - any failure is the client's to read (openpi's behaviour)
            logger.warning("connection %d: %s", index, " ".join(str(error).split()) or type(error).__name__)
            try:
                await connection.send("".join(traceback.format_exception(type(error), error, error.__traceback__)))
                await connection.close(code=1011, reason="Internal server error. Traceback included in previous frame.")
            except ConnectionClosed:
                pass

    def _read(self, request: Any) -> tuple[np.ndarray, Any, str | None]:
        image, state, task = self.adapter.read(request)
        return _image(image), state, task

    async def _batched(self, row: tuple[np.ndarray, Any, str | None]) -> np.ndarray:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._pending.append((row, future))
        if not self._draining:
            self._draining = True
            loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                try:
                    results = await loop.run_in_executor(self._executor, _act_rows, self.agent, [r for r, _ in batch])
                except Exception as error:  # noqa: BLE001 - handed to every waiting connection
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(error)
                    continue
                for (_, future), actions in zip(batch, results):
                    if not future.done():
                        future.set_result(actions)
        finally:
            self._draining = False


def _image(value: Any) -> np.ndarray:
    """A request's image as uint8 ``[H, W, 3]``: channels-first images are transposed, floats in [0, 1] scaled."""
    image = np.asarray(value)
    if image.ndim == 3 and image.shape[0] in (1, 3) and image.shape[-1] not in (1, 3):
        image = image.transpose(1, 2, 0)
    if image.ndim != 3 or image.shape[-1] not in (1, 3) or min(image.shape) < 1:
        raise InputError(f"request: the image must be [H, W, 3], got shape {list(image.shape)}")
    if image.shape[-1] == 1:
        image = np.repeat(image, 3, axis=-1)
    if image.dtype != np.uint8:
        if not np.issubdtype(image.dtype, np.floating) and not np.issubdtype(image.dtype, np.integer):
            raise InputError(f"request: the image must be uint8 or float, got {image.dtype}")
        values = image.astype(np.float32)
        if np.issubdtype(image.dtype, np.floating) and values.size and float(np.nanmax(values)) <= 1.0:
            values = values * 255.0
        image = np.clip(np.nan_to_num(values), 0, 255).round().astype(np.uint8)
    return np.ascontiguousarray(image)


def _accepts(agent: Any, name: str) -> bool:
    try:
        return name in inspect.signature(agent.act).parameters
    except (TypeError, ValueError):
        return False


def _act_rows(agent: Any, rows: list[tuple[np.ndarray, Any, str | None]]) -> list[np.ndarray]:
    """The agent's action chunk for each row ``(image, state, task)``: one ``act`` per group of equally sized
    images, in order."""
    out: list[np.ndarray | None] = [None] * len(rows)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (image, _, _) in enumerate(rows):
        groups.setdefault(tuple(image.shape), []).append(i)
    for members in groups.values():
        images = np.stack([rows[i][0] for i in members])
        kwargs: dict[str, Any] = {}
        tasks = [rows[i][2] for i in members]
        if _accepts(agent, "task") and any(task is not None for task in tasks):
            default = getattr(agent, "task", None) or ""
            kwargs["task"] = [default if task is None else task for task in tasks]
        states = [rows[i][1] for i in members]
        if _accepts(agent, "state") and all(state is not None for state in states):
            kwargs["state"] = np.stack([np.asarray(state, np.float32) for state in states])
        actions = np.asarray(agent.act(images, **kwargs), dtype=np.float32)
        if actions.ndim != 3 or len(actions) != len(members):
            raise InputError(
                f"agent: act() of {len(members)} images returned shape {list(actions.shape)}; expected "
                f"[{len(members)}, chunk, dim]"
            )
        for i, chunk in zip(members, actions):
            out[i] = chunk
    return [chunk for chunk in out if chunk is not None]
