"""The private directory of a swapper: created exclusively, locked, removed at the end; leftovers of
killed runs reported (or removed by the launcher that killed them).

Files
    Each swapper creates its own private directory when it is constructed,
    ``<nvme_path>/<prefix>_rank<rank:05d>_<random>/`` (mode 0700, created exclusively with a fresh
    random name), so two runs on the same path and rank, or two swappers of one run, never share a
    file, and the one that exits first never deletes the other's. ``nvme_path`` itself may be a
    symlink (to a mount, say); nothing below it is ever followed: the directory is opened once with
    ``O_NOFOLLOW`` and kept open, every file in it is created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` and
    reopened with ``O_NOFOLLOW`` relative to that descriptor, so a symlink planted in it makes the
    operation fail (naming the file) instead of truncating or reading what it points to.
    The directory holds a lock file, ``.lock``, with the owner's pid and host, ``flock``-ed for the
    swapper's lifetime. A new swapper reports (one warning line each, never removes) directories of
    its prefix and rank whose lock is free and whose owner on this host is gone: leftovers of a run
    killed by SIGKILL, which only a person can know to be safe to delete. A swapper of rank 0 reports
    those of every prefix and rank, so one rank's log names every leftover of a killed job. A
    launcher that killed the ranks it started removes their directories
    (:func:`remove_directories_of`: the lock names the dead pid, so they are provably its own).
    A swapper that removes its directory first renames it to ``.<name>.pid<pid>@<host hash>``: until the
    directory is gone, its lock or its name says whose it is, even after a SIGKILL that lands between
    unlinking the lock and removing the directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import secrets
import tempfile
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from lightning_zeroq.swap.cleanup import forget_live
from lightning_zeroq.swap.io import PROBE_NAME
from lightning_zeroq.swap.regions import PathLike, Region

log = logging.getLogger(__name__)

THREAD_PREFIX = "zeroq-nvme-"
_LOCK_NAME = ".lock"
_NO_LOCKS_ERRNOS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)
_SWAP_DIRECTORY = re.compile(r"^[A-Za-z0-9_.-]+_rank\d{5}_[0-9a-f]{8}$")
_CLAIMED = re.compile(r"^\.[A-Za-z0-9_.-]+_rank\d{5}_[0-9a-f]{8}\.pid(\d+)@([0-9a-f]{8})$")
_reported_leftovers: set[str] = set()


@dataclass
class Resources:
    """What cleanup needs. Held by a ``weakref.finalize`` and by the live registry that the signal
    handlers walk, so it must not reference the swapper."""

    root: Path
    name: str  # the private directory's name in ``root``
    root_fd: int
    dir_fd: int
    lock_fd: Optional[int] = None
    owner_pid: int = field(default_factory=os.getpid)
    files: set[str] = field(default_factory=set)  # names of the swap files this swapper created
    executors: list[ThreadPoolExecutor] = field(default_factory=list)
    removed: bool = False
    removal_done: bool = False  # ``remove_files`` ran to its end (in whichever thread started it)
    released: bool = False

    @property
    def directory(self) -> Path:
        return self.root / self.name

    def cleanup(self) -> None:
        """Stop the threads, remove the files and the directory, close the descriptors; runs once.

        Best effort: reports problems in the log and never raises.
        """
        if self.released:
            return
        self.released = True
        forget_live(self)
        if os.getpid() != self.owner_pid:
            return  # a forked child's copy: the directory and everything in it are the parent's
        # The last reference can die on one of our own threads, which must not join itself; then
        # a transfer may still be running and use dir_fd, so the descriptors stay open (closing
        # them could let a new file take the number and a late transfer write into it).
        on_own_thread = threading.current_thread().name.startswith(THREAD_PREFIX)
        for executor in self.executors:
            executor.shutdown(wait=not on_own_thread, cancel_futures=True)
        self.remove_files()
        if on_own_thread:
            return
        for fd in (self.dir_fd, self.root_fd, self.lock_fd):  # the lock is released last
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def remove_files(self) -> None:
        """Unlink the swap files, the lock and the directory; runs once.

        Safe in a signal handler: takes no lock and joins no thread. Only names this swapper
        created are removed; anything else found in the directory is left, with a warning.
        """
        if self.removed or os.getpid() != self.owner_pid:
            return
        self.removed = True
        try:
            self._remove_files()
        finally:
            self.removal_done = True

    def _remove_files(self) -> None:
        # First the directory takes the name ``.<name>.pid<pid>@<host>`` (see :func:`claimed_name`), so that
        # at every moment until it is gone either its lock or its name says whose it is: a process killed
        # between unlinking the lock and removing the directory leaves a name a launcher can still prove.
        name = self._claim()
        for entry in [*sorted(self.files), *([_LOCK_NAME] if self.lock_fd is not None else [])]:
            try:
                os.unlink(entry, dir_fd=self.dir_fd)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("could not remove swap file %s: %s", self.directory / entry, e)
        self.files.clear()
        if name is None:
            return
        try:
            os.rmdir(name, dir_fd=self.root_fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove swap directory %s: %s", self.root / name, e)

    def _claim(self) -> Optional[str]:
        """Rename the directory to its claimed name; return the name it has now, or None when the name
        ``self.name`` is no longer this directory (moved or replaced: it is left alone)."""
        try:
            here = os.stat(self.name, dir_fd=self.root_fd, follow_symlinks=False)
            ours = os.fstat(self.dir_fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("could not remove swap directory %s: %s", self.directory, e)
            return None
        if (here.st_dev, here.st_ino) != (ours.st_dev, ours.st_ino):
            log.warning("swap directory %s was moved or replaced while in use; left it alone", self.directory)
            return None
        claimed = claimed_name(self.name, self.owner_pid)
        try:
            os.rename(self.name, claimed, src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)
        except OSError:
            return self.name  # removed under its own name, as before
        return claimed


def _host_tag() -> str:
    return f"{zlib.crc32(os.uname().nodename.encode()):08x}"


def claimed_name(name: str, pid: int) -> str:
    """The name a swap directory ``name`` takes while its owner ``pid`` removes it."""
    return f".{name}.pid{pid}@{_host_tag()}"


def directory_stem(prefix: str, rank: int) -> str:
    return f"{prefix}_rank{rank:05d}_"


def create_private_directory(root: Path, prefix: str, rank: int) -> Resources:
    """Create ``<root>/<prefix>_rank<rank:05d>_<random>`` (0700, exclusively) and lock it."""
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise RuntimeError(
            f"NvmeSwapper: cannot open nvme_path={str(root)!r} ({e}); set nvme_path to a directory "
            "this process can read and write"
        ) from e
    stem = directory_stem(prefix, rank)
    made = False
    try:
        for _ in range(100):
            name = stem + secrets.token_hex(4)
            try:
                os.mkdir(name, 0o700, dir_fd=root_fd)  # fails if anything, a symlink too, has the name
                made = True
                break
            except FileExistsError:
                continue
        else:
            raise RuntimeError(
                f"NvmeSwapper: found no unused name {stem}<random> in nvme_path={str(root)!r} after 100 "
                "tries; remove old swap directories from it"
            )
        dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
        owner = os.fstat(dir_fd).st_uid
        if owner != os.geteuid():
            os.close(dir_fd)
            raise RuntimeError(
                f"NvmeSwapper: {root / name} was replaced by a directory of uid {owner} right after this "
                "process created it; set nvme_path to a directory that only you can write to"
            )
        os.fchmod(dir_fd, 0o700)  # whatever the umask took away
    except OSError as e:
        if made:  # made, but not usable: take the empty directory back (fails harmlessly otherwise)
            try:
                os.rmdir(name, dir_fd=root_fd)
            except OSError:
                pass
        os.close(root_fd)
        raise RuntimeError(
            f"NvmeSwapper: cannot create a swap directory in nvme_path={str(root)!r} ({e}); make "
            "nvme_path writable or set it to a writable directory"
        ) from e
    except BaseException:
        os.close(root_fd)
        raise
    resources = Resources(root, name, root_fd, dir_fd)
    try:
        resources.lock_fd = _lock_directory(resources)
    except BaseException:
        resources.cleanup()
        raise
    return resources


_warned_no_locks = False


def _lock_directory(resources: Resources) -> int:
    """Create ``.lock`` holding ``<pid> <host>`` and ``flock`` it for the swapper's lifetime.

    The lock is what tells a live swapper's directory from a crashed run's (see
    :func:`report_leftovers`). A filesystem without ``flock`` gets a warning, not an error.
    """
    global _warned_no_locks
    path = resources.directory / _LOCK_NAME
    try:
        fd = os.open(_LOCK_NAME, os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_RDWR, 0o600, dir_fd=resources.dir_fd)
    except OSError as e:
        raise RuntimeError(f"NvmeSwapper: cannot create the lock file {path} ({e}); make nvme_path writable") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while another process is checking it
    except OSError as e:
        if e.errno not in _NO_LOCKS_ERRNOS:
            os.close(fd)
            raise RuntimeError(f"NvmeSwapper: cannot lock {path}: {e}") from e
        if not _warned_no_locks:
            _warned_no_locks = True
            log.warning("cannot flock %s (%s): swap directories of live runs cannot be told from leftovers", path, e)
    try:
        os.write(fd, f"{os.getpid()} {os.uname().nodename}\n".encode())
    except OSError as e:
        os.close(fd)
        raise RuntimeError(f"NvmeSwapper: cannot write the lock file {path} ({e}); is the disk full?") from e
    return fd


def report_leftovers(resources: Resources, stem: str, everyone: bool = False) -> None:
    """Warn once about each directory ``<stem>*`` (``everyone``: each swap directory of any prefix and
    rank, so that rank 0 names every leftover of a killed job) that a dead process on this host left
    behind."""
    try:
        names = sorted(
            n
            for n in os.listdir(resources.root_fd)
            if n != resources.name
            and (
                n.startswith(stem)
                or n.startswith("." + stem)
                and _CLAIMED.match(n)
                or everyone
                and (_SWAP_DIRECTORY.match(n) or _CLAIMED.match(n))
            )
        )
    except OSError:
        return
    for name in names:
        path = resources.root / name
        if str(path) in _reported_leftovers:
            continue
        pid = _dead_owner(resources.root_fd, name)
        if pid is not None:
            _reported_leftovers.add(str(path))
            log.warning(
                "NvmeSwapper: %s was left behind by pid %d on this host, which is gone (killed?); it is not "
                "removed automatically: delete it once you are sure no job uses it",
                path,
                pid,
            )


def remove_directories_of(root: PathLike, pids: Iterable[int]) -> list[Path]:
    """Remove the swap directories in ``root`` that processes ``pids`` made and left behind: a launcher
    calls it for the ranks it started once they are dead (killed: nothing else cleans up after them).
    Only a directory of this user whose lock is free and names one of ``pids`` on this host, which no
    longer runs, is removed, with the files a swapper makes in it (``*.swp``, the probe, the lock);
    returns what was removed."""
    wanted = {int(p) for p in pids}
    removed: list[Path] = []
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return removed
    try:
        for name in sorted(os.listdir(root_fd)):
            if not (_SWAP_DIRECTORY.match(name) or _CLAIMED.match(name)) or _dead_owner(root_fd, name) not in wanted:
                continue
            try:
                dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
            except OSError:
                continue
            try:
                for entry in os.listdir(dir_fd):
                    if entry.endswith(".swp") or entry in (_LOCK_NAME, PROBE_NAME):
                        try:
                            os.unlink(entry, dir_fd=dir_fd)
                        except OSError:
                            pass
            finally:
                os.close(dir_fd)
            try:
                os.rmdir(name, dir_fd=root_fd)
                removed.append(Path(root) / name)
            except OSError as e:
                log.warning("could not remove swap directory %s of a dead rank: %s", Path(root) / name, e)
    finally:
        os.close(root_fd)
    return removed


def _dead_owner(root_fd: int, name: str) -> Optional[int]:
    """The pid that created the swap directory ``name`` if it provably left it behind: a directory
    of this user (not a symlink) whose lock is free (or, under a claimed name, gone) and whose pid no
    longer runs on this host. ``None`` at any doubt."""
    dir_fd = lock_fd = -1
    try:
        dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
        if os.fstat(dir_fd).st_uid != os.geteuid():
            return None
        try:
            lock_fd = os.open(_LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            # No lock: only a claimed name (its owner was killed after unlinking the lock) still says whose.
            claimed = _CLAIMED.match(name)
            if claimed is None or claimed.group(2) != _host_tag():
                return None
            pid = int(claimed.group(1))
        else:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # its swapper is alive
            fields = os.read(lock_fd, 256).decode("utf-8", "replace").split()
            if len(fields) != 2 or not fields[0].isdigit() or fields[1] != os.uname().nodename:
                return None
            pid = int(fields[0])
        if pid == os.getpid():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        return None  # alive (or not ours to signal): maybe the pid was reused, maybe not
    except OSError:
        return None
    finally:
        for fd in (lock_fd, dir_fd):
            if fd >= 0:
                os.close(fd)


def directory_problem(root: Path) -> Optional[str]:
    """Why ``root`` cannot hold swap files, as the end of a sentence naming it; None if it can.

    A write probe rather than permission bits: a read-only mount refuses root too, and root passes
    every permission check."""
    if not root.exists():
        return "does not exist; create it or set nvme_path to an existing directory on a fast local disk"
    if not root.is_dir():
        return "is not a directory; set nvme_path to a directory on a fast local disk"
    try:
        fd, probe = tempfile.mkstemp(prefix=".zeroq-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        return (
            f"is not writable by this process ({err.strerror}); fix its permissions or set nvme_path to a "
            "writable directory"
        )
    return None


def check_directory(root: Path) -> Path:
    problem = directory_problem(root)
    if problem is not None:
        raise RuntimeError(f"NvmeSwapper: nvme_path={str(root)!r} {problem}")
    return root


def create_file(resources: Resources, region: Region, when_full: str) -> None:
    """Create ``region``'s file in the private directory, preallocated; ``when_full`` is the error when
    the disk has no room for it."""
    files = resources.files
    # Exclusive creation: a name taken by anything (a planted symlink included) is an error and
    # stays untouched. A file of ours from an earlier, failed reserve() is reused.
    flags = os.O_RDWR | os.O_NOFOLLOW | (0 if region.name in files else os.O_CREAT | os.O_EXCL)
    try:
        fd = os.open(region.name, flags, 0o600, dir_fd=resources.dir_fd)
    except FileExistsError as e:
        raise RuntimeError(
            f"NvmeSwapper: cannot create swap file {region.path}: something this swapper did not "
            "create is already there (left untouched); check what else writes to nvme_path"
        ) from e
    except OSError as e:
        raise RuntimeError(
            f"NvmeSwapper: cannot create swap file {region.path} ({e}); make nvme_path writable "
            "or set it to a writable directory"
        ) from e
    files.add(region.name)
    try:
        if region.file_bytes:
            _preallocate(fd, region.file_bytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RuntimeError(when_full) from e
        raise RuntimeError(f"NvmeSwapper: cannot preallocate swap file {region.path}: {e}") from e
    finally:
        os.close(fd)


def _preallocate(fd: int, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # no fallocate on this filesystem: a sparse file, space checked above
