"""Publishing a checkpoint directory atomically, so a crash at any moment leaves a loadable one.

A save writes into a temporary sibling (``.<name>.zeroq-tmp-<token>``, same parent, so a rename is
atomic), every rank fsyncs its files, rank 0 writes the manifest last and fsyncs it and the
directory, and only then puts the directory in place:

- nothing at ``path``: one ``rename``;
- something at ``path`` (an older checkpoint, a file, a link): ``renameat2(RENAME_EXCHANGE)`` swaps
  the two in one step (Linux >= 3.15 on ext4, xfs, btrfs, tmpfs, ...), then the old one, now under
  the temporary name, is removed. Where the exchange is not supported (NFS, other systems) the old
  one is first renamed to ``.<name>.zeroq-old-<token>`` and the new one renamed into place; a crash
  between the two renames leaves no ``path`` but a complete ``-old`` sibling, which ``recover``
  finds (the loader then reads it, with a warning).

``fault(point)`` kills the process with SIGKILL at a named point when ``ZEROQ_CHECKPOINT_FAULT``
names it: the crash tests use it; it costs one environment lookup otherwise.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

TMP_TAG = ".zeroq-tmp-"
OLD_TAG = ".zeroq-old-"
FAULT_ENV = "ZEROQ_CHECKPOINT_FAULT"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
exchange_supported: Optional[bool] = None
"""None: not tried yet; False: fall back to two renames (tests set it to exercise the fallback)."""


def fault(point: str) -> None:
    if os.environ.get(FAULT_ENV) == point:
        os.kill(os.getpid(), signal.SIGKILL)


def temp_dir(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}{TMP_TAG}{token[:16]}"


@contextmanager
def new_file(out: Path) -> Iterator[tuple[int, Path]]:
    """A fresh file beside ``out`` to write, created exclusively under an unpredictable name (never
    through a link): yields its open descriptor (the caller closes it) and its path. When the block
    ends normally the file gets the mode a plain ``open()`` would give, replaces ``out`` and the
    directory is fsynced (the caller fsyncs the file it wrote); whatever else happens it is removed."""
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".zeroq-tmp", dir=out.parent)
    tmp = Path(name)
    try:
        yield fd, tmp
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600
        os.replace(tmp, out)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(out.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # some file systems do not fsync directories
        pass
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Remove a file, a link (never what it points to) or a directory tree; nothing if absent."""
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)


def _exchange(a: Path, b: Path) -> bool:
    global exchange_supported
    if exchange_supported is False:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        exchange_supported = False
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        exchange_supported = True
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        exchange_supported = False
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b} failed: {os.strerror(err)}")


def publish(tmp: Path, path: Path, token: str) -> None:
    """Put the complete directory ``tmp`` at ``path``, replacing whatever is there, atomically."""
    fsync_dir(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif _exchange(tmp, path):
        fault("after_exchange")
        fsync_dir(path.parent)
        remove(tmp)  # the previous checkpoint, now under the temporary name
    else:
        old = path.parent / f".{path.name}{OLD_TAG}{token[:16]}"
        os.rename(path, old)
        fsync_dir(path.parent)
        fault("between_renames")
        os.rename(tmp, path)
        fsync_dir(path.parent)
        remove(old)
    fsync_dir(path.parent)


def leftovers(path: Path) -> list[Path]:
    """Temporary or displaced siblings of ``path`` left by interrupted saves."""
    prefixes = (f".{path.name}{TMP_TAG}", f".{path.name}{OLD_TAG}")
    try:
        return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefixes))
    except FileNotFoundError:
        return []


def recover(path: Path) -> Optional[Path]:
    """The displaced previous checkpoint of ``path`` if a save died between its two renames."""
    olds = [p for p in leftovers(path) if OLD_TAG in p.name]
    return olds[-1] if olds and not os.path.lexists(path) else None
