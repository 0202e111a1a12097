"""Remote policies over openpi's websocket protocol: ``RemotePolicyAgent`` (the client) and the message format.

A policy that cannot share this process (another Python, another torch, JAX) runs in a *policy server* and is called
over a websocket, as openpi serves pi0 / pi0.5 (``openpi_client.WebsocketClientPolicy``) and as
``cosmos3-gym serve-policy`` serves this package's policies (``agents.serving``). The protocol is openpi's, spoken
with ``msgpack`` and ``websockets`` directly (``openpi-client`` pins numpy < 2):

* **Messages** are msgpack maps. A numpy array is the map ``{b"__ndarray__": True, b"data": bytes, b"dtype":
  dtype.str, b"shape": shape}`` and a numpy scalar ``{b"__npgeneric__": True, b"data": value, b"dtype": dtype.str}``
  (openpi's ``msgpack_numpy``: ``pack``/``unpack`` here); object, void and complex dtypes are refused.
* **Handshake**: on connect the server sends its metadata (a packed map) before anything else.
* **Requests**: the client sends one packed observation map and receives one packed map with ``"actions"`` (an
  array ``[steps, dim]``) and, from openpi's server, ``"server_timing"``. A server whose policy failed sends the
  traceback as a *text* frame and closes the connection.
* **API key** (optional): the handshake carries the header ``Authorization: Api-Key KEY``.

Observations. ``ObservationAdapter`` maps what the env observes to the keys a server expects: the image to
``"observation/image"``, the state (when the env has one) to ``"observation/state"`` and the task to ``"prompt"``
(openpi's LIBERO example keys). Give other keys (``ObservationAdapter(image_key="observation/exterior_image_1_left")``,
constant ``extra`` entries) or any callable ``(image, state, task) -> dict``.

Actions. The reply's ``"actions"`` become one chunk of the env: a longer chunk is cut to the env's ``chunk`` steps
(openpi's clients also execute the first steps of a chunk), a shorter one or another width is a malformed reply.
By default actions are taken to be in the env's normalised space; ``raw_actions=True`` maps raw (dataset-unit)
actions through ``action_stats.normalize``. Either way they are clipped to [-1, 1], as ``PolicyAgent``'s are.

Batches. ``act(frames [N, H, W, 3])`` sends one request per row, concurrently (a thread each, one connection per
row kept open between calls), so a vector env's slots wait for one round trip, not N.

Errors. Every failure is one line naming the server: connection refused, a refused API key (HTTP 401/403), no reply
within ``timeout`` seconds, a lost connection, the server's policy failing (its traceback's last line) and a
malformed reply. They raise ``RemotePolicyError`` (an ``InputError``), which says which rows failed and carries the
actions of the rows that did answer, so an evaluation can fail the episodes in flight and go on. A connection that
failed is closed and opened again on the next call.

Specs. ``ws://HOST:PORT`` and ``wss://HOST:PORT`` (a path may follow) are policy specs of ``cosmos3-gym eval``,
``eval-real``, ``dream`` and the evaluation API (``policy_specs``). Client options can follow in the URL's fragment,
which is never sent to the server: ``ws://HOST:PORT#image=KEY&state=KEY&prompt=KEY&timeout=SECONDS&actions=raw``.
The API key comes from ``api_key=`` or the environment variable ``COSMOS3_GYM_POLICY_API_KEY``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import msgpack
import numpy as np

from ..errors import InputError

__all__ = [
    "API_KEY_ENV_VAR",
    "DEFAULT_TIMEOUT",
    "ObservationAdapter",
    "RemotePolicyAgent",
    "RemotePolicyError",
    "is_remote_spec",
    "pack",
    "parse_remote_spec",
    "unpack",
]

API_KEY_ENV_VAR = "COSMOS3_GYM_POLICY_API_KEY"
DEFAULT_TIMEOUT = 60.0  # seconds for one reply (a large policy's first call may compile)
SCHEMES = ("ws://", "wss://")
SPEC_OPTIONS = ("image", "state", "prompt", "timeout", "actions")


# ---------------------------------------------------------------------------------------------------------------
# Messages (openpi's msgpack_numpy)
# ---------------------------------------------------------------------------------------------------------------


def _pack_numpy(value: Any) -> Any:
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in ("V", "O", "c"):
        raise ValueError(f"unsupported dtype: {value.dtype}")
    if isinstance(value, np.ndarray):
        return {b"__ndarray__": True, b"data": value.tobytes(), b"dtype": value.dtype.str, b"shape": value.shape}
    if isinstance(value, np.generic):
        return {b"__npgeneric__": True, b"data": value.item(), b"dtype": value.dtype.str}
    return value


def _unpack_numpy(value: dict) -> Any:
    if b"__ndarray__" in value:
        return np.ndarray(buffer=value[b"data"], dtype=np.dtype(value[b"dtype"]), shape=value[b"shape"])
    if b"__npgeneric__" in value:
        return np.dtype(value[b"dtype"]).type(value[b"data"])
    return value


def pack(message: Any) -> bytes:
    """``message`` (maps, lists, numbers, strings, numpy arrays and scalars) as openpi's msgpack bytes."""
    return msgpack.packb(message, default=_pack_numpy)


def unpack(data: bytes) -> Any:
    """openpi's msgpack bytes back to Python (arrays come back as read-only numpy arrays)."""
    return msgpack.unpackb(data, object_hook=_unpack_numpy)


# ---------------------------------------------------------------------------------------------------------------
# Observations
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObservationAdapter:
    """What one request holds: ``image`` (uint8 ``[H, W, 3]``) under ``image_key``, the ``state`` (if any) under
    ``state_key`` and the task (if any) under ``prompt_key``, plus the constant ``extra`` entries. ``read`` is the
    inverse (a server's view). A key set to None leaves that item out."""

    image_key: str = "observation/image"
    state_key: str | None = "observation/state"
    prompt_key: str | None = "prompt"
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, image: np.ndarray, state: Any = None, task: str | None = None) -> dict[str, Any]:
        request: dict[str, Any] = dict(self.extra)
        request[self.image_key] = np.ascontiguousarray(image)
        if state is not None and self.state_key is not None:
            request[self.state_key] = np.asarray(state, dtype=np.float32)
        if task is not None and self.prompt_key is not None:
            request[self.prompt_key] = str(task)
        return request

    def read(self, request: Mapping[str, Any]) -> tuple[Any, Any, str | None]:
        """``(image, state, task)`` of a request (state and task None when absent); ``InputError`` without an
        image."""
        if not isinstance(request, Mapping):
            raise InputError(f"request: expected a map of observations, got {type(request).__name__}")
        if self.image_key not in request:
            raise InputError(f"request: no {self.image_key!r} entry (keys: {sorted(map(str, request))})")
        state = request.get(self.state_key) if self.state_key is not None else None
        task = request.get(self.prompt_key) if self.prompt_key is not None else None
        return request[self.image_key], state, None if task is None else str(task)


# ---------------------------------------------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------------------------------------------


def is_remote_spec(text: Any) -> bool:
    """Whether ``text`` is a remote policy spec (``ws://`` or ``wss://``)."""
    return isinstance(text, str) and text.strip().lower().startswith(SCHEMES)


def parse_remote_spec(text: str) -> tuple[str, dict[str, str]]:
    """``ws://HOST:PORT[/PATH][#OPTIONS]`` -> ``(url without the fragment, options)``; ``InputError`` naming the
    spec for a URL without a host, a bad port or an unknown option."""
    text = text.strip()
    url, _, fragment = text.partition("#")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise InputError(f"policy: {text!r} is not a websocket URL ({error}).") from None
    if parts.scheme.lower() not in ("ws", "wss") or not parts.hostname:
        raise InputError(f"policy: {text!r}: expected ws://HOST:PORT or wss://HOST:PORT.")
    if port == 0:
        raise InputError(f"policy: {text!r}: the port must be 1 to 65535.")
    options = dict(parse_qsl(fragment, keep_blank_values=True)) if fragment else {}
    unknown = sorted(set(options) - set(SPEC_OPTIONS))
    if unknown:
        raise InputError(f"policy: {text!r}: unknown option(s) {unknown}; known: {list(SPEC_OPTIONS)}.")
    if "actions" in options and options["actions"] not in ("raw", "normalized"):
        raise InputError(f"policy: {text!r}: actions= must be 'raw' or 'normalized', got {options['actions']!r}.")
    if "timeout" in options:
        try:
            timeout = float(options["timeout"])
        except ValueError:
            timeout = -1.0
        if not timeout > 0:
            raise InputError(f"policy: {text!r}: timeout= must be a positive number of seconds.")
    return url, options


# ---------------------------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------------------------


class RemotePolicyError(InputError):
    """A policy server failed some rows of a call. ``failed``: bool ``[N]``; ``actions``: ``[N, chunk, dim]`` with
    the rows that answered filled in and zeros elsewhere (None when no row answered and the shape is unknown)."""

    def __init__(self, message: str, failed: np.ndarray, actions: np.ndarray | None = None):
        super().__init__(message)
        self.failed = failed
        self.actions = actions


class _Failure(Exception):
    """One row's failure: the reason, without the server's name (added once for all rows)."""


class RemotePolicyAgent:
    """A frame agent whose policy runs in a server speaking openpi's protocol (see the module docstring).

    ``act(frames uint8 [N, H, W, 3], task=None, state=None) -> [N, chunk, dim]`` float32 in [-1, 1]: one request per
    row, sent concurrently. ``task``: one string or one per row (the ``prompt``; default the agent's ``task``);
    ``state``: ``[N, ...]`` (or None). ``timeout``: seconds for the handshake and for each reply.
    ``observation_adapter``: an ``ObservationAdapter`` or a callable ``(image, state, task) -> dict``.
    ``chunk``: the steps the env takes per action (a longer reply is cut); ``action_shape``: ``(chunk, dim)`` when
    known (else from the server's metadata ``"action_shape"`` or its first reply). ``raw_actions``: the server
    answers in raw units, normalised with ``action_stats``. Not thread-safe: one ``act`` at a time.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        observation_adapter: ObservationAdapter | Callable[..., dict] | None = None,
        task: str | None = None,
        chunk: int | None = None,
        action_shape: Sequence[int] | None = None,
        raw_actions: bool = False,
        action_stats: Any = None,
        name: str | None = None,
    ):
        url, options = parse_remote_spec(url)
        if options:
            raise InputError(f"url: {url!r}: give client options as arguments, not in the URL's fragment.")
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise InputError(f"timeout: expected a positive number of seconds, got {timeout!r}.")
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1):
            raise InputError(f"chunk: expected an integer >= 1 or None, got {chunk!r}.")
        if raw_actions and not callable(getattr(action_stats, "normalize", None)):
            raise InputError("action_stats: raw_actions=True needs the env's action statistics (an ActionStats).")
        adapter = observation_adapter if observation_adapter is not None else ObservationAdapter()
        if not callable(adapter):
            raise InputError(f"observation_adapter: expected a callable, got {type(adapter).__name__}.")
        self.url, self.name = url, name or url
        self.api_key = api_key if api_key is not None else os.environ.get(API_KEY_ENV_VAR) or None
        self.timeout = float(timeout)
        self.observation_adapter = adapter
        self.task = task
        self.chunk = None if chunk is None else int(chunk)
        self.action_shape: tuple[int, int] | None = None
        if action_shape is not None:
            self._set_action_shape(action_shape, "action_shape")
        self.raw_actions, self.action_stats = bool(raw_actions), action_stats
        self.metadata: dict[str, Any] | None = None
        self._connections: list[Any] = []
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._metadata_lock = threading.Lock()

    @classmethod
    def from_spec(
        cls, spec: str, *, api_key: str | None = None, chunk: int | None = None, action_stats: Any = None
    ) -> RemotePolicyAgent:
        """The agent of a spec ``ws://HOST:PORT[#OPTIONS]`` (module docstring)."""
        url, options = parse_remote_spec(spec)
        defaults = ObservationAdapter()
        adapter = ObservationAdapter(
            image_key=options.get("image") or defaults.image_key,
            state_key=options.get("state") or defaults.state_key,
            prompt_key=options.get("prompt") or defaults.prompt_key,
        )
        raw = options.get("actions") == "raw"
        if raw and action_stats is None:
            raise InputError(f"policy: {spec!r}: actions=raw needs the env's action statistics; this env has none.")
        return cls(
            url,
            api_key,
            timeout=float(options.get("timeout", DEFAULT_TIMEOUT)),
            observation_adapter=adapter,
            chunk=chunk,
            raw_actions=raw,
            action_stats=action_stats,
            name=spec.strip(),
        )

    def _set_action_shape(self, shape: Any, where: str) -> None:
        try:
            steps, dim = (int(size) for size in shape)
        except (TypeError, ValueError):
            raise InputError(f"{where}: expected (steps, dim), got {shape!r}.") from None
        if self.chunk is not None:
            steps = self.chunk
        self.action_shape = (steps, dim)

    # ------------------------------------------------------------------------------------------ connections

    def connect(self) -> dict[str, Any]:
        """Open the first connection (if not open) and return the server's metadata; ``RemotePolicyError`` naming
        the server when it cannot be reached."""
        try:
            self._connection(0)
        except _Failure as failure:
            raise RemotePolicyError(f"policy server {self.name}: {failure}", np.ones(1, bool)) from None
        assert self.metadata is not None  # set by the first handshake
        return self.metadata

    def _connection(self, slot: int) -> Any:
        while len(self._connections) <= slot:
            self._connections.append(None)
        if self._connections[slot] is None:
            self._connections[slot] = self._open()
        return self._connections[slot]

    def _open(self) -> Any:
        from websockets.exceptions import InvalidHandshake, InvalidStatus, InvalidURI
        from websockets.sync.client import connect

        headers = {"Authorization": f"Api-Key {self.api_key}"} if self.api_key else None
        try:
            # Entered as a context manager (websockets >= 17.1 warns otherwise); close() ends it.
            connection = connect(
                self.url,
                compression=None,
                max_size=None,
                additional_headers=headers,
                open_timeout=self.timeout,
                close_timeout=1,
            ).__enter__()
        except InvalidStatus as error:
            status = error.response.status_code
            hint = " (a wrong or missing API key?)" if status in (401, 403) else ""
            raise _Failure(f"refused the connection: HTTP {status}{hint}") from None
        except (TimeoutError, InvalidHandshake, InvalidURI, OSError, EOFError) as error:
            raise _Failure(f"cannot connect ({_reason(error)})") from None
        try:
            metadata = self._receive(connection, "the metadata")
        except _Failure:
            connection.close()
            raise
        with self._metadata_lock:
            if self.metadata is None:
                self.metadata = metadata
                shape = metadata.get("action_shape")
                if self.action_shape is None and shape is not None:
                    try:
                        self._set_action_shape(shape, "metadata")
                    except InputError:
                        pass  # the replies decide
        return connection

    def _receive(self, connection: Any, what: str) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        try:
            data = connection.recv(timeout=self.timeout)
        except TimeoutError:
            raise _Failure(f"no reply within {self.timeout:g} s waiting for {what} (timeout)") from None
        except ConnectionClosed as error:
            raise _Failure(f"lost the connection waiting for {what} ({_reason(error)})") from None
        except OSError as error:
            raise _Failure(f"lost the connection waiting for {what} ({_reason(error)})") from None
        if isinstance(data, str):  # openpi's server sends its policy's traceback as text, then closes
            lines = [line for line in data.strip().splitlines() if line.strip()]
            raise _Failure(f"the server's policy failed: {lines[-1].strip() if lines else 'no message'}")
        try:
            message = unpack(data)
        except Exception as error:  # msgpack raises several types (ExtraData, FormatError, ValueError, TypeError)
            raise _Failure(f"malformed reply to {what}: not openpi's msgpack ({_reason(error)})") from None
        if not isinstance(message, dict):
            raise _Failure(f"malformed reply to {what}: expected a map, got {type(message).__name__}")
        return message

    def _drop(self, slot: int) -> None:
        connection = self._connections[slot] if slot < len(self._connections) else None
        if connection is not None:
            self._connections[slot] = None
            try:
                connection.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is dropped either way
                pass

    def close(self) -> None:
        """Close every connection (the next call opens them again)."""
        for slot in range(len(self._connections)):
            self._drop(slot)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def __enter__(self) -> RemotePolicyAgent:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------------------------------------ calls

    def _request(self, slot: int, request: dict[str, Any]) -> np.ndarray:
        from websockets.exceptions import ConnectionClosed

        try:
            data = pack(request)
        except (TypeError, ValueError) as error:
            raise InputError(f"observation: cannot send it to {self.name} ({error})") from None
        try:
            connection = self._connection(slot)
            try:
                connection.send(data)
            except (ConnectionClosed, OSError) as error:
                raise _Failure(f"lost the connection sending the observation ({_reason(error)})") from None
            reply = self._receive(connection, "actions")
            return self._actions(reply)
        except _Failure:
            self._drop(slot)  # its state is unknown (a late reply would answer the next request): open a new one
            raise

    def _actions(self, reply: dict[str, Any]) -> np.ndarray:
        if "actions" not in reply:
            raise _Failure(f"malformed reply: no 'actions' entry (keys: {sorted(map(str, reply))})")
        try:
            actions = np.asarray(reply["actions"], dtype=np.float32)
        except (TypeError, ValueError) as error:
            raise _Failure(f"malformed reply: 'actions' is not a numeric array ({error})") from None
        if actions.ndim != 2 or actions.shape[0] < 1 or actions.shape[1] < 1:
            raise _Failure(f"malformed reply: 'actions' must be [steps, dim], got shape {list(actions.shape)}")
        if not np.isfinite(actions).all():
            raise _Failure("malformed reply: 'actions' contains NaN or infinity")
        steps = self.chunk if self.chunk is not None else actions.shape[0]
        if self.action_shape is not None:
            steps = self.action_shape[0]
            if actions.shape[1] != self.action_shape[1]:
                raise _Failure(f"malformed reply: actions of width {actions.shape[1]}, expected {self.action_shape[1]}")
        if actions.shape[0] < steps:
            raise _Failure(f"malformed reply: {actions.shape[0]} action steps, the env takes {steps} per step")
        actions = actions[:steps]
        if self.raw_actions:
            actions = np.asarray(self.action_stats.normalize(actions), dtype=np.float32)
        return np.clip(actions, -1.0, 1.0)

    def act(self, frames: Any, task: str | Sequence[str] | None = None, state: Any = None) -> np.ndarray:
        """Action chunks ``[N, chunk, dim]`` for the images ``[N, H, W, 3]`` (one image gives ``[chunk, dim]``)."""
        images = np.asarray(frames)
        single = images.ndim == 3
        if single:
            images = images[None]
        if images.ndim != 4 or not len(images):
            raise InputError(f"frames: expected [N, H, W, 3] images, got shape {list(np.asarray(frames).shape)}.")
        count = len(images)
        tasks = self._tasks(task, count)
        states = None
        if state is not None:
            states = np.asarray(state)
            states = states[None] if single else states
            if len(states) != count:
                raise InputError(f"state: expected one row per image ({count}), got {len(states)}.")
        requests = [
            self.observation_adapter(images[i], None if states is None else states[i], tasks[i]) for i in range(count)
        ]
        outcomes: list[np.ndarray | _Failure] = [_Failure("not sent")] * count

        def run(slot: int) -> None:
            try:
                outcomes[slot] = self._request(slot, requests[slot])
            except _Failure as failure:
                outcomes[slot] = failure

        if count == 1:
            run(0)
        else:
            if self._pool is None or self._pool_size < count:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="remote-policy")
                self._pool_size = count
            list(self._pool.map(run, range(count)))
        answered = [outcome for outcome in outcomes if isinstance(outcome, np.ndarray)]
        if self.action_shape is None and answered:
            self.action_shape = (int(answered[0].shape[0]), int(answered[0].shape[1]))
        failed = np.array([isinstance(outcome, _Failure) for outcome in outcomes])
        if failed.any():
            actions = None
            if self.action_shape is not None:
                actions = np.zeros((count, *self.action_shape), np.float32)
                for i, outcome in enumerate(outcomes):
                    if isinstance(outcome, np.ndarray) and outcome.shape == self.action_shape:
                        actions[i] = outcome
            first = next(outcome for outcome in outcomes if isinstance(outcome, _Failure))
            rows = np.flatnonzero(failed).tolist()
            which = "" if count == 1 else f" (row{'s' * (len(rows) > 1)} {', '.join(map(str, rows))} of {count})"
            raise RemotePolicyError(f"policy server {self.name}: {first}{which}", failed, actions)
        if len({outcome.shape for outcome in answered}) > 1:
            raise RemotePolicyError(
                f"policy server {self.name}: malformed reply: action chunks of different shapes in one call",
                np.ones(count, bool),
            )
        result = np.stack(answered)
        return result[0] if single else result

    def _tasks(self, task: str | Sequence[str] | None, count: int) -> list[str | None]:
        task = self.task if task is None else task
        if task is None or isinstance(task, str):
            return [task] * count
        tasks = list(task)
        if len(tasks) != count:
            raise InputError(f"task: expected one string or {count} (one per image), got {len(tasks)}.")
        return [None if t is None else str(t) for t in tasks]

    __call__ = act


def _reason(error: BaseException) -> str:
    """A short, one-line reason for a connection error."""
    if isinstance(error, ConnectionRefusedError):
        return "connection refused: is the server running?"
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
