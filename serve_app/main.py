"""The ``calid`` command: the library's commands, the client, serving, and every benchmark.

    calid models | generate      calid/commands.py (no Ray)
    calid client                 calid/client/commands.py (a running server)
    calid serve | demo           serve_app/cluster/serve_commands.py (an embedded Ray, or one you name)
    calid bench <name>           serve_app/bench/registry.py (engine and served benchmarks)

Errors a user can fix print one line (``calid: error: ...``) and exit 2.
"""
from __future__ import annotations

import argparse
import sys

from calid.errors import CalidError


MODEL_COMMANDS = ("generate", "serve", "demo", "bench")  # the commands that load models (here or in Ray workers)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in MODEL_COMMANDS:
        from calid.hugepages import reexec

        reexec()  # once, before anything is loaded: weights on huge pages (calid.hugepages)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args) or 0
    except CalidError as exc:
        print(f"calid: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("calid: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    from calid import commands
    from calid.client import commands as client_commands
    from serve_app.bench import registry
    from serve_app.cluster import serve_commands

    parser = argparse.ArgumentParser(prog="calid", description="Serve LLMs faster with draft models.")
    sub = parser.add_subparsers(dest="command", required=True)
    commands.add_parsers(sub)
    client_commands.add_parser(sub)
    serve_commands.add_parsers(sub)
    bench = sub.add_parser("bench", help="side-by-side benchmarks")
    registry.add_parsers(bench.add_subparsers(dest="bench_command", required=True))
    return parser


if __name__ == "__main__":
    sys.exit(main())
