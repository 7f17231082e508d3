"""A save: each rank's rows into its own file, rank 0's index, the directory published whole or not at all.

Read in this order: save.py (`sw.save`: the job, Note [atomic save]) → writer.py (one rank's file) →
disk.py (phases and early writeback) → commit.py (every file durable, the index written: Note [one wait
for the disk]) → index.py (what index.json records, which checkpoint is newest) → owner.py and
publish.py (a save's directories its own; the atomic rename) → background.py (`sw.save_async`).
"""
