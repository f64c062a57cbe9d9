"""The `spirit` command line: generate, models, bench, sol, serve, bench-serve.

Every user error ends in one line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from spirit.cli_args import add_decoding_args, add_model_args, generation_kwargs, load_for_cli
from spirit.model.bundled import BUNDLED
from spirit.request import Request


class CLIError(Exception):
    pass


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input or a missing resource, not a bug."""
    from spirit.engine import ContextLengthError
    from spirit.model.adapter import UnsupportedModelError
    from spirit.model.bundled import ModelFetchError
    from spirit.model.kv_cache import CacheFullError
    from spirit.model.loader import ModelNotFoundError
    from spirit.skipset import SkipSetError

    return (CLIError, ValueError, ModelFetchError, ModelNotFoundError, SkipSetError, ContextLengthError,
            UnsupportedModelError, CacheFullError, FileNotFoundError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spirit", description="Lossless self-speculative decoding that adapts to measured speed.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    add_model_args(g)
    add_decoding_args(g)
    g.add_argument("--prompt", default=None, help="the prompt (default: read stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON object: text, token ids, stats")
    g.add_argument("--stats", action="store_true", help="print speed statistics to stderr")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list or fetch the bundled models")
    msub = m.add_subparsers(dest="models_command", required=True)
    ml = msub.add_parser("list", help="bundled models and whether they are fetched")
    ml.set_defaults(func=cmd_models_list)
    mp = msub.add_parser("pull", help="fetch, verify and convert a bundled model")
    mp.add_argument("name")
    mp.set_defaults(func=cmd_models_pull)

    for command in SUBSYSTEM_COMMANDS:
        command.register(sub)
    return parser


@dataclass(frozen=True)
class SubsystemCommand:
    """A subcommand that lives with its subsystem. It is always registered, so `--help` works
    on a plain `pip install -e .`: its module imports nothing optional until it runs. Running
    it first checks that the packages of its extra are installed, and otherwise says which
    extra to install, before any model loads."""

    name: str
    module: str  # defines register(subparsers), which sets the parser's `func`
    extra: str | None = None  # the pyproject extra it needs; several comma-separated, as pip takes them
    needs: tuple[str, ...] = ()  # modules that extra installs
    purpose: str = ""  # what they are for, in the message

    def register(self, subparsers) -> None:
        try:
            module = importlib.import_module(self.module)
        except ImportError as exc:  # a broken checkout or install: say so when used, keep the rest working
            self._register_broken(subparsers, exc)
            return
        module.register(subparsers)
        if self.needs:
            parser = subparsers.choices[self.name]
            parser.set_defaults(func=self._checked(parser.get_default("func")))

    def _register_broken(self, subparsers, exc: ImportError) -> None:
        parser = subparsers.add_parser(self.name, help=f"(cannot be loaded: {exc})", add_help=False)
        parser.add_argument("ignored", nargs=argparse.REMAINDER)

        def fail(args: argparse.Namespace) -> int:
            raise CLIError(f"spirit {self.name} cannot be loaded ({self.module}: {exc}); reinstall spirit")

        parser.set_defaults(func=fail)

    def missing(self) -> list[str]:
        return [m for m in self.needs if importlib.util.find_spec(m) is None]

    def _checked(self, func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        def run(args: argparse.Namespace) -> int:
            missing = self.missing()
            if missing:
                extras = self.extra.split(",")
                which = " and ".join(f"'{e}'" for e in extras) + (" extras install" if len(extras) > 1 else " extra installs")
                raise CLIError(f"spirit {self.name} needs {' and '.join(missing)}{self.purpose}, which the "
                               f"{which}: pip install -e '.[{self.extra}]' (or pip install 'spirit[{self.extra}]')")
            return func(args)

        return run


SUBSYSTEM_COMMANDS = (
    SubsystemCommand("bench", "spirit.bench.cli", "bench", ("matplotlib",), " for its plots"),
    SubsystemCommand("sol", "spirit.sol.cli"),
    SubsystemCommand("serve", "spirit.server.cli", "serve", ("fastapi", "uvicorn", "pydantic"), " for the HTTP server"),
    SubsystemCommand("bench-serve", "spirit.bench.serve_cli", "serve,bench", ("fastapi", "uvicorn", "pydantic", "matplotlib"),
                     " for the HTTP server and its plots"),
)


def cmd_generate(args: argparse.Namespace) -> int:
    kwargs = generation_kwargs(args)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise CLIError("empty prompt: pass --prompt or pipe text on stdin")
    Request.build(prompt, chat=args.chat, stop=args.stop, **kwargs)  # bad options fail before the model loads
    lm = load_for_cli(args)
    if args.method == "hf":
        result = lm.generate(prompt, chat=args.chat, stop=args.stop, **kwargs)
        if not args.json:
            print(result.text)
    else:
        stream = lm.stream(prompt, chat=args.chat, stop=args.stop, **kwargs)
        for piece in stream:
            if not args.json:
                print(piece, end="", flush=True)
        result = stream.result
        if not args.json:
            print()
        _save_profile(lm, args, kwargs)
    if args.json:
        payload = result.to_dict()
        payload["model"] = lm.name
        payload["dtype"] = str(lm.dtype).removeprefix("torch.")
        payload["dtype_reason"] = lm.dtype_reason
        payload["weights"] = lm.weights
        payload["weights_reason"] = lm.weights_reason
        payload["packing"] = lm.packing
        payload["exactness"] = lm.exactness.to_dict()
        print(json.dumps(payload))
    elif args.stats:
        s = result.stats
        print(
            f"[{lm.name} {args.method}] {s.new_tokens} tokens in {s.wall_time_s:.2f}s = {s.tokens_per_s:.1f} tok/s; "
            f"acceptance {s.counters.acceptance_rate:.2f}, mean accepted {s.counters.mean_accepted:.2f}, "
            f"draft {s.counters.draft_time_s:.2f}s / verify {s.counters.verify_time_s:.2f}s{_sol_note(lm, s)}",
            file=sys.stderr,
        )
        # the output is a function of the dtype and of whether verification is bit-exact here
        dtype = str(lm.dtype).removeprefix("torch.")
        print(f"[{lm.name} {dtype}] dtype: {lm.dtype_reason}; linear layers: {lm.weights} ({lm.weights_reason})",
              file=sys.stderr)
        print(f"[{lm.name} {dtype}] {lm.exactness.reason}", file=sys.stderr)
    return 0


def _sol_note(lm, stats) -> str:
    """'; X% of the speed-of-light bound' for the measured decode speed, when this CPU has
    been calibrated (`spirit sol calibrate`); never triggers a calibration itself."""
    try:
        from spirit.sol import decode_cost, load_hardware

        hardware = load_hardware("this-cpu")
        context = stats.prompt_tokens + stats.new_tokens // 2
        bound = decode_cost(lm.hf_model.config, lm.dtype, context, weights=lm.weights).seconds(hardware)
    except Exception:  # no calibration yet, or an unusual config: the figure is optional
        return ""
    if stats.decode_tokens_per_s <= 0:
        return ""
    return f"; {100 * bound * stats.decode_tokens_per_s:.0f}% of the speed-of-light bound (plain decoding, this CPU)"


def _save_profile(lm, args: argparse.Namespace, kwargs: dict) -> None:
    if not args.profile_file:
        return
    from pathlib import Path

    from spirit.policies.profiles import save_profile

    policy = lm.policy(args.method, kwargs["skip"], kwargs["draft"], args.profile_file)
    save_profile(policy, Path(args.profile_file))


def cmd_models_list(args: argparse.Namespace) -> int:
    from spirit.model.bundled import gguf_path
    from spirit.model.loader import converted_dir

    for spec in BUNDLED.values():
        state = "ready" if (converted_dir(spec.name) / "spirit-source.json").exists() else (
            "fetched" if gguf_path(spec).exists() else "not fetched")
        print(f"{spec.name:22s} {spec.architecture:6s} {spec.num_layers:3d} layers  {state:11s}  {spec.description}")
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from spirit.model.loader import resolve

    if args.name not in BUNDLED:
        raise CLIError(f"unknown bundled model {args.name!r}; choose one of {', '.join(BUNDLED)}")
    _, folder = resolve(args.name)
    print(f"{args.name}: ready at {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # spirit never fetches from a model hub
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per error, no weight-loading bars
    try:
        return args.func(args)
    except _user_errors() as exc:
        print(f"spirit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spirit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
