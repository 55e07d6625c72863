"""`python -m moeflow.cli_trace ACTION ...`: the `moeflow trace` command as a program of its own.

    python -m moeflow.cli_trace replay t.jsonl --slots 8 16     # = moeflow trace replay ...

The subcommand itself (parser, actions, the default recording text) is moeflow.trace_command,
which `moeflow.cli` adds to the `moeflow` parser; its public names are re-exported here.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .cli import main as cli_main
from .trace_command import DEFAULT_CTX, DEFAULT_TOKENS, add_trace_parser, default_text

__all__ = ["DEFAULT_CTX", "DEFAULT_TOKENS", "add_trace_parser", "default_text", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """`moeflow trace ACTION ...` (the same parser and error handling as the `moeflow` command)."""
    return cli_main(["trace", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
