"""Small PNG figures for asset metadata (rendered off-screen with matplotlib's Agg)."""

from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _png(fig: plt.Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def resolution_histogram(
    widths: np.ndarray, heights: np.ndarray, min_side: int, title: str
) -> bytes:
    """Short side and aspect histograms plus a width/height scatter, as one PNG."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    short = np.minimum(widths, heights)
    axes[0].hist(short, bins=30, color="#4063d8")
    axes[0].axvline(min_side, color="#cb3c33", linestyle="--", label=f"cutoff {min_side}px")
    axes[0].set_xlabel("short side (px)")
    axes[0].set_ylabel("images")
    axes[0].legend(fontsize=8)
    aspect = np.where(heights > 0, widths / np.maximum(heights, 1), 0)
    axes[1].hist(np.log2(np.clip(aspect, 1 / 8, 8)), bins=30, color="#389826")
    for edge in (-1, 1):
        axes[1].axvline(edge, color="#cb3c33", linestyle="--")
    axes[1].set_xlabel("log2(aspect w/h); buckets cover -1..1")
    axes[2].scatter(widths, heights, s=6, alpha=0.6, color="#9558b2")
    axes[2].set_xlabel("width (px)")
    axes[2].set_ylabel("height (px)")
    fig.suptitle(title, fontsize=10)
    return _png(fig)


def bar_chart(labels: list[str], values: list[float], title: str, xlabel: str = "") -> bytes:
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(labels) + 2), 3))
    ax.bar(range(len(labels)), values, color="#4063d8")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    return _png(fig)
