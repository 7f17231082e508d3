"""Plot set-up shared by the bench scripts: matplotlib without a display, and the figure's last steps."""

from __future__ import annotations

from pathlib import Path


def panels(rows: int = 1, cols: int = 2, height: float = 4.5):
    """A figure of `rows` x `cols` panels, 6 x `height` inches each, drawn without a display: (fig, axes), axes
    a `rows` x `cols` array (one row of two unpacks as `fig, ((left, right),) = panels()`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=(6 * cols, height * rows), squeeze=False)


def save(fig, path: Path, title: str) -> None:
    """Title, tight layout, written at the bench's resolution."""
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
