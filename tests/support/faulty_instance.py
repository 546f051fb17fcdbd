"""Serve one instance with faults: ``python -m tests.support.faulty_instance [FAULTS] serve ...``.

For tests only. After the fault flags (`Faults.add_flags`: ``--drop-messages``,
``--stall-file``, ``--scripted-output``) comes a ``kvduplex serve`` command line,
parsed, logged and served as `kvduplex.cli.main.main` does it (the same settings
layers, effective-config line, NIXL check, draining and exit codes: `run_serve`), with
the faults passed as its `InstanceParts`. `tests.support.faults.start_instance`
starts it.
"""

from __future__ import annotations

import argparse
import sys

from kvduplex.cli.main import log_effective_config
from kvduplex.cli.main import parse_args
from kvduplex.cli.main import run_serve
from kvduplex.cli.main import setup_logging
from kvduplex.cli.settings import ServeSettings
from tests.support.faults import Faults


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.faulty_instance", description=__doc__, allow_abbrev=False
    )
    Faults.add_flags(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="serve and its flags")
    ours = parser.parse_args(argv)
    if not ours.command or ours.command[0] != "serve":
        parser.error("the fault flags are followed by a kvduplex serve command line")
    try:
        args = parse_args(ours.command)
        assert isinstance(args, ServeSettings)
        faults = Faults.from_args(ours)
    except ValueError as exc:
        print(f"faulty_instance: error: {exc}", file=sys.stderr)
        sys.exit(2)
    setup_logging(str(args.log_level))
    log_effective_config(args)
    try:
        run_serve(args, faults.parts(args.engine_config().model.model))
    except ValueError as exc:  # config errors, as kvduplex's: no traceback
        print(f"faulty_instance: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
