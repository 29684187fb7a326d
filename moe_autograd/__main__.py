"""``python -m moe_autograd {demo,bench,serve,secret} [ARGS...]``.

Each subcommand's module is imported only when it is chosen, and receives the
remaining arguments (so ``python -m moe_autograd bench -h`` is bench's help);
``demo --elastic`` is the module :mod:`.demo_elastic` (which runs the Ray
variant, :mod:`.demo_elastic_ray`, given ``--engine ray``), so that no demo
module imports another.
"""
import argparse
import logging
import sys
from typing import Callable, Optional, Sequence

from .logs import configure_cli

COMMANDS = {
    "demo": "a short tour of the runtime",
    "bench": "baseline vs moe_autograd benchmarks (see BENCHMARKS.md)",
    "serve": "serve experts to the members of a job (torch RPC or Ray)",
    "secret": "create a job secret file for remote experts",
}


def _entry(command: str, args: Sequence[str]) -> Callable[[Sequence[str]], Optional[int]]:
    if command == "bench":
        from .bench import main
    elif command == "serve":
        from .remote.cli import main
    elif command == "secret":
        from .remote.cli import secret_main as main
    elif "--elastic" in args:  # demo --elastic [--engine ray]: no demo imports another
        from .demo_elastic import main
    else:
        from .demo import main
    return main


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m moe_autograd",
                                     description="moe_autograd command line")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help in COMMANDS.items():
        commands.add_parser(name, help=help, add_help=False)
    command = parser.parse_args(args[:1]).command  # the rest belongs to the command
    # The library installs no log handler; the command line shows its
    # loggers on stderr: what a server does (INFO) for serve and secret,
    # warnings (masked experts, refused requests, ...) for demo and bench,
    # whose own story goes to stdout.
    configure_cli(f"moe_autograd {command}",
                  logging.INFO if command in ("serve", "secret") else logging.WARNING)
    try:
        entry = _entry(command, args[1:])
    except ModuleNotFoundError as error:
        if not (error.name or "").startswith(__package__ or "moe_autograd"):
            raise  # a missing third-party dependency: show the real traceback
        parser.error(f"{command!r} is not available in this checkout ({error})")
    return int(entry(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
