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

Several saves of the same path may run at once (two runs, two jobs sharing a directory). Each holds
a shared ``flock`` on its temporary directory from its creation (``create_owned``) until it is in
place (``release``); the cleanup of leftovers (``remove_leftovers``) removes only what it can lock
exclusively, so it never removes a save in progress, and a publish that finds the path taken or
gone since it looked tries again. The last publish wins; every save that returned was in place.

``fault(point)`` kills the process with SIGKILL at a named point when ``ZEROQ_CHECKPOINT_FAULT``
names it: the crash tests use it; it costs one environment lookup otherwise.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional

from lightning_zeroq.nulls import nothing

TMP_TAG = ".zeroq-tmp-"
OLD_TAG = ".zeroq-old-"
FAULT_ENV = "ZEROQ_CHECKPOINT_FAULT"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
exchange_supported: Optional[bool] = None
"""None: not tried yet; False: fall back to two renames (tests set it to exercise the fallback)."""
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)
_TAKEN = (errno.EEXIST, errno.ENOTEMPTY)
PUBLISH_ATTEMPTS = 10
DISPLACED_WAIT_S = 2.0


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
    """Remove a file, a link (never what it points to) or a directory tree; nothing if absent, and
    nothing for what another process removes meanwhile."""
    try:
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
        elif os.path.isdir(path):
            if sys.version_info >= (3, 12):
                shutil.rmtree(path, onexc=_gone_is_fine)
            else:
                shutil.rmtree(path, onerror=lambda fn, name, info: _gone_is_fine(fn, name, info[1]))
    except FileNotFoundError:
        pass


def _gone_is_fine(fn: object, name: str, error: BaseException) -> None:
    if not isinstance(error, FileNotFoundError):
        raise error


def _same(fd: int, path: Path) -> bool:
    """Is ``path`` still the file ``fd`` was opened on (not removed, nor replaced)?"""
    try:
        here, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def create_owned(tmp: Path) -> Optional[int]:
    """Create the temporary directory ``tmp`` (and its parents) for a save, held with a shared ``flock``
    until ``release(fd)``, so that no other save's cleanup removes it (``remove_leftovers``); the
    directory keeps the lock when it is renamed into place. None where the file system has no locks."""
    for _ in range(PUBLISH_ATTEMPTS):
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(tmp, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW)
        except FileNotFoundError:  # a cleanup removed it between the mkdir and the open: make it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a cleanup that took it first removes it
        except OSError as error:
            os.close(fd)
            if error.errno in _NO_LOCKS:
                return None
            raise
        if _same(fd, tmp):
            return fd
        os.close(fd)  # a cleanup removed it before the lock: make it again
    raise OSError(errno.EAGAIN, f"{tmp} was removed by other saves' cleanup {PUBLISH_ATTEMPTS} times while being made")


def release(fd: Optional[int]) -> Optional[int]:
    """Close the lock ``fd`` of ``create_owned`` (None: nothing); returns None, what its holder keeps."""
    if fd is not None:
        os.close(fd)
    return None


def remove_unowned(path: Path, wait_s: float = 0.0) -> bool:
    """Remove the leftover ``path`` unless a live save holds it (``create_owned``), waiting up to
    ``wait_s`` for its lock (a checkpoint this save displaced: its own save releases it once it was in
    place); True if removed. Where the file system has no locks, it is removed, as nothing can tell."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        remove(path)  # a link: no save's directory
        return True
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno in _NO_LOCKS:
                    break
                if time.monotonic() >= deadline:
                    return False  # a save in progress (EWOULDBLOCK), or one removing it already
                time.sleep(0.005)
        if not _same(fd, path):
            return False
        remove(path)
        return True
    finally:
        os.close(fd)


def remove_leftovers(path: Path) -> None:
    """Remove the temporary or displaced siblings of ``path`` that no live save holds."""
    for leftover in leftovers(path):
        remove_unowned(leftover)


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


def publish(tmp: Path, path: Path, token: str, placed: Callable[[], None] = nothing) -> None:
    """Put the complete directory ``tmp`` at ``path``, replacing whatever is there, atomically; ``placed()``
    runs as soon as it is there (the save releases its lock, ``create_owned``). Another save of ``path``
    may publish meanwhile: a path taken (or gone) since it was looked at is looked at again."""
    fsync_dir(tmp)
    for _ in range(PUBLISH_ATTEMPTS):
        if _publish_once(tmp, path, token, placed):
            fsync_dir(path.parent)
            return
    raise OSError(
        errno.EAGAIN,
        f"{path} kept changing while {tmp} was put in its place (other saves of the same "
        f"path, {PUBLISH_ATTEMPTS} attempts); save again",
    )


def _publish_once(tmp: Path, path: Path, token: str, placed: Callable[[], None]) -> bool:
    if not os.path.lexists(path):
        try:
            os.rename(tmp, path)
        except OSError as error:
            if error.errno in _TAKEN:
                return False  # another save put its checkpoint there meanwhile
            raise
        placed()
        return True
    try:
        exchanged = _exchange(tmp, path)
    except FileNotFoundError:
        return False  # another save displaced it meanwhile (two renames)
    if exchanged:
        placed()
        fault("after_exchange")
        fsync_dir(path.parent)
        remove_unowned(tmp, wait_s=DISPLACED_WAIT_S)  # the previous checkpoint, now under the temporary name
        return True
    old = path.parent / f".{path.name}{OLD_TAG}{token[:16]}"
    try:
        os.rename(path, old)
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    fault("between_renames")
    try:
        os.rename(tmp, path)
    except OSError as error:
        if error.errno not in _TAKEN:
            raise
        remove_unowned(old, wait_s=DISPLACED_WAIT_S)  # another save's checkpoint took the place: ours next
        return False
    placed()
    fsync_dir(path.parent)
    remove_unowned(old, wait_s=DISPLACED_WAIT_S)
    return True


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
