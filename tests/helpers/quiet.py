"""What a run must not print: third-party warnings, notices and banners.

The examples (tests/test_examples.py) print only what a user needs: `assert_quiet`, no warning
and no progress bar or metrics line of a library either. The documentation's blocks
(tests/test_doc_blocks.py) show a library used as its own docs use it, so a progress bar or the
Trainer's closing metrics, which the reader asked for, may stay: `assert_no_warning`.
"""

from __future__ import annotations

import re

# What third-party libraries print unasked: warnings, deprecations, tips, start-up banners.
WARNING = (r"warn|deprecat|tip:|^\[transformers\]|^\[rank \d\]|gpu available|tpu available|initializing distributed"
           r"|distributed_backend|omp_num_threads|site-packages|removed shared tensor")
NOISE = re.compile(WARNING + r"|it/s\]|^\{'", re.I | re.M)  # ...and progress bars, the Trainer's metrics


def noisy_lines(output: str, pattern: re.Pattern = NOISE) -> list[str]:
    return [line for line in output.splitlines() if pattern.search(line)]


def assert_quiet(output: str, where: str = "the output") -> None:
    """No line of a third-party warning, notice, banner, progress bar or metrics (rank 0's own lines only)."""
    noisy = noisy_lines(output)
    assert noisy == [], f"third-party lines in {where}:\n" + "\n".join(noisy)


def assert_no_warning(output: str, where: str = "the output") -> None:
    """No line of a third-party warning, notice or banner."""
    noisy = noisy_lines(output, re.compile(WARNING, re.I | re.M))
    assert noisy == [], f"third-party warnings or notices in {where}:\n" + "\n".join(noisy)
