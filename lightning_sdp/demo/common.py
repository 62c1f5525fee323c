"""Helpers shared by the demo's parts: quiet Lightning output, the Trainer settings and one bar chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def quiet_lightning() -> None:
    """Keep Lightning's info lines (GPU available, model summary) out of the tour's output."""
    import logging
    import warnings

    import lightning.pytorch  # noqa: F401  (sets its loggers' levels on import; override them after)

    for name in ("lightning.pytorch", "lightning.fabric", "lightning_sdp"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=r".*barebones.*")


def trainer_kwargs() -> dict[str, Any]:
    """The Trainer settings every part shares: no logger, checkpoints, summary or sanity check; a progress bar."""
    return dict(
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        enable_progress_bar=True,
    )


def bar_plot(path: Path, labels: list[str], values: list[float], ylabel: str, title: str) -> Path:
    """One bar chart with the values written on the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    bars = ax.bar(labels, values, color=["#9e9e9e", "#1f77b4", "#ff7f0e", "#2ca02c"][: len(values)])
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(f"{value:,.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
