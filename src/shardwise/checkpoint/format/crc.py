"""crc32, as fast as this machine computes it.

Note [fast crc32]: every byte a checkpoint saves or loads goes through crc32 (Note [chunk checksums]
in files.py), and zlib's, without the CPU's carry-less multiply, runs at about 1.5 GB/s: on a quiet
host a save's checksums took as long as a quarter of its disk time, and a warm load's most of its
time. ISA-L's crc32 (the `isal` package, `pip install shardwise[fast]`) computes the same function
(zlib's polynomial, the same running value: files written with either read with the other) about ten
times faster. `crc32` is ISA-L's when it is installed, else zlib's.
"""

from __future__ import annotations

import zlib

try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # not installed: zlib's, slower, same values
    _isal_crc32 = None

crc32 = _isal_crc32 if _isal_crc32 is not None else zlib.crc32
FAST = _isal_crc32 is not None
