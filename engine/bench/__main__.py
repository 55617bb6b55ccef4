"""`python -m engine.bench WHAT ...`: the `strata-engine bench` subcommands without the other subcommands' parsers.

The GPU driver (benchmarks/run_all_gpu.sh) uses this form: the device image runs from a source checkout
without the package installed, and a benchmark run should not depend on the server's modules importing.
"""

from __future__ import annotations

import argparse
import sys

from engine.bench import command as cli_bench
from engine.errors import StrataError


def main(argv: list[str] | None = None) -> int:
    """Parse `WHAT ...`, run that benchmark; a StrataError is one line on stderr and exit 2."""
    parser = argparse.ArgumentParser(prog="python -m engine.bench", description=cli_bench.__doc__.splitlines()[0])
    cli_bench.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return cli_bench.run(args)
    except StrataError as exc:
        print(f"strata-engine bench {args.bench}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
