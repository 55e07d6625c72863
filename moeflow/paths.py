"""Paths a user names on the command line: inputs are regular files, outputs never clobber.

    check_input_file(path, option)                     -> path   (an existing regular file)
    check_output_file(path, option, inputs=..., ours=..., force=...) -> path
    check_output_dir(path, option)                     -> path   (an existing, writable directory)

Every command that writes a file checks its output paths with `check_output_file` before
any work: the parent directory exists (nothing is created on the way), the path is not a
directory, a FIFO or a device, it is not one of the command's inputs (nor a file of an input
directory, such as a checkpoint's weights), and an existing file is replaced only when
moeflow wrote it (`ours(path)` recognises the file kind, e.g. a trace header or a PNG's
moeflow text chunk) or when the user passes `--force`. An input is never overwritten, with
or without `--force`: the command reads it while it writes.

An input that is not a regular file is refused by name: reading a FIFO blocks until a
writer appears, a directory or a device is no input file either.

Errors are `PathError` (a ValueError) naming the option, the path and what was expected;
`moeflow.cli` prints them as one line, exit code 2. No torch or moeflow import.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable

__all__ = ["PathError", "check_input_file", "check_output_dir", "check_output_file", "file_kind"]


class PathError(ValueError):
    """A path a command cannot read or must not write; the message names the option and the path."""


def file_kind(mode: int) -> str:
    """What a non-regular file is, for a message: 'a FIFO', 'a directory', ..."""
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def check_input_file(path: str | os.PathLike, option: str) -> str:
    """`path` when it names an existing regular file (symlinks followed); else FileNotFoundError / PathError.

    option: what the path is, as the user named it ("--text", "trace").
    """
    p = os.fspath(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{option} {p!r} does not exist") from None
    except OSError as exc:
        raise PathError(f"{option} {p!r} cannot be read ({type(exc).__name__}: {exc})") from exc
    if not stat.S_ISREG(mode):
        raise PathError(f"{option} {p!r} is {file_kind(mode)}, expected a regular file")
    return p


def check_output_dir(path: str | os.PathLike, option: str) -> str:
    """`path` when it names an existing directory this process may write into; else PathError."""
    p = os.fspath(path)
    if not p:
        raise PathError(f"{option}='': expected a directory")
    if not os.path.exists(p):
        raise PathError(f"{option}={p!r}: no such directory; expected an existing directory (create it first)")
    if not os.path.isdir(p):
        raise PathError(f"{option}={p!r}: not a directory; expected the directory to write into")
    if not os.access(p, os.W_OK | os.X_OK):
        raise PathError(f"{option}={p!r}: the directory is not writable")
    return p


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_output_file(
    path: str | os.PathLike,
    option: str,
    *,
    inputs: Iterable[tuple[str, str | os.PathLike | None]] = (),
    ours: Callable[[str], bool] | None = None,
    force: bool = False,
) -> str:
    """`path` when the command may write it (see the module doc); else PathError naming `option` and `path`.

    inputs: (name, path) of what the command reads ("--text", "MODEL"); a directory input
            protects the files in it that `ours` does not recognise. None paths are skipped.
    ours:   True for an existing file moeflow wrote (of the kind this option writes).
    force:  replace an existing file moeflow did not write (never an input).
    """
    p = os.fspath(path)
    if not p:
        raise PathError(f"{option}='': expected a file path")
    if os.path.isdir(p):
        raise PathError(f"{option}={p!r} is a directory; expected a file path")
    parent = os.path.dirname(os.path.abspath(p))
    if not os.path.exists(parent):
        raise PathError(f"{option}={p!r}: the directory {parent!r} does not exist; expected an existing "
                        f"directory (create it first)")
    if not os.path.isdir(parent):
        raise PathError(f"{option}={p!r}: {parent!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PathError(f"{option}={p!r}: the directory {parent!r} is not writable")
    exists = os.path.lexists(p)
    if exists and not os.path.exists(p):
        raise PathError(f"{option}={p!r} is a broken symbolic link; expected a file path")
    is_ours = exists and ours is not None and stat.S_ISREG(os.stat(p).st_mode) and ours(p)
    for name, src in inputs:
        if src is None:
            continue
        s = os.fspath(src)
        if os.path.isdir(s):
            inside = os.path.realpath(p).startswith(os.path.realpath(s) + os.sep)
            if inside and exists and not is_ours:
                raise PathError(f"{option}={p!r} is a file of the input {name} {s!r}; writing it would destroy "
                                f"the input: choose another path")
        elif os.path.exists(s) and _same_file(p, s):
            raise PathError(f"{option}={p!r} is the input {name}; writing it would destroy the input: "
                            f"choose another path")
    if not exists:
        return p
    mode = os.stat(p).st_mode
    if not stat.S_ISREG(mode):
        raise PathError(f"{option}={p!r} is {file_kind(mode)}; expected a regular file path")
    if not is_ours and not force:
        raise PathError(f"{option}={p!r} exists and moeflow did not write it; pass --force to replace it, "
                        f"or choose another path")
    if not os.access(p, os.W_OK):
        raise PathError(f"{option}={p!r}: the file is not writable")
    return p
