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


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default, unless the help already says it or there is
    none to show (None, False: the flag is off or derived, and its help says what then)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The ``kvtier`` parser; only the subcommand named in ``argv`` gets its flags (and
    imports its module)."""
    parser = argparse.ArgumentParser(prog="kvtier", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvtier {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=DefaultsHelpFormatter
        )
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    return parser


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` inside ``build_parser``'s ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]  # type: ignore[no-any-return]
    raise KeyError(name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return 2
    if extra:  # under the subcommand's usage, not the top level's (exit code 2)
        subcommand_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.main(args) or 0)
    except BrokenPipeError:  # `kvtier analyze ... | head`: the reader left; no traceback
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
