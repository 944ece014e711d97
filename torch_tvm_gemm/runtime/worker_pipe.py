"""The messages between a caller and its compile workers: each its length, then a pickle."""

from __future__ import annotations

import os
import struct

MESSAGE_HEADER = struct.Struct("<Q")  # a message: its length (8 bytes), then a pickle


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_exact(fd: int, size: int) -> bytes | None:
    """``size`` bytes from ``fd``, or None at the end of the input (the writer died)."""
    parts, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)
