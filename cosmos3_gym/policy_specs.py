"""Policy specs: the one registry of policies that ``cosmos3-gym eval``, ``cosmos3-gym eval-real`` and the
evaluation API accept, by name.

======================  =========================================================================================
spec                    policy
======================  =========================================================================================
``random``              uniform random actions (seeded)
``NAME:NUMBER``         a kind a task registered (``register_policy_kind``), e.g. a scripted policy with NUMBER
                        pixels of noise (``scripted:NOISE``)
``agent``               the world-model checkpoint's own policy mode (``PolicyAgent``)
``file:PATH``           a policy file this package saved; its safetensors metadata says what it is (below)
``sb3:PATH``            a Stable-Baselines3 PPO policy of ``agents.save_sb3_policy`` (``ppo:PATH`` is an alias)
``ws://HOST:PORT``      a policy server speaking openpi's websocket protocol (``wss://`` too; a path and client
                        options in the URL's fragment may follow: ``agents.remote``), e.g. ``cosmos3-gym
                        serve-policy`` or an openpi pi0 server; its API key from ``COSMOS3_GYM_POLICY_API_KEY``
``module:factory``      (``eval`` only) ``factory(env)`` from a module or ``path/to/file.py``: a callable
                        ``obs -> action`` or an object with SB3's ``predict``
======================  =========================================================================================

Policy files. Every policy this package saves is one ``.safetensors`` file whose string metadata names its kind:

* ``{"format": "cosmos3_gym.policy", "kind": KIND, ...}``: loaded by the loader registered for ``KIND`` in
  ``POLICY_FILE_LOADERS`` (``"pixel_gaussian"``: ``cosmos3_gym.rl.policy:load_policy_file``, the behaviour-cloned
  and GRPO pixel policies). A loader is named by a ``"module:function"`` string and imported only when a file of its
  kind is loaded; ``register_policy_file_kind`` adds one.
* ``save_sb3_policy``'s files (``format`` ``cosmos3_gym.sb3_policy.v1``): rebuilt by ``load_sb3_policy``.

A loaded file policy is a *frame agent*: ``agent.act(frames uint8 [N, H, W, 3]) -> actions [N, chunk, dim]``,
normalised to [-1, 1] (the world-model env's action space); ``action_shape`` (``(chunk, dim)``) when it knows it.
The header of a file is read when its spec is parsed, so a wrong path or format fails before any model loads.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .agents.remote import RemotePolicyAgent, is_remote_spec, parse_remote_spec
from .errors import InputError

__all__ = [
    "POLICY_FILE_FORMAT",
    "POLICY_FILE_LOADERS",
    "FramePolicy",
    "PolicyKind",
    "PolicySpec",
    "RandomPolicy",
    "RemoteFramePolicy",
    "check_policy_fits_env",
    "load_frame_agent",
    "load_policy",
    "parse_policy_spec",
    "parse_policy_specs",
    "policy_file_kind",
    "policy_spec_help",
    "register_policy_file_kind",
    "register_policy_kind",
]

POLICY_FILE_FORMAT = "cosmos3_gym.policy"
SB3_FILE_FORMAT = "cosmos3_gym.sb3_policy.v1"  # agents/sb3_policy.FORMAT (not imported: it pulls in SB3 and torch)
# kind -> "module:function" taking the file path and returning a frame agent (see the module docstring).
POLICY_FILE_LOADERS: dict[str, str | Callable[[str], Any]] = {
    "pixel_gaussian": "cosmos3_gym.rl.policy:load_policy_file",
}
BUILTIN_SPEC_HELP = (
    "'random', 'agent', 'file:PATH' (a policy file of this package), 'sb3:PATH' / 'ppo:PATH' (a save_sb3_policy file), "
    "'ws://HOST:PORT' (a policy server speaking openpi's protocol)"
)
RESERVED_NAMES = ("random", "agent", "file", "sb3", "ppo", "ws", "wss")


@dataclass(frozen=True)
class PolicyKind:
    """A spec kind ``NAME:NUMBER`` a task adds (``register_policy_kind``), e.g. a scripted policy and its noise.

    ``frame_agent``: ``"module:function"`` of ``function(spec, *, action_stats, chunk, seed) -> frame agent`` for a
    kind that acts on frames (it then runs closed loop in a world model too); None for one that reads its simulator's
    true state and runs only in that simulator. ``runs_where``: where such a policy runs, for the error ``eval``
    gives (it cannot build it for an arbitrary env)."""

    name: str
    argument: str  # what NUMBER means, for help texts ("NOISE")
    frame_agent: str | None
    runs_where: str


POLICY_KINDS: dict[str, PolicyKind] = {}


def register_policy_kind(kind: PolicyKind) -> None:
    """Make ``KIND:NUMBER`` a policy spec (idempotent for the same kind)."""
    if kind.name in RESERVED_NAMES:
        raise InputError(f"kind: {kind.name!r} is a built-in spec name.")
    POLICY_KINDS[kind.name] = kind


def policy_spec_help() -> str:
    """Every spec form, for help texts and errors."""
    registered = ", ".join(f"'{kind.name}:{kind.argument}'" for kind in POLICY_KINDS.values())
    return f"{BUILTIN_SPEC_HELP}, {registered}" if registered else BUILTIN_SPEC_HELP


def register_policy_file_kind(kind: str, loader: str | Callable[[str], Any]) -> None:
    """Load policy files of ``kind`` with ``loader``: a ``"module:function"`` string or a callable ``path -> agent``."""
    if not isinstance(kind, str) or not kind:
        raise InputError(f"kind: expected a non-empty string, got {kind!r}.")
    POLICY_FILE_LOADERS[kind] = loader


@dataclass(frozen=True)
class PolicySpec:
    """A parsed spec. ``kind``: random | agent | sb3 (or its alias ppo) | file | remote (``ws://``) | factory | a
    registered ``PolicyKind``'s name; ``file_kind``: for ``file``, the kind in the file's metadata ("sb3" for
    save_sb3_policy files)."""

    spec: str
    kind: str
    noise: float = 0.0  # a registered kind's NUMBER (a scripted policy's noise)
    path: str | None = None  # sb3 / file: the policy file; factory: the module or .py file; remote: the server's URL
    file_kind: str | None = None
    attribute: str | None = None  # factory: the factory's (dotted) name

    @property
    def acts_on_frames(self) -> bool:
        """True for policies that observe images (and so run closed loop in a world model)."""
        registered = POLICY_KINDS.get(self.kind)
        return self.kind in ("agent", "sb3", "ppo", "file", "remote") or (
            registered is not None and registered.frame_agent is not None
        )

    closed_loop_in_world_model = acts_on_frames

    @property
    def is_sb3_file(self) -> bool:
        return self.kind in ("sb3", "ppo") or self.file_kind == "sb3"


def parse_policy_spec(text: str, *, allow_factory: bool = False) -> PolicySpec:
    """One spec string -> ``PolicySpec`` (``InputError`` naming the spec otherwise). ``allow_factory``: also accept
    ``module:factory`` / ``file.py:factory`` (``eval``)."""
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"policy: expected {policy_spec_help()}, got {text!r}.")
    text = text.strip()
    if text in ("random", "agent"):
        return PolicySpec(text, text)
    if is_remote_spec(text):
        url, _ = parse_remote_spec(text)  # checks the URL and its options; nothing connects yet
        return PolicySpec(text, "remote", path=url)
    name, colon, argument = text.partition(":")
    if name in POLICY_KINDS and colon:
        try:
            noise = float(argument or 0.0)
        except ValueError:
            noise = -1.0
        if not noise >= 0:
            raise InputError(f"policy: {text!r}: {POLICY_KINDS[name].argument} must be a number >= 0.")
        return PolicySpec(text, name, noise=noise)
    if name in ("sb3", "ppo") and argument:
        from .agents.sb3_policy import read_sb3_policy_metadata

        try:  # the header only: a wrong file fails before any model loads
            read_sb3_policy_metadata(argument)
        except InputError as error:
            raise InputError(f"policy: {text!r}: {error}") from None
        return PolicySpec(text, name, path=argument, file_kind="sb3")
    if name == "file" and argument:
        return PolicySpec(text, "file", path=argument, file_kind=policy_file_kind(argument, text))
    if allow_factory and colon and name and argument and name not in ("sb3", "ppo", "file", *POLICY_KINDS):
        module_name, _, attribute = text.rpartition(":")
        return PolicySpec(text, "factory", path=module_name, attribute=attribute)
    raise InputError(
        f"policy: {text!r} is not one of {policy_spec_help()}"
        + (" or 'module:factory' / 'file.py:factory'." if allow_factory else ".")
    )


def parse_policy_specs(specs: str | Sequence[str]) -> list[PolicySpec]:
    """``"random,scripted:0,agent,file:PATH"`` (or a list of such items) -> ``PolicySpec``s, each at most once."""
    items = [item.strip() for item in (specs.split(",") if isinstance(specs, str) else specs) if item.strip()]
    if not items:
        raise InputError("policies: expected a comma-separated list such as 'random,scripted:0,agent', got none.")
    parsed = []
    for item in items:
        try:
            parsed.append(parse_policy_spec(item))
        except InputError as error:
            raise InputError(str(error).replace("policy: ", "policies: ", 1)) from None
    if len({spec.spec for spec in parsed}) != len(parsed):
        raise InputError(f"policies: each policy may appear once, got {items}.")
    return parsed


def policy_file_kind(path: str | os.PathLike, spec: str | None = None) -> str:
    """What the policy file at ``path`` is, from its safetensors metadata: "sb3" or a registered kind."""
    import safetensors

    where = f"policy: {spec!r}" if spec else f"policy: {str(path)!r}"
    path = Path(path).expanduser()
    if not path.is_file():
        raise InputError(f"{where}: file not found: {path} does not exist.")
    try:
        with safetensors.safe_open(str(path), framework="numpy") as handle:
            raw = handle.metadata() or {}
    except Exception as error:  # safetensors raises its own error types for a bad header or a truncated file
        raise InputError(f"{where}: {path} is not a readable safetensors file ({error}).") from None
    metadata = {key: _json_or_text(value) for key, value in raw.items()}
    if metadata.get("format") == SB3_FILE_FORMAT:
        return "sb3"
    if metadata.get("format") != POLICY_FILE_FORMAT:
        raise InputError(
            f"{where}: {path} has no policy metadata this package knows (format "
            f"{metadata.get('format')!r}; expected {POLICY_FILE_FORMAT!r} or {SB3_FILE_FORMAT!r})."
        )
    kind = metadata.get("kind")
    if kind not in POLICY_FILE_LOADERS:
        raise InputError(f"{where}: {path} is a policy of kind {kind!r}; known kinds: {sorted(POLICY_FILE_LOADERS)}.")
    return kind


def _json_or_text(value: str) -> Any:
    # save_sb3_policy JSON-encodes every value; other writers store plain strings.
    try:
        return json.loads(value)
    except (json.JSONDecodeError, TypeError):
        return value


def load_frame_agent(
    spec: PolicySpec | str,
    *,
    make_agent: Callable[[], Any] | None = None,
    device: str = "cpu",
    action_stats: Any = None,
    chunk: int | None = None,
    seed: int = 0,
) -> Any:
    """The frame agent (``act(frames [N, H, W, 3]) -> [N, chunk, dim]``) of a policy that observes images:
    a policy file, ``make_agent()`` for ``"agent"``, a policy server (``ws://``: a ``RemotePolicyAgent`` acting in
    chunks of ``chunk`` steps, connected here so that an unreachable server fails before any model loads), or a
    registered kind that acts on frames (its factory gets the world model's ``action_stats`` and ``chunk``; ``seed``
    seeds its noise)."""
    spec = parse_policy_spec(spec) if isinstance(spec, str) else spec
    if spec.kind == "remote":
        agent = RemotePolicyAgent.from_spec(spec.spec, chunk=chunk, action_stats=action_stats)
        agent.connect()
        return agent
    registered = POLICY_KINDS.get(spec.kind)
    if registered is not None and registered.frame_agent is not None:
        module_name, attribute = registered.frame_agent.split(":")  # "module:function"
        factory = _import_attribute(module_name, attribute, spec.spec)
        return factory(spec, action_stats=action_stats, chunk=chunk, seed=seed)
    if spec.kind == "agent":
        if make_agent is None:
            raise InputError("make_agent: the 'agent' policy needs make_agent() -> the checkpoint's PolicyAgent.")
        return make_agent()
    path = spec.path
    if spec.is_sb3_file:
        from .agents.sb3_policy import SB3PolicyAgent

        assert path is not None  # an sb3 / file spec carries its file
        return _wrap_load_error(spec, lambda: SB3PolicyAgent.from_file(path, device=device))
    if spec.kind == "file":
        file_kind = spec.file_kind
        assert path is not None and file_kind is not None  # parse_policy_spec reads a file spec's kind
        loader = POLICY_FILE_LOADERS[file_kind]
        if isinstance(loader, str):
            module_name, _, attribute = loader.partition(":")
            try:
                loader = getattr(importlib.import_module(module_name), attribute)
            except (ImportError, AttributeError) as error:
                raise InputError(
                    f"policy: {spec.spec!r}: the loader {POLICY_FILE_LOADERS[file_kind]!r} of "
                    f"kind {file_kind!r} is not available ({error})."
                ) from None
        agent = _wrap_load_error(spec, lambda: loader(path))
        if not callable(getattr(agent, "act", None)):
            raise InputError(f"policy: {spec.spec!r}: the loader returned a {type(agent).__name__} without act().")
        return agent
    raise InputError(f"policy: {spec.spec!r} does not act on frames (expected 'agent' or a policy file).")


def _wrap_load_error(spec: PolicySpec, load: Callable[[], Any]) -> Any:
    from .errors import CheckpointError

    try:
        return load()
    except (InputError, CheckpointError) as error:
        raise InputError(f"policy: {spec.spec!r}: {error}") from None


# ---------------------------------------------------------------------------------------------------------------
# Policies for a Gymnasium env (eval)
# ---------------------------------------------------------------------------------------------------------------


class RandomPolicy:
    """Uniformly random actions from (a seeded copy of) an action space; batched for a vector env's space."""

    name = "random"

    def __init__(self, action_space: Any, seed: int | None = 0):
        self.action_space = copy.deepcopy(action_space)
        self.action_space.seed(seed)

    def __call__(self, observation: Any) -> Any:
        return self.action_space.sample()


class FramePolicy:
    """A frame agent as a Gymnasium policy: ``policy(obs) -> actions`` with ``obs["image"]`` (batched ``[N, H, W,
    3]`` for a vector env, or one ``[H, W, 3]`` image)."""

    def __init__(self, agent: Any, name: str):
        self.agent, self.name = agent, name

    def __call__(self, observation: Any) -> Any:
        import numpy as np

        images = np.asarray(observation["image"] if isinstance(observation, dict) else observation)
        if images.ndim == 3:
            return self.agent.act(images[None])[0]
        return self.agent.act(images)


class RemoteFramePolicy(FramePolicy):
    """A ``RemotePolicyAgent`` as a Gymnasium policy: ``policy(obs, tasks=None) -> actions`` sends each slot's image,
    its state (``obs["state"]``, when the env observes one) and its task (the evaluation passes every slot's)."""

    takes_tasks = True

    def __call__(self, observation: Any, tasks: Any = None) -> Any:
        import numpy as np

        images = np.asarray(observation["image"] if isinstance(observation, dict) else observation)
        state = observation.get("state") if isinstance(observation, dict) else None
        if images.ndim == 3:
            task = None if tasks is None else [tasks] if isinstance(tasks, str) else list(tasks)
            return self.agent.act(images[None], task=task, state=None if state is None else np.asarray(state)[None])[0]
        return self.agent.act(images, task=tasks, state=state)


def load_policy(spec: str, env: Any, *, seed: int | None = 0) -> Any:
    """A policy for ``env`` (a Gymnasium env or vector env) from a spec (see the module docstring), checked against
    the env's spaces where the policy records its own (``check_policy_fits_env``)."""
    parsed = parse_policy_spec(spec, allow_factory=True)
    if parsed.kind == "random":
        return RandomPolicy(env.action_space, seed)
    if parsed.kind == "agent":
        return _policy_agent(env, seed)
    if parsed.kind in POLICY_KINDS:
        raise InputError(f"policy: {spec!r} runs {POLICY_KINDS[parsed.kind].runs_where}.")
    if parsed.is_sb3_file:
        from .agents.sb3_policy import load_sb3_policy

        sb3_path = parsed.path
        assert sb3_path is not None  # an sb3 / file spec carries its file
        policy = _wrap_load_error(parsed, lambda: load_sb3_policy(sb3_path))
        check_policy_fits_env(policy, env, spec)
        return policy
    if parsed.kind == "file":
        agent = load_frame_agent(parsed)
        check_policy_fits_env(agent, env, spec)
        return FramePolicy(agent, spec)
    if parsed.kind == "remote":
        action_space = _single_space(env, "action_space")
        shape = tuple(getattr(action_space, "shape", None) or ())
        stats = getattr(getattr(env, "unwrapped", env), "action_stats", None)
        agent = load_frame_agent(parsed, chunk=int(shape[0]) if len(shape) == 2 else None, action_stats=stats)
        check_policy_fits_env(agent, env, spec)
        return RemoteFramePolicy(agent, spec)
    assert parsed.path is not None and parsed.attribute is not None  # what is left is a factory spec
    factory = _import_attribute(parsed.path, parsed.attribute, spec)
    if not callable(factory):
        raise InputError(f"policy: {spec!r} is a {type(factory).__name__}, not a callable factory(env) -> policy.")
    policy = factory(env)
    if not (callable(policy) or callable(getattr(policy, "predict", None))):
        raise InputError(
            f"policy: the factory {spec!r} returned a {type(policy).__name__}; expected a callable obs -> action or "
            "an object with a Stable-Baselines3 predict() method."
        )
    check_policy_fits_env(policy, env, spec)
    return policy


def _policy_agent(env: Any, seed: int | None) -> Any:
    from .agents import PolicyAgent

    return PolicyAgent.from_env(env, seed=seed)  # InputError naming the env where it is not a world-model env


def _import_attribute(module_name: str, attribute: str, spec: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name).expanduser()
        if not path.is_file():
            raise InputError(f"policy: file not found: {path} (in {spec!r}).")
        module_spec = importlib.util.spec_from_file_location(f"cosmos3_gym_policy_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None  # a .py file has a source loader
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise InputError(f"policy: cannot import module {module_name!r} from {spec!r}: {error}.") from error
    value = module
    for name in attribute.split("."):
        if not hasattr(value, name):
            raise InputError(f"policy: {module_name!r} has no attribute {attribute!r} (from {spec!r}).")
        value = getattr(value, name)
    return value


def _single_space(env: Any, name: str) -> Any:
    return getattr(env, f"single_{name}", None) or getattr(env, name, None)


def _hwc(shape: Sequence[int]) -> tuple[int, ...]:
    """An image space's shape as ``(H, W, C)``; SB3 stores image spaces channels first."""
    shape = tuple(int(size) for size in shape)
    if len(shape) == 3 and shape[0] in (1, 3, 4) and shape[-1] not in (1, 3, 4):
        return shape[1], shape[2], shape[0]
    return shape


def check_policy_fits_env(policy: Any, env: Any, spec: str) -> None:
    """``InputError`` in one line when a policy that records its spaces (SB3 models and policies, frame agents with
    ``image_size`` / ``action_shape``) was made for other observations or actions than ``env``'s."""
    env_observation, env_action = _single_space(env, "observation_space"), _single_space(env, "action_space")
    policy_observation = getattr(policy, "observation_space", None)
    if policy_observation is not None and env_observation is not None:
        policy_keys = set(getattr(policy_observation, "spaces", {}) or {})
        env_keys = set(getattr(env_observation, "spaces", {}) or {})
        if policy_keys != env_keys:
            raise InputError(
                f"policy: {spec!r} observes {sorted(policy_keys) or 'a plain array'}, the env gives "
                f"{sorted(env_keys) or 'a plain array'}."
            )
        for key in policy_keys or [None]:
            ours = policy_observation[key] if key else policy_observation
            theirs = env_observation[key] if key else env_observation
            if _hwc(ours.shape) != _hwc(theirs.shape):
                hint = ""
                if key == "image":
                    hint = (
                        f"; pass --observation-size {_hwc(ours.shape)[0]} (observation_size="
                        f"{_hwc(ours.shape)[0]}) to match"
                    )
                raise InputError(
                    f"policy: {spec!r} was trained on observation {key or ''} of shape "
                    f"{list(_hwc(ours.shape))}, the env gives {list(_hwc(theirs.shape))}{hint}."
                )
    policy_action = getattr(policy, "action_space", None)
    action_shape = tuple(policy_action.shape) if policy_action is not None else getattr(policy, "action_shape", None)
    if action_shape is not None and env_action is not None and tuple(action_shape) != tuple(env_action.shape):
        raise InputError(
            f"policy: {spec!r} acts with actions of shape {list(action_shape)}, the env takes {list(env_action.shape)}."
        )
