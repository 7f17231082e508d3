"""Which save owns a hidden `.NAME.partial`, and when a hidden directory may be removed.

Note [save ownership]: a save's rank 0 creates `.NAME.partial` with mkdir (never over an
existing one), takes an exclusive flock(2) on the directory itself and writes MARKER into it
(the save's id, pid and host). It holds the lock until the save has published or failed;
the kernel drops it when the process dies, however it dies. So a hidden directory is a leftover
of a dead save exactly when it carries shardwise's mark (MARKER, or an index.json that parses
as a shardwise index: a checkpoint a save over its own name swapped out) and its lock can be
taken. A second save to the same name while the first runs finds the lock held and refuses,
naming the owner; it never deletes what it did not make. A hidden directory without the mark
(`~/.ssh.old`) is never removed; an empty `.NAME.partial` (a save killed between its mkdir and
its mark) is removed with rmdir, which cannot remove anything else. Where the filesystem
refuses flock (some network filesystems), nothing hidden is ever judged dead: a save to a
name whose `.NAME.partial` is left refuses, and the error says to remove it by hand.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import stat
import time
from pathlib import Path

from shardwise.checkpoint.format.schema import read_index
from shardwise.errors import ShardwiseError

MARKER = ".shardwise-save"  # inside a `.NAME.partial` while its save runs


class SaveLock:
    """Rank 0's hold on the `.NAME.partial` it created (Note [save ownership])."""

    def __init__(self, directory: Path, fd: int, checkpoint_id: str):
        self.directory, self.fd, self.checkpoint_id = directory, fd, checkpoint_id

    def check(self) -> None:
        """Raise unless `directory` is still the one this save created and marked (nobody removed
        or replaced it while the ranks wrote)."""
        try:
            same = os.fstat(self.fd).st_ino == os.lstat(self.directory).st_ino
            marked = same and _read_marker(self.directory).get("id") == self.checkpoint_id
        except OSError:
            same = marked = False
        if not marked:
            raise ShardwiseError(f"{self.directory} was removed or replaced by another process while this save "
                                 "wrote into it; nothing was published")

    def unmark(self) -> None:
        """Remove MARKER before the directory becomes the checkpoint (index.json marks it from then on)."""
        (self.directory / MARKER).unlink(missing_ok=True)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def claim_partial(partial: Path, checkpoint_id: str) -> SaveLock:
    """Create `partial`, lock it and mark it as this save's; a ShardwiseError when another save owns
    it or it is not shardwise's (Note [save ownership])."""
    if os.path.lexists(partial):
        if not remove_if_dead(partial, empty_ok=True):
            owner = _read_marker(partial) if partial.is_dir() and not partial.is_symlink() else {}
            who = f" (pid {owner.get('pid')} on {owner.get('host')!s:.64})" if owner else ""
            raise ShardwiseError(
                f"{partial} belongs to another save to the same name that is still running{who}, or is not "
                "shardwise's: refusing to touch it. Wait for that save, or save under another name; if no save "
                "is running (a filesystem without flock), remove it by hand.")
    try:
        os.mkdir(partial)
    except FileExistsError:
        raise ShardwiseError(f"another save to the same name created {partial} just now; not sharing it") from None
    fd = os.open(partial, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    lock = SaveLock(partial, fd, checkpoint_id)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ShardwiseError(f"another save took {partial} as this one created it; refusing to share it") from None
        except OSError:
            pass  # no flock here: the mark still keeps others' hands off (Note [save ownership])
        marker = os.open(partial / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(marker, "w") as f:
            json.dump({"id": checkpoint_id, "pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.time()}, f)
        lock.check()
    except BaseException:
        lock.release()
        raise
    return lock


def remove_if_dead(directory: Path, *, empty_ok: bool = False, keep_whole: bool = False) -> bool:
    """Remove hidden `directory` when it is shardwise's and its save is provably dead (Note [save
    ownership]); True when it is gone. `keep_whole`: keep a whole checkpoint (sw.latest may recover it)."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(info.st_mode):
        return False
    if empty_ok:
        try:
            os.rmdir(directory)  # only ever removes an empty directory
            return True
        except OSError:
            pass
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a running save holds it, or liveness cannot be proven here
        if os.fstat(fd).st_ino != info.st_ino:
            return False
        if not _has_marker(directory):
            try:
                read_index(directory)  # a checkpoint a save over its own name swapped out
            except ShardwiseError:
                return False  # not shardwise's
            if keep_whole:
                return False
        shutil.rmtree(directory, ignore_errors=True)
        return not os.path.lexists(directory)
    finally:
        os.close(fd)


def _read_marker(directory: Path) -> dict:
    """The MARKER of `directory` ({} when there is none or it is not shardwise's)."""
    try:
        fd = os.open(directory / MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return {}
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        value = json.loads(os.read(fd, 4096) or b"{}")
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)
    return value if isinstance(value, dict) and isinstance(value.get("id"), str) else {}


def _has_marker(directory: Path) -> bool:
    """MARKER is there as a regular file (even empty: a save killed as it wrote it)."""
    try:
        return stat.S_ISREG(os.lstat(directory / MARKER).st_mode)
    except OSError:
        return False
