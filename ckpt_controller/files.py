"""Reading a small file a person names: a regular file of a sane size, or a refusal at once.

A path a person gives (the controller's config, a CURVE key file) may name anything:
``/dev/zero`` reads without end, a FIFO blocks its reader until some writer comes, a log file
given by mistake may hold gigabytes. ``read_small`` opens without blocking, looks at what it
opened, and reads only a regular file no larger than the caller's limit; anything else is an
``UnfitFileError`` saying what the path is, before a byte is read. Neighbours:
``controller.config`` (the config file), ``security`` (key files); both turn the refusal into
their ``ConfigError`` naming the file.
"""

from __future__ import annotations

import os
import stat

__all__ = ["UnfitFileError", "read_small"]

_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"))


class UnfitFileError(ValueError):
    """The path names something other than a regular file of at most the limit's size."""


def _kind(mode: int) -> str:
    """What a ``st_mode`` is, in words (``regular file`` for one)."""
    if stat.S_ISREG(mode):
        return "regular file"
    return next((word for test, word in _KINDS if test(mode)), "special file")


def read_small(path: str | os.PathLike[str], limit_bytes: int) -> bytes:
    """The bytes of the regular file at ``path`` (symbolic links followed), at most
    ``limit_bytes`` of them. ``OSError`` when it cannot be opened; ``UnfitFileError`` when it
    is not a regular file or is larger than the limit (also one that grew past it while read).
    Never blocks on what it opened: a FIFO is refused, not waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except ValueError:  # policy: a path with a NUL byte names no file: refused the same way
        raise UnfitFileError("not a path: it holds a NUL byte") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnfitFileError(f"not a regular file but a {_kind(st.st_mode)}")
        if st.st_size > limit_bytes:
            raise UnfitFileError(f"{st.st_size} bytes, more than the {limit_bytes} such a file "
                                 "may hold")
        chunks, left = [], limit_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise UnfitFileError(f"it grew past the {limit_bytes} bytes such a file may hold "
                                 "while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)
