"""`bridge` console script.

    bridge train RECIPE [--output-dir DIR] [--nproc N] [--force] [key.sub=value ...]
    bridge demo {shapes,tones,graphs} [--output-dir DIR] [--nproc N] [--force] [key.sub=value ...]
    bridge defaults [RECIPE]             # every recipe key with its default, and the registered parts
    bridge eval RUN [--backend URL] [--batch-invariant] [--structured-outputs JSON] [--no-verify]
                                         # score a run's newest checkpoint
    bridge serve PATH [--port N] [--no-verify] [...]  # OpenAI-compatible server (`serve` extra)

A checkpoint is checked against its manifest.json before `eval` or `serve` reads it (`--no-verify`
skips that).

`--nproc N` (N > 1) starts N ranks of the same command on this host (bridge.training.launch: the
environment torchrun gives, one message when a rank fails) for DDP, or FSDP2 when the LLM is
unfrozen (`train.distributed`); `torchrun --nproc_per_node N -m bridge train RECIPE` works too.

Exit codes: 0 done; 1 the run failed on bad input (one line, no traceback; BRIDGE_TRACEBACK=1
shows it); 2 the command line, the recipe, the output folder, the data or a resume was refused
before anything was written; 130 interrupted (Ctrl-C). stdout carries the JSON summary only;
status lines go to stderr.

Module-level imports are the standard library's alone: `bridge --help`, `bridge train --help` and
`bridge defaults` answer without loading torch; each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEMO_DIR = Path(__file__).resolve().parents[1] / "recipes" / "demo"
DEMOS = ("shapes", "tones", "graphs")
OVERRIDES_HELP = (
    "recipe overrides key.sub=value (optional, any number, anywhere on the line; the value is read "
    "as YAML; relative paths resolve against the current directory)"
)


def _parser(serve_arguments: Any = None) -> argparse.ArgumentParser:
    """The command line. `serve_arguments(subparser)` adds `bridge serve`'s flags; only `bridge serve`
    itself needs them (they live with the server, whose import is heavy)."""
    parser = argparse.ArgumentParser(prog="bridge", description="Train encoders into LLMs from recipes.")
    sub = parser.add_subparsers(dest="command", required=True)
    common = "[--output-dir DIR] [--nproc N] [--force] [key.sub=value ...]"
    train = sub.add_parser(
        "train", help="train a recipe YAML", usage=f"bridge train RECIPE {common}", epilog=OVERRIDES_HELP
    )
    train.add_argument("recipe", help="path to a recipe YAML")
    demo = sub.add_parser(
        "demo",
        help="train a built-in demo recipe (no download needed)",
        usage=f"bridge demo {{{','.join(DEMOS)}}} {common}",
        epilog=OVERRIDES_HELP,
    )
    demo.add_argument("name", choices=DEMOS)
    for p in (train, demo):
        p.add_argument("--output-dir", default=None, help="where outputs go (default: runs/<recipe name>)")
        p.add_argument("--nproc", type=int, default=1, help="processes (ranks) to train with via torchrun")
        p.add_argument(
            "--force",
            action="store_true",
            help="resume even when the model, encoder architecture or data differ from the checkpoint's",
        )
    defaults = sub.add_parser(
        "defaults", help="print every recipe key with its default, and the registered parts"
    )
    defaults.add_argument(
        "recipe", nargs="?", default=None, help="also import this recipe's `imports` (custom parts)"
    )
    ev = sub.add_parser("eval", help="evaluate a run's newest checkpoint (or a checkpoint) on its eval set")
    ev.add_argument("run", help="a run directory (its newest checkpoint) or a checkpoint directory")
    ev.add_argument("--backend", default=None,
                    help="generate on this vLLM-compatible server (http://host:8000) instead of in-process")
    ev.add_argument("--num-items", type=int, default=None, help="held-out items (default: the recipe's)")
    ev.add_argument("--max-tokens", type=int, default=None, help="max new tokens (default: the recipe's)")
    ev.add_argument("--structured-outputs", default=None, metavar="JSON",
                    help='constrain the answers, e.g. \'{"choice": ["cat", "dog"]}\' (default: the recipe\'s '
                         "eval.structured_outputs)")
    ev.add_argument("--device", default=None, help="where the encoders (and a local LLM) run")
    ev.add_argument("--output", default=None, help="write the full report (with samples) to this JSON file")
    ev.add_argument("--no-verify", action="store_true",
                    help="load the checkpoint even when its files differ from its manifest.json")
    ev.add_argument("--batch-invariant", action="store_true",
                    help="each item's greedy output independent of its batch (eval.batch_invariant)")
    serve = sub.add_parser("serve", help="serve a model dir or a trained run over an OpenAI-compatible API")
    if serve_arguments is None:
        serve.add_argument("rest", nargs=argparse.REMAINDER)
    else:
        serve_arguments(serve)
    return parser


def _eval(args: argparse.Namespace) -> int:
    """`bridge eval`: the checkpoint's own recipe gives the eval set and settings."""
    from bridge.backends import GenerationError, RemoteError
    from bridge.data.sources import build_datasets
    from bridge.recipe import RecipeError, load_recipe
    from bridge.training import checkpoint as ckpt_io
    from bridge.training.evaluate import evaluate_checkpoint

    run = Path(args.run)
    ckpt = run if (run / "meta.json").is_file() else ckpt_io.latest_checkpoint(run)
    if ckpt is None or not (ckpt / "recipe.yaml").is_file():
        print(f"bridge: eval: {str(run)[:200]} is neither a checkpoint nor a run with one", file=sys.stderr)
        return 2
    if not args.no_verify:  # before its recipe is read; the load below then skips hashing it again
        try:
            ckpt_io.open_checkpoint(ckpt)
        except ValueError as exc:
            print(f"bridge: eval: {str(exc)[:1000]}", file=sys.stderr)
            return 2
    given = (("num_items", args.num_items), ("max_tokens", args.max_tokens), ("backend", args.backend),
             ("structured_outputs", args.structured_outputs))
    overrides = [f"eval.{k}={v}" for k, v in given if v is not None]
    if args.batch_invariant:
        overrides.append("eval.batch_invariant=true")
    try:
        recipe = load_recipe(ckpt / "recipe.yaml", overrides)
    except RecipeError as exc:
        print(f"bridge: eval: {exc}", file=sys.stderr)
        return 2
    _, eval_set = build_datasets(recipe.data, recipe.seed)
    if eval_set is None:
        print("bridge: eval: the run's recipe has no eval set (data.eval)", file=sys.stderr)
        return 2
    import torch

    device = torch.device(args.device) if args.device else None
    try:
        report = evaluate_checkpoint(ckpt, eval_set, recipe.eval, device, args.output, verify=False)
    except (ValueError, RemoteError, GenerationError) as exc:
        print(f"bridge: eval: {str(exc)[:1000]}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2))
    return 0


def _launch_ranks(argv: Sequence[str], nproc: int, output_dir: Path) -> int:
    """Run this command as `nproc` ranks on this host (the children see WORLD_SIZE > 1)."""
    from bridge.training.launch import last_checkpoint_hint, launch

    args = list(argv)
    if "--nproc" in args:
        i = args.index("--nproc")
        del args[i : i + 2]
    args = [a for a in args if not a.startswith("--nproc=")]
    return launch(args, nproc, lambda: last_checkpoint_hint(output_dir))


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _recipe_error(path: Path, exc: Any) -> int:
    n = len(exc.problems)
    _err(f"bridge: {n} problem{'s' if n != 1 else ''} in recipe {path}:")
    for line in exc.problems:
        _err(f"  {line}")
    return 2


def describe_parts(registered: bool = True) -> str:
    """The towers, projectors and preprocessors: the registry's (built-in and imported), or with
    `registered=False` the built-in names from a static table, which loads no torch."""
    from bridge.builtin_parts import describe_parts as describe

    if not registered:
        return describe()
    from encoders.api import PREPROCESSORS, PROJECTORS, TOWERS

    return describe({"towers": tuple(TOWERS), "projectors": tuple(PROJECTORS),
                     "preprocessors": tuple(PREPROCESSORS)})


def _finite(value: Any) -> Any:
    """The summary with NaN / Inf as null, so it is valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _report(summary: dict) -> dict:
    report = {k: v for k, v in summary.items() if k != "eval"}
    if "eval" in summary:
        report["exact_match"] = summary["eval"]["exact_match"]
        report["eval_n"] = summary["eval"]["n"]
    return _finite(report)


def _final_line(summary: dict) -> str:
    parts = [f"elapsed {summary.get('elapsed_s', 0):.1f} s"]
    if summary.get("eval_json"):
        parts.append(f"eval: {summary['eval_json']}")
    if summary.get("loss_png"):
        parts.append(f"loss curve: {summary['loss_png']}")
    parts.append(f"last checkpoint: {summary.get('checkpoint')}")
    head = "already complete" if summary.get("already_complete") else f"done, {summary.get('steps')} steps"
    return f"bridge: {head}; " + "; ".join(parts)


def _defaults(recipe: str | None) -> int:
    from bridge.recipe import RecipeError, describe_schema, load_recipe

    if recipe is not None:  # its `imports` may register parts: then the registry is read
        try:
            load_recipe(recipe, check_encoder=False)
        except RecipeError as exc:
            return _recipe_error(Path(recipe).resolve(), exc)
    print(describe_schema())
    print(describe_parts(registered=recipe is not None))
    return 0


def _serve(argv: list[str]) -> int:
    try:
        from bridge.serve.server import add_serve_arguments, serve
    except ImportError as exc:
        print(f"bridge: serve needs the server extra: pip install -e \".[serve]\" ({exc})", file=sys.stderr)
        return 2
    args = _parser(add_serve_arguments).parse_args(argv)
    try:
        return serve(args)
    except ValueError as exc:
        print(f"bridge: serve: {str(exc)[:500]}", file=sys.stderr)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return _serve(argv)
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "defaults":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)[:200]}")
        return _defaults(args.recipe)
    if args.command == "eval":
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)[:200]}")
        return _eval(args)
    bad = [a for a in extra if "=" not in a or a.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)[:200]}")
    overrides = list(extra)
    if args.nproc < 1:
        _err("bridge: --nproc must be >= 1")
        return 2

    from bridge.recipe import RecipeError, default_output_dir, load_recipe

    recipe_path = DEMO_DIR / f"{args.name}.yaml" if args.command == "demo" else Path(args.recipe)
    try:
        recipe = load_recipe(recipe_path, overrides)
    except RecipeError as exc:
        return _recipe_error(recipe_path.resolve(), exc)
    output_dir = Path(args.output_dir) if args.output_dir else default_output_dir(recipe)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launching = args.nproc > 1 and world <= 1
    # every rank checks (the same files give the same answer, so all stop together); rank 0 speaks
    code = _check_run(recipe, output_dir, speak=os.environ.get("RANK", "0") == "0", notes=not launching)
    if code:
        return code
    if launching:
        return _launch_ranks(argv, args.nproc, output_dir)
    return _train(recipe, output_dir, args.force, world)


def _check_run(recipe: Any, output_dir: Path, speak: bool, notes: bool) -> int:
    """The output folder and the data, before anything is written (bridge.run_check): 2 and every
    problem listed (when `speak`), else 0 (and, with `notes`, what the run will do about the data)."""
    from bridge.run_check import check_run

    check = check_run(recipe, output_dir)
    if check.num_problems and not speak:
        return 2
    if check.num_problems:
        n = check.num_problems
        _err(f"bridge: {n} problem{'s' if n != 1 else ''} found before training (nothing was written):")
        for line in check.lines():
            _err(f"  {line}")
        return 2
    for note in check.notes if notes and speak else ():
        _err(f"bridge: {note}")
    return 0


def _train(recipe: Any, output_dir: Path, force: bool, world: int) -> int:
    # the trainer pulls in transformers and the runner: imported once the command line, the recipe
    # and the data are known to be good, so that their errors come back at once
    from bridge.training.trainer import ResumeMismatch, TrainingInterrupted, train

    try:
        summary = train(recipe, output_dir, force=force)
    except ResumeMismatch as exc:
        _err(f"bridge: refusing to resume: {exc}")
        return 2
    except TrainingInterrupted as exc:
        _err(f"bridge: {exc}")
        return 130
    except KeyboardInterrupt:
        _err("bridge: interrupted before training started; rerun the same command to start")
        return 130
    except (ValueError, FloatingPointError, OSError) as exc:
        if _traceback_wanted():
            raise
        _err(f"bridge: {_rank_prefix(world)}error: {str(exc)[:2000]}")
        return 1
    except Exception as exc:  # noqa: BLE001  one rank of several: its one line, not a traceback each
        if world <= 1 or _traceback_wanted():
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:500]
        _err(f"bridge: {_rank_prefix(world)}{type(exc).__name__}: {first}")
        return 1
    if int(os.environ.get("RANK", "0")) == 0:
        _err(_final_line(summary))  # before the JSON, so the JSON ends a merged stdout + stderr
        print(json.dumps(_report(summary), indent=2, allow_nan=False), flush=True)
    return 0


def _traceback_wanted() -> bool:
    """BRIDGE_TRACEBACK (runner.envs) asks for the full traceback instead of one line; read only when an
    error happened, so help and usage import nothing of the runner."""
    from runner.envs import TRACEBACK

    return TRACEBACK.get() is not None


def _rank_prefix(world: int) -> str:
    return f"rank {os.environ.get('RANK', '0')}: " if world > 1 else ""


if __name__ == "__main__":
    sys.exit(main())
