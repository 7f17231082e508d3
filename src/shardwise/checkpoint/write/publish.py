"""Publishing a finished checkpoint directory atomically, recovering an interrupted publish, and
removing what interrupted saves left behind.

Note [atomic publish]: a new NAME is one rename(2) of `.NAME.partial` to NAME. A save over an
existing NAME swaps the two directories in one step with renameat2(RENAME_EXCHANGE) (Linux
3.15+: ext4, xfs, btrfs, tmpfs; called through ctypes), then removes the previous checkpoint,
swapped out to `.NAME.partial`: at every instant NAME is a whole checkpoint, the old one or the
new one. Where the filesystem cannot exchange (EINVAL: NFS, some FUSE filesystems; or no
renameat2 at all: not Linux), NAME is renamed to `.NAME.old` and the partial to NAME; a kill
between the two leaves no NAME, only two whole hidden directories, and `sw.latest` recovers:
it renames the newer whole one (index digest checked, every file there at its size) back to
NAME.

Note [leftovers]: a save killed mid-way leaves `.NAME.partial` (and on the fallback path
`.NAME.old`), which nothing loads. After each successful save, rank 0 removes every such hidden
directory beside it that is shardwise's and whose save is provably dead (Note [save ownership]
in owner.py): never a directory shardwise did not make (`~/.ssh.old`), never another job's save
still running, and not a whole checkpoint `sw.latest` may still put back under its name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
from pathlib import Path

from shardwise.checkpoint.format.schema import read_index
from shardwise.checkpoint.write.owner import remove_if_dead
from shardwise.errors import ShardwiseError

_LEFTOVER = re.compile(r"\.(.+)\.(partial|old)")
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _find_renameat2():
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return function


_renameat2 = _find_renameat2()  # None where the C library lacks it (tests set None to take the fallback)


def hidden(path: Path, kind: str) -> Path:
    """`.NAME.partial` or `.NAME.old` beside checkpoint `path`."""
    return path.parent / f".{path.name}.{kind}"


def publish(partial: Path, path: Path, durable: bool) -> None:
    """Make finished directory `partial` the checkpoint `path` (Note [atomic publish]), the rename on the disk
    when `durable`."""
    _rename_into_place(partial, path)
    fsync_dir(path.parent, durable)


def fsync_dir(path: Path, durable: bool) -> None:
    """Make `path`'s entries durable (tests/helpers/restart_job.py kills a save here)."""
    if durable:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _rename_into_place(partial: Path, path: Path) -> None:
    made = _identity(partial)  # the directory itself, whatever name it has by the end
    if not os.path.lexists(path):
        os.rename(partial, path)
        return
    if _exchange(partial, path):
        shutil.rmtree(partial, ignore_errors=True)  # the previous checkpoint, swapped out
        return
    old = hidden(path, "old")
    if not remove_if_dead(old):
        raise ShardwiseError(f"{old} is in the way of publishing {path} and is not a dead save's leftover "
                             "(Note [save ownership]): refusing to remove it. Move it away or save elsewhere.")
    os.rename(path, old)
    try:
        os.rename(partial, path)
    except FileNotFoundError:
        if _identity(path) != made:  # else a sw.latest elsewhere recovered it for us
            raise
    shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap directories `a` and `b` atomically; False where the filesystem or the platform cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _identity(path: Path) -> tuple[int, int] | None:
    """Which directory `path` names now (device, inode), or None: a rename keeps it."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _whole(path: Path):
    """`path`'s index when it is a whole checkpoint (index checked, every file present at its size), else None."""
    try:
        index = read_index(path)
        for name, entry in index.files.items():
            info = os.lstat(path / name)
            if not os.path.isfile(path / name) or os.path.islink(path / name) or info.st_size != entry.nbytes:
                return None
        return index
    except (ShardwiseError, OSError):
        return None


def recover_interrupted(directory: Path) -> None:
    """Put back a checkpoint a save over the same name left hidden (Note [atomic publish])."""
    for child in sorted(directory.iterdir()) if directory.is_dir() else ():
        match = _LEFTOVER.fullmatch(child.name)
        if not match or match.group(2) != "old" or os.path.lexists(directory / match.group(1)):
            continue
        path = directory / match.group(1)
        candidates = [(index.newness, hidden_dir) for hidden_dir in (hidden(path, "partial"), child)
                      if (index := _whole(hidden_dir)) is not None]
        if candidates:
            try:
                os.rename(max(candidates)[1], path)
            except OSError:
                pass  # another rank's sw.latest got there first


def clean_leftovers(directory: Path) -> None:
    """Remove dead saves' hidden directories beside a checkpoint (Note [leftovers])."""
    for child in directory.iterdir():
        match = _LEFTOVER.fullmatch(child.name)
        if not match:
            continue
        name, kind = match.groups()
        # A whole checkpoint hidden by a fallback publish cut between its renames is sw.latest's to put back.
        pending = not os.path.lexists(directory / name) and (
            kind == "old" or os.path.lexists(directory / f".{name}.old"))
        # An empty .NAME.partial is a save killed between its mkdir and its mark: rmdir removes only that.
        remove_if_dead(child, keep_whole=pending, empty_ok=kind == "partial")
