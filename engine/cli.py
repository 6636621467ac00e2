"""``kvtier`` console script: one subcommand per entry point, each in its own module.

Each subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int`` and is
imported only when its subcommand runs or ``--help`` needs it, so ``kvtier analyze`` never
imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("engine.server.cli", "OpenAI-compatible serving engine"),
    "demo": ("engine.demo.run", "a multi-turn chat with KV offload on a real (or the tiny) model"),
    "cache-server": ("cachestore.server.cli", "standalone KV cache daemon shared by engines"),
    "analyze": ("cachestore.analyze.cli", "cache-hit analysis of a request trace"),
}


def package_version() -> str:
    """The installed distribution's version (the source tree's when run from a checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvtier")
    except PackageNotFoundError:
        return "0+unknown"


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvtier {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if args.command is None:
        build_parser([]).print_help()
        return 2
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
