"""Who may put code in the kernel cache: private directories, owned kernel files.

A cached kernel is a shared library that the process loads and runs, so whoever can write
the cache directory can run code in every process that uses it. As ssh does with
``~/.ssh``, a directory or kernel file is trusted only if it belongs to this user (or to
root, who could change it anyway: a read-only cache an administrator provides) and neither
its group nor others may write it. The cache directories are created ``0700``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` (and missing parents) readable and writable by this user only;
    an existing one is left as it is (``untrusted_dir`` says whether it may be used)."""
    missing = []
    d = directory
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:  # another process made it meanwhile
            pass


def _problem(st: os.stat_result, what: str) -> str | None:
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return f"{what} belongs to uid {st.st_uid}, not to this user (uid {uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def untrusted_dir(directory: Path) -> str | None:
    """Why code must not be loaded from ``directory``, or None if it is private."""
    try:
        st = os.stat(directory)
    except OSError as err:
        return f"{directory} cannot be read ({err.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{directory} is not a directory"
    return _problem(st, str(directory))


def untrusted_file(path: Path) -> str | None:
    """Why the cache file ``path`` must not be used, or None: it must be a regular file (not
    a link) of this user that its group and others cannot write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None  # nothing there: nothing to trust or refuse
    except OSError as err:
        return f"{path} cannot be read ({err.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    return _problem(st, str(path))
