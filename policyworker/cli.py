"""Command line: `python -m policyworker demo [--out DIR] [--model DIR --data FILE] [key=value ...]`
`python -m policyworker refit-check --model DIR` (see `policyworker.tools.refit_check`) and
`python -m policyworker export --checkpoint DIR --out HF_DIR` (see `policyworker.tools.export`).

Extra `key=value` arguments are dotted overrides of `DemoConfig` (e.g. `grpo_steps=10`,
`loss.ratio_clip_max=0.28`). Bad input — an unknown or ill-typed option, a missing model folder,
tokenizer or data file, a malformed JSONL row — ends in one line on stderr and exit status 2,
before any work starts.
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
import textwrap
from pathlib import Path

from policyworker.logs import VERBOSE_ENV, quiet_third_party


def demo_options() -> str:
    """The `key=value` options of the demo: `DemoConfig`'s fields with their types, defaults
    and the first line of their docstrings, read from its source (nothing heavy imported)."""
    source = (Path(__file__).parent / "demo" / "config.py").read_text()
    body = next(
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "DemoConfig"
    ).body
    lines = ["key=value options (DemoConfig; nested ones dotted, e.g. loss.ratio_clip_max=0.28):"]
    for field, doc in zip(body, [*body[1:], None], strict=True):
        if not (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)):
            continue
        value = field.value
        if isinstance(value, ast.Call) and value.keywords:  # field(default_factory=...): its value
            value = value.keywords[0].value
            value = value.body if isinstance(value, ast.Lambda) else ast.Call(value, [], [])
        default = "" if value is None else ast.unparse(value)
        text = " ".join(str(doc.value.value).split()) if isinstance(doc, ast.Expr) else ""
        lines.append(f"  {field.target.id} ({ast.unparse(field.annotation)}) = {default}")
        lines += textwrap.wrap(text, 96, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="policyworker")
    parser.add_argument(
        "--verbose", action="store_true", help="also the notices of megatron-core, torch, HF"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="SFT warm-up then GRPO (built-in addition task by default)",
        epilog=demo_options(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--out", default=None, help="output folder (default runs/demo)")
    demo.add_argument("--model", default=None, help="HF checkpoint folder to train")
    demo.add_argument("--data", default=None, help="JSONL of prompt/answer pairs (with --model)")
    demo.add_argument(
        "--config", default=None, help="YAML of DemoConfig fields, or a NeMo-RL GRPO recipe"
    )
    demo.add_argument(
        "--ignore-unsupported",
        action="store_true",
        help="run a NeMo-RL recipe without its keys that have no equivalent (they are listed)",
    )
    demo.add_argument("--save-every", default=None, help="checkpoint every N steps")
    demo.add_argument("--resume", default=None, help="an OUT/checkpoints/step_N folder")
    demo.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo_steps=10")
    check = sub.add_parser("refit-check", help="refit a receiver process and compare both sides")
    check.add_argument("--model", required=True, help="HF checkpoint folder")
    check.add_argument(
        "--transport", default="ipc", choices=["ipc", "collective", "reshard", "sparse"]
    )
    check.add_argument("--trainer-tp", type=int, default=1, help="trainer ranks (TP)")
    check.add_argument("--receiver-tp", type=int, default=1, help="destination ranks (reshard)")
    for side in ("trainer", "receiver"):
        check.add_argument(f"--{side}-ep", type=int, default=1, help=f"{side}'s expert parallel")
        check.add_argument(f"--{side}-etp", type=int, default=1, help=f"{side}'s expert TP")
    check.add_argument("--precision", default="float32", choices=["float32", "bfloat16"])
    check.add_argument("--buffer-size", type=int, default=0, help="bytes per buffer (0: auto)")
    check.add_argument("--timeout", type=float, default=60.0, help="seconds, both sides")
    export = sub.add_parser("export", help="a checkpoint's weights as a Hugging Face folder")
    export.add_argument("--checkpoint", required=True, help="weights dir of save_checkpoint")
    export.add_argument("--out", required=True, help="Hugging Face folder to write")
    export.add_argument("--force", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"  # the worker processes too
    quiet_third_party()
    if args.command == "refit-check":
        _refit_check(check, args)
        return
    if args.command == "export":
        _export(export, args)
        return

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("megatron", "transformers", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from policyworker.config import nemo_rl, read_data
    from policyworker.demo.config import load_inputs
    from policyworker.demo.recipe import load_demo_config, recipe_terms

    overrides = list(args.overrides)
    for key in ("out", "model", "data", "save_every", "resume"):
        if getattr(args, key) is not None:
            overrides.append(f"{key}={getattr(args, key)}")
    try:
        cfg = load_demo_config(args.config, overrides, ignore_unsupported=args.ignore_unsupported)
        try:
            inputs = load_inputs(cfg)
        except ValueError as e:  # a recipe's value: named by the recipe's key
            recipe = args.config is not None and nemo_rl.is_nemo_rl(read_data(args.config))
            raise ValueError(recipe_terms(str(e)) if recipe else str(e)) from None
    except ValueError as e:
        demo.exit(2, f"{demo.prog}: error: {e}\n")
    from policyworker.demo.grpo import run_demo  # loads megatron-core

    run_demo(cfg, inputs)


def _refit_check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    import sys
    from pathlib import Path

    logging.basicConfig(level=logging.WARNING)
    if not (Path(args.model) / "config.json").is_file():
        parser.exit(2, f"{parser.prog}: error: --model: no config.json in {args.model}\n")
    if args.buffer_size < 0 or args.timeout <= 0:
        parser.exit(2, f"{parser.prog}: error: --buffer-size >= 0 and --timeout > 0 expected\n")
    from policyworker.tools.refit_check import CheckOptions, main

    try:
        opts = CheckOptions(
            model=args.model,
            transport=args.transport,
            precision=args.precision,
            buffer_size_bytes=args.buffer_size,
            timeout_s=args.timeout,
            trainer_tp=args.trainer_tp,
            receiver_tp=args.receiver_tp,
            trainer_ep=args.trainer_ep,
            receiver_ep=args.receiver_ep,
            trainer_etp=args.trainer_etp,
            receiver_etp=args.receiver_etp,
        )
    except ValueError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    sys.exit(main(opts))


def _export(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    from policyworker.checkpoint.commit import CheckpointError, read_manifest

    try:
        read_manifest(Path(args.checkpoint), "--checkpoint")
    except CheckpointError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    if Path(args.out).exists() and not args.force:
        parser.exit(2, f"{parser.prog}: error: --out: {args.out} exists (--force replaces it)\n")
    from policyworker.tools.export import export_checkpoint

    print(export_checkpoint(args.checkpoint, args.out))


if __name__ == "__main__":
    main()
