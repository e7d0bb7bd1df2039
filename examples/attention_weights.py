"""Visualise one query's neighborhood-attention weights on an image (unfused API: ``ops.na2d_qk``).

Features are the 5x5 colour patches of skimage's astronaut photo (projected to 16 dims), used as both
query and key; the figure shows where one pixel's attention goes for a plain 2-D neighborhood and a
dilated one.  Fused kernels never expose these weights; ``na2d_qk`` returns them as
``[B, H, W, heads, prod(kernel_size)]`` in window-slot order, and ``ops.window.neighbor_table`` says
which pixel each slot is.

    python examples/attention_weights.py --out attention_weights.png [--query 20 30] [--random]
"""
from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ops  # noqa: E402
from ops.functional import make_params  # noqa: E402
from ops.window import neighbor_table  # noqa: E402


def image_features(size: int, dim: int, use_random: bool, seed: int = 0):
    """(image [size, size, 3] in [0, 1], features [1, size, size, 1, dim]) for a sample photo."""
    gen = torch.Generator().manual_seed(seed)
    if use_random:
        img = torch.rand(size, size, 3, generator=gen)
    else:
        from skimage import data, transform

        img = torch.from_numpy(transform.resize(data.astronaut(), (size, size), anti_aliasing=True)).float()
    patches = F.unfold(img.permute(2, 0, 1)[None], kernel_size=5, padding=2)  # [1, 75, size*size]
    patches = patches - patches.mean(dim=1, keepdim=True)
    proj = torch.randn(patches.shape[1], dim, generator=gen) / patches.shape[1] ** 0.5
    feats = (patches[0].T @ proj).reshape(1, size, size, 1, dim)
    return img, F.normalize(feats, dim=-1) * 2.0  # logits in [-4, 4]: a soft, readable softmax


def query_heatmap(feats, query, kernel_size, dilation):
    """Attention weights of one query pixel, placed on the image grid (zeros outside its window)."""
    size = feats.shape[1]
    logits = ops.na2d_qk(feats, feats, kernel_size, dilation=dilation)  # [1, size, size, 1, K*K]
    attn = logits.softmax(dim=-1)
    params = make_params((size, size), kernel_size, 1, dilation, False)
    flat = query[0] * size + query[1]
    keys, valid, _ = neighbor_table(params, queries=torch.tensor([flat]))
    heat = torch.zeros(size * size)
    heat[keys[0][valid[0]]] = attn[0, query[0], query[1], 0][valid[0]]
    return heat.reshape(size, size)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention_weights.png")
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--query", type=int, nargs=2, default=(24, 44), help="row col of the query pixel")
    parser.add_argument("--kernel-size", type=int, default=13)
    parser.add_argument("--random", action="store_true", help="random image instead of the sample photo")
    args = parser.parse_args()
    img, feats = image_features(args.size, 16, args.random)
    panels = [("image", None)] + [(f"K={args.kernel_size}, dilation={d}", d) for d in (1, 3)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4))
    for ax, (title, dilation) in zip(axes, panels):
        ax.imshow(img.numpy())
        if dilation is not None:
            heat = query_heatmap(feats, tuple(args.query), args.kernel_size, dilation).numpy()
            # Only the window's pixels are drawn (zero weight = outside the neighborhood: transparent).
            ax.imshow(img.numpy() * 0.35)
            shown = ax.imshow(np.ma.masked_where(heat == 0, heat), cmap="inferno", vmin=0, vmax=heat.max())
            fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04)
        ax.plot(args.query[1], args.query[0], "c+", markersize=12)
        ax.set_title(title)
        ax.axis("off")
    fig.suptitle(f"neighborhood attention weights of pixel {tuple(args.query)}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
