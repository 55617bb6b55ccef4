"""`strata-tui`: parse the command line, build the app with `create_app`, run it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from strata_tui import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata-tui", description="Launch strata-engine from a saved profile and watch it live.")
    parser.add_argument("--profile", metavar="NAME", help="profile to open (default: the last used, else 'default')")
    parser.add_argument("--attach", metavar="URL", help="monitor an engine already running at URL (several: "
                        "URL,URL,... one row each); launch nothing")
    parser.add_argument("--kind", choices=("strata", "vllm", "sglang", "llamacpp"),
                        help="with --attach: the engine's kind (default: detected from the routes it answers)")
    parser.add_argument("--config-dir", metavar="DIR", type=Path,
                        help="profiles directory root (default: $STRATA_TUI_CONFIG_DIR or the platform's)")
    parser.add_argument("--no-launch", action="store_true", help="open the monitor without starting the engine")
    parser.add_argument("--version", action="version", version=f"strata-tui {__version__}")
    return parser


def check_args(args: argparse.Namespace) -> str | None:
    """One line naming the parameter that cannot work, or None."""
    from engine.errors import ConfigError
    from strata_tui.profiles.profile import check_name, default_config_dir

    for url in (args.attach or "").split(","):
        if args.attach and not url.strip().startswith(("http://", "https://")):
            return f"--attach {args.attach!r}: expected an http:// or https:// URL"
    if args.kind and not args.attach:
        return f"--kind {args.kind}: only with --attach (a profile says its kind in [engine] kind)"
    if args.profile is not None:
        try:
            check_name(args.profile)
        except ConfigError as exc:
            return f"--profile {args.profile!r}: {exc.reason}"
    config_dir = args.config_dir if args.config_dir is not None else default_config_dir()
    source = "--config-dir" if args.config_dir is not None else "$STRATA_TUI_CONFIG_DIR (or the platform's)"
    for folder in (config_dir, config_dir / "profiles"):
        if folder.exists() and not folder.is_dir():
            return f"{source} {str(config_dir)!r}: {folder} exists and is not a directory"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"strata-tui: error: {problem}", file=sys.stderr)
        return 2
    from engine.errors import StrataError
    from strata_tui.app import create_app

    try:
        app = create_app(config_dir=args.config_dir, profile=args.profile, attach_url=args.attach,
                         launch=not args.no_launch, handle_signals=True, attach_kind=args.kind)
    except StrataError as exc:
        print(f"strata-tui: error: {exc}", file=sys.stderr)
        return 2
    app.run()
    return int(app.return_code or 0)


if __name__ == "__main__":
    sys.exit(main())
