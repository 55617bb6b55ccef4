"""`strata-engine serve | generate | quantize | bench`: argument parsing and dispatch only.

Each subcommand lives in its own module (`engine.cli.serve`, `.generate`, `.quantize`, `engine.bench.command`);
all are imported to build the parser, and none imports torch at module level (the model, the engine and each benchmark are imported
inside `run`), so `--help` stays fast and torch-free. Expected failures
(StrataError: bad option, bad checkpoint, ...) print one line on stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from engine.errors import StrataError


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors on one line (`strata-engine serve: error: argument --x: ...`, exit 2), as every
    other start-up error of the CLI: the 15-line usage block buried the one line that said what was wrong."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

SUBCOMMANDS = {
    "serve": ("engine.cli.serve", "run the OpenAI-compatible server"),
    "generate": ("engine.cli.generate", "generate text for one prompt and print it"),
    "bench": ("engine.bench.command", "measure decode, prefill, MTP and graph figures; print a table, write JSON"),
    "quantize": ("engine.cli.quantize", "round a checkpoint to fp8 or int4 once and write it (compressed-tensors)"),
}


def build_parser() -> argparse.ArgumentParser:
    from engine import __version__

    parser = OneLineParser(prog="strata-engine", description="Strata inference engine")
    parser.add_argument("--version", action="version", version=f"strata-engine {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except StrataError as exc:
        print(f"strata-engine {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

