"""``cosmos3-gym``: command-line entry points.

``infer`` mirrors PhyAI's ``examples/cosmos3/run_cosmos3_policy.py``; bad input prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import InputError


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _domain(text: str) -> str | int:
    return int(text) if text.lstrip("-").isdigit() else text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cosmos3-gym", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    infer = sub.add_parser("infer", help="run one Cosmos3 request (policy / forward / inverse dynamics)")
    infer.add_argument("--checkpoint", required=True, help="checkpoint directory or hub id (diffusers layout)")
    source = infer.add_mutually_exclusive_group(required=True)
    source.add_argument("--image", help="conditioning image (path)")
    source.add_argument("--video", help="conditioning video (mp4/gif path)")
    infer.add_argument("--prompt", default="", help="task description")
    infer.add_argument("--negative-prompt", default=None)
    infer.add_argument("--domain-name", type=_domain, default="droid_lerobot", help="embodiment name or integer id")
    infer.add_argument("--raw-action-dim", type=int, default=None, help="action width; overrides the domain table")
    infer.add_argument("--mode", default="policy", help="policy | forward_dynamics | inverse_dynamics")
    infer.add_argument("--action-file", default=None, help="action chunk JSON (forward_dynamics)")
    infer.add_argument("--action-chunk-index", type=int, default=0, help="which chunk of an action_chunks file")
    infer.add_argument("--condition-frames", type=_int_list, default=None, help="clean latent frames, e.g. 0,1")
    infer.add_argument("--chunk", type=int, default=32, help="action chunk length (video has chunk+1 frames)")
    infer.add_argument("--num-steps", type=int, default=4)
    infer.add_argument("--guidance-scale", type=float, default=3.0)
    infer.add_argument("--flow-shift", type=float, default=None, help="default: the checkpoint's scheduler config")
    infer.add_argument("--seed", type=int, default=0)
    infer.add_argument("--fps", type=float, default=15.0)
    infer.add_argument("--view-point", default="ego_view")
    infer.add_argument("--resolution-tier", type=int, default=480)
    infer.add_argument("--action-stats", default=None, help="statistics JSON to denormalise the output actions")
    infer.add_argument("--action-normalization", default="minmax", help="meanstd | minmax | quantile | quantile_rot")
    infer.add_argument("--no-decode", action="store_true", help="skip the VAE decode (no mp4)")
    infer.add_argument("--save-arrays", action="store_true", help="also write PREFIX_video.npy [T,H,W,3] in [0,1]")
    infer.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    infer.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: bf16 on cuda, fp32 on cpu)")
    infer.add_argument("--out", required=True, help="output prefix")
    infer.set_defaults(func=run_infer)

    tiny = sub.add_parser("make-tiny-checkpoint", help="write a small random checkpoint (for tests and demos)")
    tiny.add_argument("directory")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=run_make_tiny_checkpoint)
    return parser


def run_infer(args: argparse.Namespace) -> None:
    import numpy as np

    from . import processor
    from .engine import Cosmos3Engine, Cosmos3Request
    from .media import write_video

    actions = None
    if args.action_file:
        actions = processor.load_action_file(args.action_file, chunk_index=args.action_chunk_index)
    elif args.mode == "forward_dynamics":
        raise InputError("--action-file: mode 'forward_dynamics' needs an action chunk file")
    observation = args.image or args.video
    for flag, path in (("--image", args.image), ("--video", args.video)):
        if path and not Path(path).is_file():
            raise InputError(f"{flag}: file not found: {path}")
    stats = processor.ActionStats.from_json(args.action_stats, mode=args.action_normalization) if args.action_stats \
        else None

    request = Cosmos3Request(
        mode=args.mode, observation=observation, task=args.prompt, actions=actions, domain=args.domain_name,
        raw_action_dim=args.raw_action_dim, chunk=args.chunk, cond_frame_indexes=args.condition_frames,
        num_steps=args.num_steps, guidance_scale=args.guidance_scale, flow_shift=args.flow_shift, fps=args.fps,
        seed=args.seed, resolution_tier=args.resolution_tier, view_point=args.view_point,
        negative_prompt=args.negative_prompt,
    )
    engine = Cosmos3Engine.from_pretrained(
        args.checkpoint, device=args.device, dtype=args.dtype, decode_video=not args.no_decode
    )
    # Validate the request fully (file contents, domains, shapes) before any expensive work.
    engine.prepare(request)
    result = engine.step(request)
    engine.close()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    action = stats.denormalize(result.action) if stats is not None else result.action
    processor.save_action_file(f"{out}_action.json", np.asarray(action, dtype=np.float32))
    written = [f"{out}_action.json"]
    if result.pixels is not None:
        frames = result.pixels.permute(1, 2, 3, 0).numpy()  # [T, H, W, 3] in [0, 1]
        write_video(f"{out}.mp4", frames, fps=args.fps)
        written.append(f"{out}.mp4")
        if args.save_arrays:
            np.save(f"{out}_video.npy", frames.astype(np.float32))
            written.append(f"{out}_video.npy")
    print(json.dumps({"mode": result.mode, "action_shape": list(result.action.shape), "written": written}))


def run_make_tiny_checkpoint(args: argparse.Namespace) -> None:
    from .checkpoint import build_tiny_checkpoint

    path = build_tiny_checkpoint(args.directory, seed=args.seed)
    print(f"wrote a tiny RANDOM-weight Cosmos3 checkpoint to {path}")


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
