"""Matplotlib figures drawn off-screen (the Agg canvas, never pyplot: no display, no global figure state)
and written whole or not at all."""
from __future__ import annotations

import os

import numpy as np


def new_figure(width: float, height: float, dpi: int = 100):
    """A matplotlib ``Figure`` on an Agg canvas, independent of pyplot's figure manager."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def figure_to_array(fig) -> np.ndarray:
    """The rendered figure as an ``[H, W, 3]`` uint8 array (what TensorBoard's ``add_image`` takes)."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def save_figure(fig, path: str, dpi: int | None = None) -> str:
    """Writes ``fig`` as a PNG to ``path`` atomically: a temporary file beside it, then a rename, so a
    reader (or a crash mid-write) never sees half an image."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.partial")
    try:
        with open(partial, "wb") as f:
            fig.savefig(f, format="png", dpi=dpi)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path
