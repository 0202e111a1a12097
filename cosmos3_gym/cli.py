"""cosmos3-gym: run, evaluate and train Cosmos3 world models from the command line.

Every subcommand is one ``add_<command>_command(sub)`` (its options) and one ``run_<command>(args)`` (its work). Heavy
imports (torch, diffusers, gymnasium envs) happen inside the ``run_`` functions, so ``--help``, ``--version`` and
argument or file errors answer at once. ``infer`` mirrors PhyAI's ``examples/cosmos3/run_cosmos3_policy.py``; bad
input prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import InputError
from .registration import builtin_model, builtin_models

BUILTIN_CHECKPOINT = "pusht"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default: its value, "off" for switches; options whose default depends on something else
    (the checkpoint, the device) say so in their help text and are left alone."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        config_field = getattr(action, "config_field", None)
        if config_field is not None:  # a training flag left out keeps the config dataclass's default: show it
            return f"{text} (default: {_show_default(config_defaults(config_field[0]).get(config_field[1]))})"
        if action.required or action.default is argparse.SUPPRESS or "default" in text or not action.option_strings:
            return text
        if action.default is False and action.nargs == 0:
            return f"{text} (default: off)"
        if action.default is None:
            return f"{text} (default: none)"
        return f"{text} (default: %(default)s)"


# The training configs' modules (cosmos3_gym/training/), read for their defaults without importing them (torch).
TRAIN_CONFIG_SOURCES = {"VAETrainConfig": "training/vae.py", "WorldModelTrainConfig": "training/world_model.py"}


@functools.cache
def config_defaults(class_name: str) -> dict[str, Any]:
    """The literal defaults of a training config dataclass (``TRAIN_CONFIG_SOURCES``), read from its source: importing
    it would import torch, and ``train --help`` should answer at once. Fields whose default is not a literal (or a
    ``default_factory`` returning one) are left out. tests/test_cli.py compares these with the dataclasses."""
    tree = ast.parse((Path(__file__).resolve().parent / TRAIN_CONFIG_SOURCES[class_name]).read_text())
    (body,) = [node.body for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name]
    defaults: dict[str, Any] = {}
    for item in body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None):
            continue
        value = item.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "field":
            factory = next((k.value for k in value.keywords if k.arg == "default_factory"), None)
            default = next((k.value for k in value.keywords if k.arg == "default"), None)
            if isinstance(factory, ast.Lambda):
                value = factory.body
            elif isinstance(factory, ast.Name) and factory.id in ("dict", "list", "tuple"):
                value = ast.parse(f"{factory.id}()", mode="eval").body
            elif default is not None:
                value = default
            else:
                continue
        try:
            defaults[item.target.id] = _literal(value)
        except ValueError:
            continue
    return defaults


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args and not node.keywords:
        constructors: dict[str, Any] = {"dict": dict, "list": list, "tuple": tuple}
        if node.func.id in constructors:
            return constructors[node.func.id]()
    return ast.literal_eval(node)


def _show_default(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, (dict, list)):
        return json.dumps(value).replace("%", "%%")
    return str(value).replace("%", "%%")


def _config_flag(parser, config: str, flag: str, kind, text: str) -> None:
    """A training flag whose default (None: keep the config's) is shown as ``config``'s field default."""
    action = parser.add_argument(flag, type=kind, default=None, help=text)
    action.config_field = (config, action.dest)


def _add_command(sub, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description or help, formatter_class=HelpFormatter)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _domain(text: str) -> str | int:
    return int(text) if text.lstrip("-").isdigit() else text


def _size(text: str) -> tuple[int, int]:
    """``N`` (square) or ``H,W``."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected N or H,W (positive integers), got {text!r}")
    return (values[0], values[-1])


def _bounds(text: str) -> tuple[float, float]:
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH, got {text!r}") from None
    if not low <= high:
        raise argparse.ArgumentTypeError(f"expected LOW <= HIGH, got {text!r}")
    return low, high


def _version() -> str:
    from . import __version__

    return f"cosmos3-gym {__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cosmos3-gym", description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    add_infer_command(sub)
    add_make_tiny_checkpoint_command(sub)
    add_training_commands(sub)
    add_eval_command(sub)
    add_eval_real_command(sub)
    add_serve_policy_command(sub)
    add_dream_command(sub)
    add_demo_command(sub)
    return parser


# ---------------------------------------------------------------------------------------------------------------
# infer
# ---------------------------------------------------------------------------------------------------------------

# Used where neither the flag nor the checkpoint's meta.json gives a setting (the DROID release's values).
INFER_FALLBACKS = dict(domain="droid_lerobot", chunk=32, resolution_tier=480, fps=15.0, num_steps=4, guidance_scale=3.0)


def add_infer_command(sub) -> None:
    infer = _add_command(sub, "infer", "run one Cosmos3 request (policy / forward / inverse dynamics)")
    infer.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint directory, hub id (diffusers layout), or 'pusht' for the built-in model",
    )
    source = infer.add_mutually_exclusive_group(required=True)
    source.add_argument("--image", help="conditioning image (path)")
    source.add_argument("--video", help="conditioning video (mp4/gif path); inverse_dynamics needs chunk + 1 frames")
    infer.add_argument("--prompt", default="", help="task description")
    infer.add_argument("--negative-prompt", default=None, help="negative prompt for classifier-free guidance")
    from_checkpoint = " (default: the checkpoint's meta.json, else {})"
    infer.add_argument(
        "--domain-name",
        type=_domain,
        default=None,
        help="embodiment name or integer id" + from_checkpoint.format(INFER_FALLBACKS["domain"]),
    )
    infer.add_argument(
        "--raw-action-dim",
        type=int,
        default=None,
        help="action width (default: the checkpoint's meta.json, else the domain table's)",
    )
    infer.add_argument(
        "--mode",
        default="policy",
        help="policy (image -> actions) | forward_dynamics (image + actions -> video) | "
        "inverse_dynamics (video -> actions)",
    )
    infer.add_argument("--action-file", default=None, help="action chunk JSON (forward_dynamics)")
    infer.add_argument("--action-chunk-index", type=int, default=0, help="which chunk of an action_chunks file")
    infer.add_argument(
        "--condition-frames",
        type=_int_list,
        default=None,
        help="clean latent frames, e.g. 0,1 (default: the mode's own)",
    )
    infer.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="action chunk length, the video has chunk + 1 frames" + from_checkpoint.format(INFER_FALLBACKS["chunk"]),
    )
    infer.add_argument(
        "--num-steps",
        type=int,
        default=None,
        help="denoising steps" + from_checkpoint.format(INFER_FALLBACKS["num_steps"]),
    )
    infer.add_argument(
        "--guidance-scale",
        type=float,
        default=None,
        help="classifier-free guidance scale" + from_checkpoint.format(INFER_FALLBACKS["guidance_scale"]),
    )
    infer.add_argument(
        "--flow-shift", type=float, default=None, help="sampler flow shift (default: the checkpoint's scheduler config)"
    )
    infer.add_argument("--seed", type=int, default=0, help="noise seed")
    infer.add_argument(
        "--fps",
        type=float,
        default=None,
        help="frame rate of the conditioning and the mp4" + from_checkpoint.format(INFER_FALLBACKS["fps"]),
    )
    infer.add_argument("--view-point", default="ego_view", help="camera view point of the prompt")
    infer.add_argument(
        "--resolution-tier",
        type=int,
        default=None,
        help="canvas tier (256, 480, ...)" + from_checkpoint.format(INFER_FALLBACKS["resolution_tier"]),
    )
    infer.add_argument(
        "--preset",
        default=None,
        help="settings bundle (cosmos3_gym.presets): droid_robolab (the released DROID policy as "
        "RoboLab serves it) | diffusers; options you set yourself win (default: none)",
    )
    infer.add_argument(
        "--prompt-format",
        default=None,
        help="json (diffusers) | plain (PhyAI PR49) | auto (from the "
        "checkpoint: plain for Nano/silu, json for Edge/relu2) (default: the preset's, else json)",
    )
    infer.add_argument(
        "--state",
        default=None,
        help="robot state rows for checkpoints trained with them (droid_robolab: 7 joint positions "
        "+ gripper): comma-separated values of one row, or an action JSON file (default: none)",
    )
    infer.add_argument(
        "--action-stats",
        default=None,
        help="statistics JSON to denormalise the output actions (default: none, normalised output)",
    )
    infer.add_argument(
        "--action-normalization",
        default="minmax",
        help="how --action-stats normalises: meanstd | minmax | quantile | quantile_rot",
    )
    infer.add_argument("--no-decode", action="store_true", help="skip the VAE decode (no mp4)")
    infer.add_argument("--save-arrays", action="store_true", help="also write PREFIX_video.npy [T,H,W,3] in [0,1]")
    infer.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    infer.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: bf16 on cuda, fp32 on cpu)")
    infer.add_argument("--vae-dtype", default=None, help="fp32 | bf16 | fp16 (default: fp32)")
    infer.add_argument(
        "--precision",
        default="bf16",
        choices=["bf16", "fp8"],
        help="GEN-tower GEMMs: bf16 (in --dtype) or fp8 (Hopper-class GPU, the fp8 extra)",
    )
    infer.add_argument(
        "--optimize",
        action="store_true",
        help="torch.compile the transformer blocks and fuse the VAE norms (GPU; the first step compiles)",
    )
    infer.add_argument("--out", required=True, help="output prefix")
    parallel = infer.add_argument_group(
        "parallel",
        "under torchrun --nproc_per_node=dp*cfg_parallel*tp every rank runs this command and rank 0 "
        "writes the files; without torchrun a config of several ranks starts its own worker processes",
    )
    parallel.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (must divide the KV heads)")
    parallel.add_argument(
        "--cfg-parallel",
        "--cfg",
        dest="cfg_parallel",
        type=int,
        default=1,
        help="1, or 2 to run the CFG branches on two rank groups (--cfg: deprecated alias)",
    )
    parallel.add_argument("--dp", type=int, default=1, help="data-parallel replicas (split a batch of requests)")
    infer.set_defaults(func=run_infer)


def _infer_settings(args: argparse.Namespace) -> dict:
    """The request settings: flags, else the checkpoint's meta.json, else ``INFER_FALLBACKS``."""
    from .checkpoint import checkpoint_defaults

    recorded = checkpoint_defaults(args.checkpoint)
    given = dict(
        domain=args.domain_name,
        raw_action_dim=args.raw_action_dim,
        chunk=args.chunk,
        fps=args.fps,
        resolution_tier=args.resolution_tier,
        num_steps=args.num_steps,
        guidance_scale=args.guidance_scale,
    )
    settings = {}
    for key, value in given.items():
        if value is not None:
            if key in recorded and recorded[key] != value:
                print(f"infer: using {key}={value!r} instead of the checkpoint's {recorded[key]!r}", file=sys.stderr)
            settings[key] = value
        else:
            settings[key] = recorded.get(key, INFER_FALLBACKS.get(key))
    return settings


def _check_inverse_dynamics_video(path: str, chunk: int) -> None:
    """An inverse-dynamics video holds the start frame and one frame per action: ``chunk + 1`` frames."""
    from . import processor

    frames = processor.load_frames(path)
    if len(frames) != chunk + 1:
        raise InputError(
            f"--video: inverse_dynamics with chunk {chunk} needs {chunk + 1} frames (the start frame and "
            f"one per action), {path} has {len(frames)}; trim the video or pass --chunk {len(frames) - 1}"
        )


def _state_rows(spec: str | None):
    """``--state``: an action JSON file, or one row of comma-separated numbers -> float32 ``[rows, dim]``."""
    if spec is None:
        return None
    import numpy as np

    from . import processor

    if Path(spec).is_file():
        return processor.load_action_file(spec)
    try:
        return np.asarray([[float(x) for x in spec.split(",")]], dtype=np.float32)
    except ValueError:
        raise InputError(f"--state: expected comma-separated numbers or an action JSON file, got {spec!r}") from None


def run_infer(args: argparse.Namespace) -> None:
    # Every path first, before torch is imported (seconds): a wrong one is reported at once.
    for flag, path in (
        ("--image", args.image),
        ("--video", args.video),
        ("--action-file", args.action_file),
        ("--action-stats", args.action_stats),
    ):
        if path and not Path(path).is_file():
            raise InputError(f"{flag}: file not found: {path}")
    check_checkpoint_argument(args.checkpoint)
    import numpy as np

    from . import processor
    from .checkpoint import resolve_checkpoint
    from .engine import Cosmos3Engine, Cosmos3Request
    from .launcher import load_engine
    from .media import write_video

    args.checkpoint = str(resolve_checkpoint(args.checkpoint))
    settings = _infer_settings(args)
    actions = None
    if args.action_file:
        actions = processor.load_action_file(args.action_file, chunk_index=args.action_chunk_index)
    elif args.mode == "forward_dynamics":
        raise InputError("--action-file: mode 'forward_dynamics' needs an action chunk file")
    if args.mode == "inverse_dynamics" and args.video and isinstance(settings["chunk"], int) and settings["chunk"] > 0:
        _check_inverse_dynamics_video(args.video, settings["chunk"])
    state = _state_rows(args.state)
    observation = args.image or args.video
    stats = (
        processor.ActionStats.from_json(args.action_stats, mode=args.action_normalization)
        if args.action_stats
        else None
    )

    request = Cosmos3Request(
        mode=args.mode,
        observation=observation,
        task=args.prompt,
        action=actions,
        domain=settings["domain"],
        raw_action_dim=settings["raw_action_dim"],
        chunk=settings["chunk"],
        cond_frame_indexes=args.condition_frames,
        num_inference_steps=settings["num_steps"],
        guidance_scale=settings["guidance_scale"],
        flow_shift=args.flow_shift,
        fps=settings["fps"],
        seed=args.seed,
        resolution_tier=settings["resolution_tier"],
        view_point=args.view_point,
        negative_prompt=args.negative_prompt,
        preset=args.preset,
        prompt_format=args.prompt_format,
        # A preset knows how many state rows its checkpoint takes (the last ones are used); otherwise all given.
        action_history=state,
        action_history_length=None if state is None or args.preset else len(state),
    )
    engine = load_engine(
        args.checkpoint,
        device=args.device,
        dtype=args.dtype,
        vae_dtype=args.vae_dtype,
        decode_video=not args.no_decode,
        tp=args.tp,
        cfg_parallel=args.cfg_parallel,
        dp=args.dp,
        optimize=args.optimize,
        precision=args.precision,
    )
    try:
        if isinstance(engine, Cosmos3Engine):
            # Validate the request fully (file contents, domains, shapes) before any expensive work.
            engine.prepare(request)
        result = engine.step(request)
        # Under torchrun every rank holds the same result and only global rank 0 writes and prints; a client-mode
        # engine (workers started for us) has no ranks here, this process is the output.
        is_output_rank = engine.is_output_rank
    finally:
        engine.close()
    if not is_output_rank:
        return

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    action = stats.denormalize(result.action) if stats is not None else result.action
    processor.save_action_file(f"{out}_action.json", np.asarray(action, dtype=np.float32))
    written = [f"{out}_action.json"]
    if result.pixels is not None:
        frames = result.pixels.permute(1, 2, 3, 0).numpy()  # [T, H, W, 3] in [0, 1]
        written.append(str(write_video(f"{out}.mp4", frames, fps=settings["fps"])))
        if args.save_arrays:
            np.save(f"{out}_video.npy", frames.astype(np.float32))
            written.append(f"{out}_video.npy")
    print(json.dumps({"mode": result.mode, "action_shape": list(result.action.shape), "written": written}))


# ---------------------------------------------------------------------------------------------------------------
# make-tiny-checkpoint
# ---------------------------------------------------------------------------------------------------------------


def add_make_tiny_checkpoint_command(sub) -> None:
    tiny = _add_command(sub, "make-tiny-checkpoint", "write a small random checkpoint (for tests and demos)")
    tiny.add_argument("directory", help="folder to write")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed")
    tiny.set_defaults(func=run_make_tiny_checkpoint)


def run_make_tiny_checkpoint(args: argparse.Namespace) -> None:
    from .testing import build_tiny_checkpoint

    path = build_tiny_checkpoint(args.directory, seed=args.seed)
    print(f"wrote a tiny RANDOM-weight Cosmos3 checkpoint to {path}")


# ---------------------------------------------------------------------------------------------------------------
# eval
# ---------------------------------------------------------------------------------------------------------------


def add_eval_command(sub) -> None:
    evaluate = _add_command(sub, "eval", "evaluate a policy in the world model: success rate, returns, videos")
    add_eval_arguments(evaluate)
    evaluate.set_defaults(func=run_eval)


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``cosmos3-gym eval`` (shared with benchmarks/policy_eval.py)."""
    checkpoint = " (default: the checkpoint's, else {})"
    parser.add_argument(
        "--checkpoint",
        default=BUILTIN_CHECKPOINT,
        help="checkpoint directory, hub id, or 'pusht' for the built-in PushT model",
    )
    parser.add_argument(
        "--policy",
        default="agent",
        help="'agent' (the checkpoint's policy), 'random', 'file:PATH' (a policy file of this "
        "package), 'sb3:PATH' (save_sb3_policy), 'ws://HOST:PORT' (a policy server speaking openpi's protocol, "
        "e.g. cosmos3-gym serve-policy; API key from $COSMOS3_GYM_POLICY_API_KEY), or 'module:factory' / "
        "'file.py:factory' (factory(env) returns a callable obs -> action or a Stable-Baselines3 model)",
    )
    parser.add_argument("--episodes", type=int, default=10, help="episodes to evaluate")
    parser.add_argument("--num-envs", type=int, default=1, help="env slots run in one batched model call")
    parser.add_argument(
        "--initial-states",
        default=None,
        help="image / video / folder / .npz of start frames (default: the checkpoint's)",
    )
    parser.add_argument(
        "--task", default=None, help="instruction for every episode (default: the checkpoint's, else each state's own)"
    )
    parser.add_argument(
        "--reward-model",
        default=None,
        help="reward model spec, e.g. goal_image:goal.png (default: the checkpoint's, else none)",
    )
    parser.add_argument(
        "--reward-bounds",
        type=_bounds,
        default=None,
        help="LOW,HIGH of the per-step reward, to bound the return's interval (default: 0,1 for a "
        "classifier reward model, else unknown: the interval is marked approximate)",
    )
    parser.add_argument(
        "--success-threshold",
        type=float,
        default=None,
        help="an episode succeeds (and ends) when the reward model's score reaches this "
        "(default: the checkpoint's meta.json success_threshold, for its own reward model; else none)",
    )
    parser.add_argument(
        "--success-return-threshold",
        type=float,
        default=None,
        help="where the env gives no success: an episode succeeds when its return exceeds this "
        "(default: none, no success rate is reported without a success definition)",
    )
    parser.add_argument(
        "--max-episode-steps",
        type=int,
        default=None,
        help="env steps (action chunks) per episode" + checkpoint.format(10),
    )
    parser.add_argument(
        "--domain-name", type=_domain, default=None, help="embodiment name or id" + checkpoint.format("droid_lerobot")
    )
    parser.add_argument(
        "--raw-action-dim",
        type=int,
        default=None,
        help="action width (default: the checkpoint's, else the domain table's)",
    )
    parser.add_argument("--chunk", type=int, default=None, help="actions per env step" + checkpoint.format(32))
    parser.add_argument("--num-steps", type=int, default=None, help="denoising steps" + checkpoint.format(4))
    parser.add_argument(
        "--guidance-scale", type=float, default=None, help="classifier-free guidance scale" + checkpoint.format(3.0)
    )
    parser.add_argument("--resolution-tier", type=int, default=None, help="canvas tier" + checkpoint.format(480))
    parser.add_argument("--fps", type=float, default=None, help="frame rate" + checkpoint.format(15))
    parser.add_argument(
        "--observation-size",
        type=_size,
        default=None,
        help="N or H,W: the size of the policy's observed image (default: the model's frame size)",
    )
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    parser.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: bf16 on cuda, fp32 on cpu)")
    parser.add_argument(
        "--decoder",
        choices=["vae", "light"],
        default=None,
        help="vae: the exact VAE decode; light: the checkpoint's light_decoder/ (default: the "
        "checkpoint's meta.json decoder, else vae)",
    )
    parser.add_argument("--seed", type=int, default=0, help="env and policy seed")
    parser.add_argument("--max-videos", type=int, default=8, help="write mp4s of the first N episodes")
    parser.add_argument("--out", required=True, help="output directory (report.json and episode mp4s)")


def eval_options(args: argparse.Namespace) -> dict:
    """``evaluation.evaluate_checkpoint`` keyword arguments from parsed ``add_eval_arguments`` options."""
    return dict(
        checkpoint=args.checkpoint,
        out_dir=args.out,
        policy=args.policy,
        episodes=args.episodes,
        num_envs=args.num_envs,
        initial_states=args.initial_states,
        task=args.task,
        reward_model=args.reward_model,
        reward_bounds=args.reward_bounds,
        success_threshold=args.success_threshold,
        success_return_threshold=args.success_return_threshold,
        max_episode_steps=args.max_episode_steps,
        domain=args.domain_name,
        raw_action_dim=args.raw_action_dim,
        chunk=args.chunk,
        num_steps=args.num_steps,
        guidance_scale=args.guidance_scale,
        resolution_tier=args.resolution_tier,
        fps=args.fps,
        observation_size=args.observation_size,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        max_videos=args.max_videos,
        decoder=args.decoder,
    )


def _check_counts(*checks: tuple[str, int | None, int]) -> None:
    """``(flag, value, least)`` each: an InputError naming the flag (not the library's argument) before any model
    loads; a ``None`` value (an optional flag left out) passes."""
    for flag, value, least in checks:
        if value is not None and value < least:
            raise InputError(f"{flag}: expected an integer >= {least}, got {value}")


def _check_eval_arguments(args: argparse.Namespace) -> None:
    """Checks that need no model: counts and files, so their errors come at once."""
    _check_counts(
        ("--episodes", args.episodes, 1), ("--num-envs", args.num_envs, 1), ("--max-videos", args.max_videos, 0)
    )
    if args.initial_states is not None and not Path(args.initial_states).exists():
        raise InputError(f"--initial-states: not found: {args.initial_states}")
    check_checkpoint_argument(args.checkpoint)


def check_checkpoint_argument(checkpoint: str, flag: str = "--checkpoint") -> None:
    """What can be told of a checkpoint argument without torch: a built-in model's name, an existing folder or a
    hub id ('org/name') pass; a file, or a path or name that is none of these, is an ``InputError`` at once."""
    if checkpoint.startswith("builtin:") or builtin_model(checkpoint) is not None:
        return  # resolve_checkpoint says later whether it is installed
    path = Path(checkpoint).expanduser()
    if path.is_dir():
        return
    expected = f"a checkpoint directory, a hub id 'org/name' or a built-in model ({', '.join(builtin_models())})"
    if path.exists():
        raise InputError(f"{flag}: {checkpoint} is a file; expected {expected}")
    if checkpoint.startswith((".", "/", "~")) or checkpoint.count("/") != 1:
        raise InputError(f"{flag}: not found: {checkpoint} (expected {expected})")


def _check_policy_server(spec: Any) -> None:
    """A bad spec or policy file fails when parsed; a policy server (``ws://``) that cannot be reached fails here,
    before any model loads."""
    if spec.kind == "remote":
        from .agents.remote import DEFAULT_TIMEOUT, RemotePolicyAgent, parse_remote_spec

        url, options = parse_remote_spec(spec.spec)
        timeout = float(options.get("timeout", DEFAULT_TIMEOUT))
        with RemotePolicyAgent(url, timeout=timeout, name=spec.spec) as agent:
            agent.connect()


def run_eval(args: argparse.Namespace) -> None:
    _check_eval_arguments(args)
    from .policy_specs import parse_policy_spec

    _check_policy_server(parse_policy_spec(args.policy, allow_factory=True))  # before the model loads
    from .evaluation import evaluate_checkpoint

    report = evaluate_checkpoint(**eval_options(args))
    print(report.table())
    print(f"wrote {Path(args.out) / 'report.json'} and {sum(e.video is not None for e in report.episodes)} videos")


# ---------------------------------------------------------------------------------------------------------------
# eval-real
# ---------------------------------------------------------------------------------------------------------------


def add_eval_real_command(sub) -> None:
    real = _add_command(
        sub,
        "eval-real",
        "run policies in the real PushT simulator (gym-pusht), alone "
        "(--real-only) or next to the PushT world model from the same starts, comparing scores and "
        "rankings",
    )
    real.add_argument(
        "--policies",
        default="random,scripted:0,scripted:25,agent",
        help="comma-separated: random, agent (the checkpoint's policy), scripted:NOISE (px), "
        "file:PATH (a policy file of this package: BC / GRPO / SB3), sb3:PATH or ppo:PATH "
        "(a save_sb3_policy file), ws://HOST:PORT (a policy server speaking openpi's protocol)",
    )
    real.add_argument(
        "--real-only",
        action="store_true",
        help="evaluate in gym-pusht alone: success rate and final coverage with 95%% CIs",
    )
    real.add_argument("--starts", type=int, default=4, help="simulator start states (episodes) per policy")
    real.add_argument(
        "--chunks",
        type=int,
        default=None,
        help="action chunks per episode (default: 4 next to the world model, the checkpoint's "
        "max_episode_steps with --real-only)",
    )
    real.add_argument("--first-sim-seed", type=int, default=10_000, help="gym-pusht reset seed of the first start")
    real.add_argument("--assets", default=None, help="PushT model folder (default: the built-in one)")
    real.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    real.add_argument("--seed", type=int, default=0, help="policy and world-model seed")
    real.add_argument("--out", default=None, help="write the result as JSON to this file (default: none)")
    real.set_defaults(func=run_eval_real)


def run_eval_real(args: argparse.Namespace) -> None:
    from .policy_specs import parse_policy_specs

    parse_policy_specs(args.policies)  # bad specs and files fail before any model or simulator loads
    _check_counts(("--starts", args.starts, 1), ("--chunks", args.chunks, 1))
    if args.out and Path(args.out).is_dir():
        raise InputError(f"--out: {args.out} is a folder; expected a JSON file path")
    from .tasks.pusht.compare import compare_with_simulator, evaluate_in_simulator, format_comparison, format_real_only

    if args.real_only:
        result = evaluate_in_simulator(
            args.policies,
            num_episodes=args.starts,
            num_chunks=args.chunks,
            first_sim_seed=args.first_sim_seed,
            assets_dir=args.assets,
            device=args.device,
            seed=args.seed,
        )
        print(format_real_only(result))
    else:
        result = compare_with_simulator(
            args.policies,
            num_starts=args.starts,
            num_chunks=args.chunks or 4,
            first_sim_seed=args.first_sim_seed,
            assets_dir=args.assets,
            device=args.device,
            seed=args.seed,
        )
        print(format_comparison(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


# ---------------------------------------------------------------------------------------------------------------
# serve-policy
# ---------------------------------------------------------------------------------------------------------------


def add_serve_policy_command(sub) -> None:
    serve = _add_command(
        sub,
        "serve-policy",
        "serve a policy over openpi's websocket protocol (for openpi clients, eval --policy ws://...)",
        "Serve a policy this package can load over openpi's websocket protocol (msgpack-numpy messages, the "
        "metadata handshake, an optional API key), so that an unmodified openpi client, evaluation harness or "
        "cosmos3-gym eval --policy ws://HOST:PORT can call it. Requests: the image under 'observation/image', "
        "an optional state under 'observation/state', the task under 'prompt'; replies: 'actions' [chunk, dim] in "
        "the world model's normalised action space.",
    )
    serve.add_argument(
        "--policy",
        required=True,
        help="'file:PATH' (a BC / GRPO policy file), 'sb3:PATH' (save_sb3_policy), 'agent' (the checkpoint's own "
        "policy mode), 'random', or a task's frame policy such as 'scripted-frames:NOISE'",
    )
    serve.add_argument("--port", type=int, default=8000, help="TCP port (0: a free one, printed)")
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind; 0.0.0.0 serves every interface (then give --api-key)",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="refuse clients without the header 'Authorization: Api-Key KEY' (openpi's; default: none)",
    )
    serve.add_argument(
        "--checkpoint",
        default=None,
        help="for 'agent', 'random' and task frame policies: the checkpoint whose policy, action shape and "
        f"action statistics to use (default: '{BUILTIN_CHECKPOINT}', the built-in model)",
    )
    serve.add_argument(
        "--num-steps", type=int, default=None, help="'agent': denoising steps (default: the checkpoint's)"
    )
    serve.add_argument("--max-batch", type=int, default=16, help="answer up to N waiting requests in one policy call")
    serve.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    serve.add_argument("--dtype", default=None, help="'agent': fp32 | bf16 | fp16 (default: bf16 on cuda, fp32 on cpu)")
    serve.add_argument("--seed", type=int, default=0, help="seed of a sampling policy ('agent', 'random', noise)")
    serve.set_defaults(func=run_serve_policy)


def run_serve_policy(args: argparse.Namespace) -> None:
    from .policy_specs import POLICY_KINDS, parse_policy_spec

    spec = parse_policy_spec(args.policy)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port: expected 0 .. 65535, got {args.port}")
    _check_counts(("--max-batch", args.max_batch, 1), ("--num-steps", args.num_steps, 1))
    registered = POLICY_KINDS.get(spec.kind)
    if registered is not None and registered.frame_agent is None:
        raise InputError(f"--policy: {args.policy!r} runs {registered.runs_where}; it cannot be served")
    needs_checkpoint = spec.kind in ("agent", "random") or registered is not None
    checkpoint = args.checkpoint or BUILTIN_CHECKPOINT
    if args.checkpoint is not None:
        check_checkpoint_argument(args.checkpoint)
    from .agents import PolicyServer

    agent, make_agent, metadata = _served_agent(spec, args, checkpoint) if needs_checkpoint else (None, None, {})
    if agent is None and make_agent is None:
        from .policy_specs import load_frame_agent

        agent = load_frame_agent(spec, device=args.device or "cpu", seed=args.seed)
    server = PolicyServer(
        agent,
        make_agent=make_agent,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        name=args.policy,
        metadata=metadata,
        max_batch=args.max_batch,
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who reaches it can call the policy")
    shape = server.metadata.get("action_shape")

    def listening(server: Any) -> None:
        chunks = f" (action chunks {shape})" if shape else ""
        print(f"serving {args.policy}{chunks} on {server.url} - Ctrl-C stops", flush=True)

    server.serve_forever(on_listening=listening)


def _served_agent(spec: Any, args: argparse.Namespace, checkpoint: str) -> tuple[Any, Any, dict[str, Any]]:
    """``(agent, make_agent, metadata)`` of the policies that need the checkpoint: its own policy mode, random actions
    of its shape, or a task's frame policy (one per connection: it keeps per-episode state)."""
    from .checkpoint import checkpoint_defaults, resolve_checkpoint
    from .policy_specs import POLICY_KINDS, load_frame_agent

    root = resolve_checkpoint(checkpoint)
    recorded = checkpoint_defaults(root)
    chunk = int(recorded.get("chunk") or 32)
    if spec.kind in POLICY_KINDS:

        def make_agent(index: int) -> Any:
            return load_frame_agent(
                spec, action_stats=recorded.get("action_stats"), chunk=chunk, seed=args.seed + index
            )

        stats = recorded.get("action_stats")
        return None, make_agent, {"action_shape": [chunk, stats.dim]} if stats is not None else {}
    if spec.kind == "random":
        from .processor import resolve_domain

        _, dim = resolve_domain(recorded.get("domain", "droid_lerobot"), recorded.get("raw_action_dim"))
        return _RandomFrameAgent((chunk, int(dim)), args.seed), None, {}
    from .agents import PolicyAgent
    from .engine import Cosmos3Engine
    from .envs.settings import WorldModelSettings, split_settings

    settings = WorldModelSettings(**split_settings(dict(recorded)))
    engine = Cosmos3Engine.from_pretrained(root, device=args.device, dtype=args.dtype, progress=False)
    task = recorded.get("task") if isinstance(recorded.get("task"), str) else ""
    overrides = {"num_steps": args.num_steps} if args.num_steps else {}
    return PolicyAgent(engine, task, settings=settings, seed=args.seed, **overrides), None, {}


class _RandomFrameAgent:
    """Uniform random action chunks in [-1, 1] (seeded), whatever the frames."""

    def __init__(self, shape: tuple[int, int], seed: int):
        import numpy as np

        self.action_shape, self.rng = shape, np.random.default_rng(seed)

    def act(self, frames: Any) -> Any:
        return self.rng.uniform(-1.0, 1.0, (len(frames), *self.action_shape)).astype("float32")


# ---------------------------------------------------------------------------------------------------------------
# dream
# ---------------------------------------------------------------------------------------------------------------


def add_dream_command(sub) -> None:
    dream = sub.add_parser(
        "dream",
        help="roll a policy in the world model and write the imagined episodes as a LeRobot v3.0 dataset",
        description="Roll a policy in the world model and write the imagined episodes as a LeRobot v3.0 dataset: "
        "frames as H.264 video, actions (raw units), next.reward, next.done, next.success and the task. With "
        "--label-actions inverse-dynamics the actions are inferred from the imagined frames by the checkpoint's "
        "inverse-dynamics mode instead (DreamGen-style); --keep successes writes only the successful episodes.",
        formatter_class=HelpFormatter,
        conflict_handler="resolve",
    )
    add_eval_arguments(dream)  # the same env settings as eval; the options below replace eval's
    dream.add_argument(
        "--policy",
        required=True,
        help="the policy that acts in the dreams: any eval policy spec ('agent', 'file:PATH', 'sb3:PATH', "
        "'ws://HOST:PORT', 'random', 'module:factory')",
    )
    dream.add_argument("--episodes", type=int, default=10, help="episodes to dream")
    dream.add_argument(
        "--out",
        required=True,
        help="the LeRobot dataset to write: 'lerobot:PATH' (or PATH), a new or empty folder",
    )
    dream.add_argument(
        "--label-actions",
        choices=["policy", "inverse-dynamics"],
        default="policy",
        help="policy: the actions the policy took; inverse-dynamics: the checkpoint's inverse-dynamics labels of "
        "the imagined frames",
    )
    dream.add_argument(
        "--keep",
        choices=["all", "successes"],
        default="all",
        help="write every episode, or only the successful ones (needs a success definition)",
    )
    dream.add_argument("--crf", type=int, default=18, help="H.264 quality of the videos (0: lossless)")
    dream.add_argument("--max-videos", type=int, default=0, help=argparse.SUPPRESS)
    dream.set_defaults(func=run_dream)


def run_dream(args: argparse.Namespace) -> None:
    _check_eval_arguments(args)
    _check_counts(("--crf", args.crf, 0))
    from .policy_specs import parse_policy_spec

    _check_policy_server(parse_policy_spec(args.policy, allow_factory=True))  # before the model loads
    from .rl.dream import dream_checkpoint

    options = eval_options(args)
    for key in ("out_dir", "max_videos"):
        options.pop(key)
    result = dream_checkpoint(
        options.pop("checkpoint"),
        args.out,
        label_actions=args.label_actions,
        keep=args.keep,
        crf=args.crf,
        **options,
    )
    print(result.report.table())
    print(result.summary())


# ---------------------------------------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------------------------------------


def add_demo_command(sub) -> None:
    demo = _add_command(sub, "demo", "run a few short episodes of the default env and write their videos")
    demo.add_argument(
        "--checkpoint", default=None, help="checkpoint directory or hub id (default: the built-in PushT world model)"
    )
    demo.add_argument(
        "--policy",
        default="random",
        choices=["random", "agent"],
        help="uniform random actions, or the checkpoint's own policy (PolicyAgent)",
    )
    demo.add_argument("--episodes", type=int, default=2, help="episodes to run")
    demo.add_argument("--steps-per-episode", type=int, default=3, help="env steps (action chunks) per episode")
    demo.add_argument("--seed", type=int, default=0, help="env and policy seed")
    demo.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    demo.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: bf16 on cuda, fp32 on cpu)")
    demo.add_argument("--out", required=True, help="output directory (report.json and one mp4 per episode)")
    demo.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> None:
    _check_counts(("--episodes", args.episodes, 1), ("--steps-per-episode", args.steps_per_episode, 1))
    if args.checkpoint is not None:
        check_checkpoint_argument(args.checkpoint)
    from .tasks.pusht.demo import run_demo as demo
    from .tasks.pusht.env import builtin_checkpoint_dir
    from .testing import cached_tiny_checkpoint

    if args.checkpoint is None and builtin_checkpoint_dir() is not None:
        print(
            f"No --checkpoint given: using the built-in PushT world model ({builtin_checkpoint_dir()}), a small "
            "Cosmos3 trained by this project on the gym-pusht simulator (see README: its fidelity is limited)."
        )
    elif args.checkpoint is None:
        print(
            f"No --checkpoint given: using a tiny checkpoint with RANDOM weights ({cached_tiny_checkpoint()}).\n"
            "Its videos show what an untrained model generates, not a world model; pass --checkpoint for a real one."
        )
    report = demo(
        args.out,
        checkpoint=args.checkpoint,
        policy=args.policy,
        episodes=args.episodes,
        steps_per_episode=args.steps_per_episode,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
    )
    print(report.table())
    videos = [e.video for e in report.episodes if e.video is not None]
    print(f"wrote {Path(args.out) / 'report.json'} and {len(videos)} videos in {args.out}: {', '.join(videos)}")
    side_by_side = report.settings.get("side_by_side")
    if side_by_side:
        print(f"and {side_by_side['path']}: {side_by_side['description']}")  # as report.json records it


# ---------------------------------------------------------------------------------------------------------------
# train-vae, train
# ---------------------------------------------------------------------------------------------------------------


def _json_object(text: str) -> dict:
    """A JSON object given inline or as the path of a JSON file."""
    try:
        value = json.loads(Path(text).read_text()) if Path(text).is_file() else json.loads(text)
    except (OSError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"expected a JSON object or the path of a JSON file ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def add_training_commands(sub) -> None:
    """``train-vae`` and ``train`` (cosmos3_gym.training); flags left out keep the config dataclass defaults."""
    vae = _add_command(sub, "train-vae", "train a small Wan2.2-layout VAE on an episode dataset")
    vae.add_argument(
        "--dataset",
        required=True,
        help="episode dataset folder (layout: cosmos3_gym/training/data.py) "
        "or lerobot:PATH (a LeRobot v3.0 / v2.1 dataset)",
    )
    vae.add_argument("--out", required=True, help="output folder (AutoencoderKLWan.save_pretrained)")
    kind: Callable[[str], Any]  # an argparse type: int, float, str or a parser such as _domain (both loops below)
    for flag, kind, text in (
        ("--steps", int, "optimizer steps"),
        ("--batch-size", int, "clips per step"),
        ("--lr", float, "AdamW lr"),
        ("--base-dim", int, "encoder width"),
        ("--decoder-base-dim", int, "decoder width"),
        ("--z-dim", int, "latent channels"),
        ("--num-res-blocks", int, "residual blocks per level"),
        ("--frames-per-clip", int, "1 + 4k frames"),
        ("--resolution-tier", int, "canvas tier (256, 480, ...)"),
        ("--kl-weight", float, "weight of the KL term"),
        ("--stats-clips", int, "clips for latents_mean/std"),
        ("--num-workers", int, "DataLoader workers"),
        ("--log-every", int, "steps per log line"),
        ("--seed", int, "seed"),
        ("--warmup-steps", int, "linear warmup steps"),
        ("--contrast-weight", float, "extra loss weight on pixels unlike the background (0: plain means)"),
        ("--init-vae", str, "fine-tune this AutoencoderKLWan folder"),
        ("--camera", str, "LeRobot datasets: the video feature to train on"),
    ):
        _config_flag(vae, "VAETrainConfig", flag, kind, text)
    vae.add_argument(
        "--decoder-only",
        action="store_true",
        help="with --init-vae: train the decoder only (the latent space, and world models on it, stay)",
    )
    vae.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    vae.add_argument("--no-bf16", action="store_true", help="no bf16 autocast on CUDA")
    vae.set_defaults(func=run_train_vae)

    train = _add_command(
        sub,
        "train",
        "flow-matching training of a Cosmos3 policy world model; exports a checkpoint "
        "(multi-GPU: torchrun --nproc_per_node=N -m cosmos3_gym.cli train ...)",
    )
    train.add_argument(
        "--dataset",
        required=True,
        help="episode dataset folder (layout: cosmos3_gym/training/data.py) "
        "or lerobot:PATH (a LeRobot v3.0 / v2.1 dataset)",
    )
    train.add_argument("--vae", required=True, help="trained VAE folder (train-vae output or a checkpoint's vae/)")
    train.add_argument("--out", required=True, help="checkpoint folder to write (training state in OUT/training)")
    train.add_argument(
        "--config",
        type=_json_object,
        default={},
        help="WorldModelTrainConfig fields as JSON (inline or file); the flags below override it",
    )
    for flag, kind, text in (
        ("--steps", int, "total optimizer steps"),
        ("--batch-size", int, "samples per step and rank"),
        ("--lr", float, "peak AdamW lr"),
        ("--warmup-steps", int, "linear warmup steps"),
        ("--chunk", int, "actions per window (chunk + 1 frames)"),
        ("--resolution-tier", int, "canvas tier"),
        ("--window-stride", int, "frames between window starts"),
        ("--flow-shift", float, "flow-matching shift (default: the tier's, as in native training: 256: 3, 480: 5)"),
        ("--uncond-prob", float, "prompt dropout for CFG"),
        ("--ema-decay", float, "0 disables the EMA"),
        ("--save-every", int, "steps between training-state saves"),
        ("--log-every", int, "steps per log line"),
        ("--seed", int, "seed"),
        ("--save-dtype", str, "float32 | float16 | bfloat16 (exported transformer)"),
        ("--vae-save-dtype", str, "float32 | float16 | bfloat16 (exported VAE)"),
        ("--param-dtype", str, "float32 | bfloat16 (training weights)"),
        ("--work-dir", str, "training state, log and latent cache (default OUT/training)"),
        ("--init-checkpoint", str, "fine-tune this checkpoint's transformer"),
        ("--cond-noise-std", float, "noise on the clean conditioning frame against rollout drift"),
        ("--context-noise-max", float, "context noise with its level as the context's timestep: U(0, this)"),
        ("--context-noise", float, "the context-noise level the exported checkpoint's envs run at (meta.json)"),
        ("--rollout-prob", float, "fraction of each batch conditioned on the model's own frames"),
        ("--rollout-max-chunks", int, "chunks generated before such a frame (1..N per step)"),
        ("--video-loss-focus", str, "module:function, frames -> bool mask of what the video loss should weigh up"),
        ("--video-loss-focus-weight", float, "extra weight of the latent cells the focus mask touches (0: none)"),
        ("--action-history-length", int, "state rows: the previous N actions before each window (meta.json; 0: none)"),
        ("--tokenizer-dir", str, "tokenizer (default: the tiny in-process tokenizer)"),
        ("--camera", str, "LeRobot datasets: the video feature (default: the only one)"),
        ("--action-key", str, "LeRobot datasets: the action feature (default: action)"),
        ("--state-key", str, "LeRobot datasets: the state feature (read and checked, not trained on)"),
        ("--domain", _domain, "embodiment name or id (default: the dataset's meta.json / info.json robot_type)"),
        ("--data-parallel", str, "ddp | fsdp (under torchrun: replicate, or shard with FSDP2)"),
        ("--lora-rank", int, "train rank-r LoRA adapters on the GEN tower (0: full fine-tuning)"),
        ("--lora-alpha", float, "LoRA alpha (default: the rank)"),
        ("--checkpoint-policy", str, "with --gradient-checkpointing: full, or selective (keeps matmul outputs)"),
    ):
        if "default" in text:  # a default that depends on something else, said in the text
            train.add_argument(flag, type=kind, default=None, help=text)
        else:
            _config_flag(train, "WorldModelTrainConfig", flag, kind, text)
    train.add_argument(
        "--model", type=_json_object, default=None, help="transformer config overrides (JSON; default: none)"
    )
    _config_flag(train, "WorldModelTrainConfig", "--mode-probs", _json_object, "mode sampling probabilities (JSON)")
    train.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    train.add_argument("--no-bf16", action="store_true", help="no bf16 autocast on CUDA")
    train.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute activations in the backward pass (less memory, slower)",
    )
    train.add_argument("--fsdp-cpu-offload", action="store_true", help="fsdp: sharded states on the host")
    train.add_argument("--compile-blocks", action="store_true", help="torch.compile each transformer block (GPU)")
    train.add_argument("--freeze-text-tower", action="store_true", help="do not train the text tower")
    train.add_argument("--resume", action="store_true", help="continue from the saved training state")
    train.set_defaults(func=run_train)


def _flag_overrides(args: argparse.Namespace, names: list[str]) -> dict:
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def run_train_vae(args: argparse.Namespace) -> None:
    from .training import VAETrainConfig, train_vae

    fields = [
        "steps",
        "batch_size",
        "lr",
        "base_dim",
        "decoder_base_dim",
        "z_dim",
        "num_res_blocks",
        "frames_per_clip",
        "resolution_tier",
        "kl_weight",
        "stats_clips",
        "num_workers",
        "log_every",
        "seed",
        "device",
        "warmup_steps",
        "contrast_weight",
        "init_vae",
        "camera",
    ]
    config = VAETrainConfig(**_flag_overrides(args, fields), bf16=not args.no_bf16, train_encoder=not args.decoder_only)
    path = train_vae(args.dataset, args.out, config)
    print(f"wrote the VAE to {path}")


def run_train(args: argparse.Namespace) -> None:
    import dataclasses
    import os

    from .training import WorldModelTrainConfig, train_world_model

    known = {f.name for f in dataclasses.fields(WorldModelTrainConfig)}
    unknown = sorted(set(args.config) - known)
    if unknown:
        raise InputError(f"--config: unknown WorldModelTrainConfig fields {unknown}")
    fields = [
        "steps",
        "batch_size",
        "lr",
        "warmup_steps",
        "chunk",
        "resolution_tier",
        "window_stride",
        "flow_shift",
        "uncond_prob",
        "ema_decay",
        "save_every",
        "log_every",
        "seed",
        "save_dtype",
        "vae_save_dtype",
        "param_dtype",
        "work_dir",
        "cond_noise_std",
        "context_noise_max",
        "context_noise",
        "rollout_prob",
        "rollout_max_chunks",
        "video_loss_focus",
        "video_loss_focus_weight",
        "action_history_length",
        "init_checkpoint",
        "tokenizer_dir",
        "model",
        "mode_probs",
        "device",
        "camera",
        "action_key",
        "state_key",
        "domain",
        "data_parallel",
        "lora_rank",
        "lora_alpha",
        "checkpoint_policy",
    ]
    values = {**args.config, **_flag_overrides(args, fields)}
    for flag in ("gradient_checkpointing", "freeze_text_tower", "resume", "fsdp_cpu_offload", "compile_blocks"):
        if getattr(args, flag):
            values[flag] = True
    if args.no_bf16:
        values["bf16"] = False
    if "betas" in values:
        values["betas"] = tuple(values["betas"])
    path = train_world_model(args.dataset, args.out, WorldModelTrainConfig(**values), args.vae)
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank runs this; one reports
        print(f"wrote the checkpoint to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except InputError as e:
        print(f"cosmos3-gym {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
