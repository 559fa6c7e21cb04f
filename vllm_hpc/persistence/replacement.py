"""Files replaced whole: written to a temporary file beside the target, made durable, renamed
over it and the directory synced. A crash before the rename leaves the previous file as it was,
and a temporary file that the next start removes (`remove_temporaries`)."""

from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from pathlib import Path

_TMP = ".tmp"


def temporary_beside(target: Path) -> tuple[int, Path]:
    """A new temporary file in ``target``'s directory (same filesystem: the rename is atomic),
    open for writing: its descriptor and path."""
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=_prefix(target), suffix=_TMP)
    return fd, Path(temporary)


def replace_durably(temporary: Path, target: Path) -> None:
    """Rename a written and fsynced temporary file over ``target`` and make the rename durable."""
    os.replace(temporary, target)
    fsync_directory(target.parent)


def remove_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files a save killed before its rename left beside ``path`` (the
    previous file is intact), and name them. Only for an engine that owns ``path``: another
    engine's save in progress would lose its temporary file."""
    target = Path(path)
    removed = []
    for temporary in target.parent.glob(f"{glob.escape(_prefix(target))}*{_TMP}"):
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
            removed.append(temporary)
    return removed


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX); a platform without directory handles
    skips it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse a directory fsync
            os.fsync(fd)
    finally:
        os.close(fd)


def _prefix(target: Path) -> str:
    return f".{target.name}."
