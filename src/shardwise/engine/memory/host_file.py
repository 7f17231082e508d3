"""The file of a written host copy: private while it exists, gone once mapped, swept if its job died.
Uses: nothing of the engine.

Note [host copy file]: without `HostFrozen(source=...)` the host's local rank 0 writes the
frozen weights into `HostFrozen.directory` (default /dev/shm, which every local user can
list) for the other local ranks to map (host_copy.py, Note [host copy]). So:

- It lives in a directory of its own, created with mode 0700 (`mkdir` fails if the name
  exists), and the file in it is created `O_CREAT | O_EXCL | O_NOFOLLOW` with mode 0600:
  another user sees the directory's name but cannot list it, open the file, or plant a
  file or link where it will be written.
- The name says whose it is: `shardwise-host-<pid>-<start>-<random>`, the writer's process id
  and its start time (field 22 of /proc/<pid>/stat, so a recycled pid is not taken for it).
- The writer removes it in a `finally` around the mapping handshake: after every local rank
  has mapped it, or when the handshake fails (another rank died or could not map it).
- A writer killed between writing and that `finally` (SIGKILL, OOM) leaves it behind, holding
  shared memory until reboot; so before writing, a leader sweeps the directory for such
  entries of its own user whose writer is gone. A sweep needs a next start on that host in
  that directory; between the kill and then, the copy stays.
- "Gone" is proven by a lock, not by a pid: the writer holds an flock(2) on its directory
  until it removes it, and the kernel drops the lock when the writer dies. A pid says nothing
  across pid namespaces (two containers of one user sharing /dev/shm: the other container's
  live writer has no /proc entry here), so the sweep removes a directory only when it can
  take that lock.
- The other ranks of the host learn the writer's directory by its full name, which the writer
  sends them, never by a search for the token: anyone can list /dev/shm and make a twin
  `shardwise-host-1-1-<token>` that a search would also find.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
from pathlib import Path

PREFIX = "shardwise-host-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+)-[0-9a-f]+$")


def new_token() -> str:
    """The random part of a copy's name, drawn once per `shard()` and shared by its ranks."""
    return secrets.token_hex(8)


def new_private_directory(directory: str | os.PathLike, token: str) -> Path:
    """A fresh 0700 directory under `directory` named after this process and `token` (Note [host
    copy file]), after sweeping the stale ones of dead writers."""
    sweep_stale(directory)
    pid = os.getpid()
    path = Path(directory).absolute() / f"{PREFIX}{pid}-{_start_time(pid)}-{token}"
    os.mkdir(path, 0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until remove(): the writer lives
    except OSError:
        pass  # a filesystem without flock: the sweep then never takes it for dead
    _held[path] = fd
    return path


_held: dict[Path, int] = {}  # this process's private directories and the locked descriptor of each


def create_private_file(path: Path) -> int:
    """Create `path` for writing: it must not exist, must not be a link, and only its owner may read it."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)


def remove(private_directory: Path) -> None:
    """Remove the directory and the copy in it (the ranks' mappings keep their pages)."""
    shutil.rmtree(private_directory, ignore_errors=True)
    fd = _held.pop(private_directory, None)
    if fd is not None:
        os.close(fd)


def sweep_stale(directory: str | os.PathLike) -> list[Path]:
    """Remove this user's host-copy directories in `directory` whose writer is no longer running."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed  # a directory that does not exist yet holds nothing stale
    for entry in entries:
        match = _NAME.match(entry.name)
        if not match:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _writer_is_gone(Path(entry.path)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


def _writer_is_gone(path: Path) -> bool:
    """True when nobody holds the directory's lock (Note [host copy file]): its writer died."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # held (a live writer, in any pid namespace), or no flock here: keep it
    finally:
        os.close(fd)


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (0 where /proc cannot say)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return 0
