"""The end of a save: every rank's file made durable, rank 0's index written and synced, the
directory published (Note [atomic save] in save.py).

Note [one wait for the disk]: each fsync of a file or a directory waits for a journal commit and a
disk cache flush (about 4 to 8 ms each on the ext4 disk bench/checkpoints/checkpoint.py ran on). The save used
to pay them one after the other: every rank's file fsync, then rank 0's index fsync, then the partial
directory's fsync, then the rename and the parent directory's fsync. What a crash may not reorder
is only this: every file's bytes (the rank files, index.json) and the partial directory's entries
on the disk before the rename, and the rename on the disk before the save returns. So the ranks
send their records (crcs, sizes) as soon as their bytes are written, before their fsync; rank 0
writes index.json and starts syncing it and the partial directory in a thread (`start_commit`),
while every rank, rank 0 included, fsyncs its own file (`sync_rank_file`); the ranks then report
their fsync, and only when every one succeeded and the thread finished does rank 0 rename and sync
the parent (`finish_commit`). The index's and the directory's flushes overlap the rank files'
instead of following them; the order the disk sees is unchanged (tests/test_checkpoint_publish.py
checks every fsync happens before the rename, and the parent's after it).
"""

from __future__ import annotations

import json
import os
import shutil
import threading

from shardwise.checkpoint.write.index import INDEX, build_index, log, remove_older
from shardwise.checkpoint.write.publish import clean_leftovers, fsync_dir, publish
from shardwise.errors import ShardwiseError

SHARED_MARKER = ".shardwise-shared"  # Note [one shared directory] in save.py


class IndexSync:
    """Rank 0's index.json, written, and its fsync and the partial directory's running in a thread
    (Note [one wait for the disk])."""

    def __init__(self, job, fd: int) -> None:
        self.job, self.error = job, None
        self._thread = threading.Thread(target=self._run, args=(fd,), name=f"shardwise index {job.path.name}")
        self._thread.start()

    def _run(self, fd: int) -> None:
        try:
            try:
                if self.job.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            self.job.lock.unmark()  # index.json, on the disk, marks it from here on (Note [save ownership])
            fsync_dir(self.job.partial, self.job.durable)
        except Exception as error:  # noqa: BLE001 - reported by finish_commit
            self.error = f"{type(error).__name__}: {error}"

    def wait(self) -> str | None:
        self._thread.join()
        return self.error


def start_commit(job, records: list) -> IndexSync | str:
    """Rank 0, once every rank's file is written: check them, write index.json and start its sync; or
    why the save failed. Never raises: every rank waits for rank 0 at the next gather."""
    failed = [(r, error) for r, (_, error) in enumerate(records) if error is not None]
    if failed:
        return "; ".join(f"rank {r} could not write its file: {error}" for r, error in failed)
    partial = job.partial
    try:
        job.lock.check()  # still the directory this save made: nobody removed or replaced it
        for record, _ in records:
            written = partial / record["file"]
            if not written.is_file() or written.stat().st_size != record["bytes"]:
                return f"{written} is missing or not the size its rank wrote: another process changed {partial}"
        (partial / SHARED_MARKER).unlink()  # every rank saw it (Note [one shared directory]); never published
        encoded = json.dumps(build_index(job, records), separators=(",", ":")).encode()
        fd = os.open(partial / INDEX, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            view = memoryview(encoded)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            raise
        return IndexSync(job, fd)
    except Exception as error:  # noqa: BLE001 - reported on every rank by the caller
        return f"{type(error).__name__}: {error}"


def finish_commit(job, started: IndexSync | str, synced: list) -> str | None:
    """Rank 0, once every rank reported its file's fsync (`synced`: each rank's error or None): publish
    the directory and sync its parent (Note [one wait for the disk]), or clean up; None on success."""
    outcome = started if isinstance(started, str) else None
    if isinstance(started, IndexSync):  # joined whatever happened: its fd and the marker are its own
        outcome = started.wait()
    failed = [(r, error) for r, error in enumerate(synced) if error is not None]
    if outcome is None and failed:
        outcome = "; ".join(f"rank {r} could not write its file to the disk: {error}" for r, error in failed)
    if outcome is None:
        try:
            publish(job.partial, job.path, job.durable)  # Note [atomic publish]
        except Exception as error:  # noqa: BLE001 - reported on every rank by the caller
            outcome = f"{type(error).__name__}: {error}"
    if outcome is not None:  # a failed save removes its partial directory, if it is still the one it made
        try:
            job.lock.check()
        except ShardwiseError:
            return outcome  # another process's now, or already published: not this save's to remove
        shutil.rmtree(job.partial, ignore_errors=True)
        return outcome
    _sweep(job)
    return None


def _sweep(job) -> None:
    """Rank 0, once the checkpoint is published: `keep_last`'s older checkpoints and dead saves' leftovers
    removed (Note [leftovers]). Note [sweep after publish]: a failure here (a leftover that cannot be removed, a
    directory that cannot be read) is a warning, never the save's error: the checkpoint is on the disk under its
    name, and an error saying "nothing was written" would be false; it also must not leave rank 0 without its
    answer to the other ranks, which wait for it in `broadcast_object` (an exception here was a hang there). The
    next save sweeps again."""
    try:
        if job.keep_last is not None:
            remove_older(job.path, job.keep_last)
        clean_leftovers(job.path.parent)
    except Exception as error:  # noqa: BLE001 - Note [sweep after publish]
        log.warning("sw.save: %s is saved, but the sweep after it failed (%s: %s); older checkpoints or dead saves' "
                    "leftovers beside it may remain, and the next save tries again", job.path, type(error).__name__,
                    error)


