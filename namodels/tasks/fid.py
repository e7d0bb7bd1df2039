"""FID (and optionally KID) of a generator against real images, with torchmetrics.

The standard metric uses torch-fidelity's port of the TF Inception (2015-12-05) network; its
weights are read from a local file (``feature_extractor_weights_path``), never downloaded here:
:func:`inception_weights_path` names the file expected and raises a clear error when it is absent.
Any ``nn.Module`` mapping ``[N, 3, H, W]`` float images in ``[0, 1]`` to ``[N, d]`` features can be
used instead (tests use a small offline stand-in).
"""
from __future__ import annotations

import os
from typing import Iterable

import torch
from torch import nn
from tqdm.auto import tqdm

from namodels.data.images import to_unit_range

__all__ = ["INCEPTION_WEIGHTS_FILE", "inception_weights_path", "build_metrics", "compute_fid"]

INCEPTION_WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
INCEPTION_WEIGHTS_URL = f"https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/{INCEPTION_WEIGHTS_FILE}"


def inception_weights_path(path: str | None) -> str:
    """Resolves the Inception weights file: ``path`` may be the file or a folder holding it
    (default: ``$TORCH_HOME/hub/checkpoints``).  Raises ``ValueError`` naming the expected file."""
    if path is None:
        candidate = os.path.join(torch.hub.get_dir(), "checkpoints", INCEPTION_WEIGHTS_FILE)
    else:
        path = os.path.expanduser(str(path))
        candidate = os.path.join(path, INCEPTION_WEIGHTS_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(candidate):
        raise ValueError(
            f"inception_weights: FID needs the Inception weights file {INCEPTION_WEIGHTS_FILE!r} (torch-fidelity's "
            f"port of the TF Inception 2015-12-05 network) but {candidate!r} does not exist. Download it once from "
            f"{INCEPTION_WEIGHTS_URL} and pass its path (or its folder) as inception_weights=... (eval.py: "
            f"task.inception_weights=... or $NAMODELS_INCEPTION_WEIGHTS)"
        )
    return candidate


class _Uint8Input(nn.Module):
    """[0, 1] float images -> uint8 -> the wrapped torch-fidelity Inception (shared with FID)."""

    def __init__(self, inception: nn.Module):
        super().__init__()
        self.inception = inception
        self.num_features = 2048

    def forward(self, x):
        return self.inception((x * 255).byte())


def build_metrics(feature_extractor: nn.Module | None = None, inception_weights: str | None = None,
                  kid: bool = False, kid_subset_size: int = 1000, kid_subsets: int = 100) -> dict:
    """``{"fid": FrechetInceptionDistance, ["kid": KernelInceptionDistance]}`` sharing one extractor.

    Inputs to ``update`` are float images in ``[0, 1]`` (``normalize=True``).
    """
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    if feature_extractor is None:
        weights = inception_weights_path(inception_weights)
        try:
            import torch_fidelity  # noqa: F401
        except ImportError as err:
            raise ValueError("inception_weights: the Inception feature extractor needs torch-fidelity "
                             "(pip install -e '.[fid]', or pip install torch-fidelity)") from err
        fid = FrechetInceptionDistance(feature=2048, normalize=True, reset_real_features=False,
                                       feature_extractor_weights_path=weights)
        feature = _Uint8Input(fid.inception)  # KID sees a "custom" module: feed it what Inception expects
    else:
        fid = FrechetInceptionDistance(feature=feature_extractor, normalize=True, reset_real_features=False)
        feature = feature_extractor
    metrics = {"fid": fid}
    if kid:
        metrics["kid"] = KernelInceptionDistance(feature=feature, normalize=True, reset_real_features=False,
                                                 subset_size=kid_subset_size, subsets=kid_subsets)
    return metrics


def _real_total(real_images, num_real: int | None) -> int | None:
    """How many real images the loop will read, where known (for the progress bar)."""
    dataset = getattr(real_images, "dataset", None)
    try:
        available = len(dataset) if dataset is not None else None
    except TypeError:  # an iterable dataset
        available = None
    if num_real is None:
        return available
    return num_real if available is None else min(num_real, available)


@torch.no_grad()
def compute_fid(generator, real_images: Iterable, num_fake: int = 50000, num_real: int | None = None,
                batch_size: int = 32, truncation: float = 1.0, seed: int = 0,
                feature_extractor: nn.Module | None = None, inception_weights: str | None = None,
                kid: bool = False, kid_subset_size: int = 1000, device=None, progress: bool = False) -> dict:
    """FID (and KID) between ``num_fake`` generated images (seeds ``seed ..``) and real images.

    Args:
        generator: a :class:`~namodels.models.stylenat.StyleNATGenerator` (eval mode is set).
        real_images: iterable of real batches ``[B, 3, H, W]`` in ``[-1, 1]`` (or ``(images, ...)``
            tuples), e.g. ``GANDataModule.real_dataloader()``; read up to ``num_real`` images.
        feature_extractor: optional stand-in for Inception (see module doc).
        progress: progress bars over the real and the generated images.
    Returns ``{"fid", "num_real", "num_fake"[, "kid_mean", "kid_std"]}``.
    """
    device = device or next(generator.parameters()).device
    kid_size = min(kid_subset_size, num_fake) if kid else kid_subset_size
    metrics = build_metrics(feature_extractor, inception_weights, kid, kid_size)
    metrics = {k: m.to(device) for k, m in metrics.items()}
    seen_real = 0
    with tqdm(total=_real_total(real_images, num_real), desc="FID real", unit="img", disable=not progress) as bar:
        for batch in real_images:
            imgs = batch[0] if isinstance(batch, (list, tuple)) else batch
            if num_real is not None:
                imgs = imgs[: num_real - seen_real]
            for m in metrics.values():
                m.update(to_unit_range(imgs.to(device)), real=True)
            seen_real += imgs.shape[0]
            bar.update(imgs.shape[0])
            if num_real is not None and seen_real >= num_real:
                break
    if seen_real < 2:
        raise ValueError(f"real_images: need at least 2 real images for FID, got {seen_real}")
    if kid and min(seen_real, num_fake) < kid_size:
        raise ValueError(f"kid_subset_size: {kid_size} exceeds the real ({seen_real}) or fake ({num_fake}) count")
    generator.eval()
    with tqdm(total=num_fake, desc="FID generated", unit="img", disable=not progress) as bar:
        for lo in range(seed, seed + num_fake, batch_size):
            z = generator.seeded_latents(range(lo, min(lo + batch_size, seed + num_fake))).to(device)
            fake = to_unit_range(generator(z, truncation=truncation))
            for m in metrics.values():
                m.update(fake, real=False)
            bar.update(z.shape[0])
    result = {"fid": float(metrics["fid"].compute()), "num_real": seen_real, "num_fake": num_fake}
    if kid:
        mean, std = metrics["kid"].compute()
        result.update(kid_mean=float(mean), kid_std=float(std))
    return result


def run(cfg) -> dict:
    """eval.py task=fid: FID (KID) of ``ckpt_path``'s generator against ``data``'s real images."""
    import json

    from omegaconf import OmegaConf

    import ops
    from namodels.data.images import GANDataModule
    from namodels.tasks.generate import generator_from_eval_config
    from namodels.tasks.run_dirs import assign_run_folder

    assign_run_folder(cfg)  # this run's own folder (a no-op under eval.py, which chose it already)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    if "source" not in data:
        raise ValueError(f"data: FID needs real images from an image data config (data=skimage, or data=ffhq "
                         f"data.root=...), got data={data.get('name')!r}")
    generator, source = generator_from_eval_config(cfg)
    t = cfg.task
    if data.get("resolution") != generator.size:
        data["resolution"] = generator.size  # real images at the generator's size
    keys = ("source", "root", "resolution", "num_workers", "length", "min_scale", "max_images")
    dm = GANDataModule(**{k: data[k] for k in keys if data.get(k) is not None}, batch_size=int(t.batch_size),
                       seed=int(cfg.get("seed", 0)))
    with ops.use_backend(cfg.model.get("backend") if cfg.get("model") else None):
        result = compute_fid(generator, dm.real_dataloader(), num_fake=int(t.num_fake),
                             num_real=t.get("num_real"), batch_size=int(t.batch_size),
                             truncation=float(t.truncation), seed=int(t.seed),
                             inception_weights=t.get("inception_weights"), kid=bool(t.kid),
                             kid_subset_size=int(t.kid_subset_size), progress=bool(t.get("progress", True)))
    result = {"checkpoint": source, "data": data.get("name"), "truncation": float(t.truncation), **result}
    out = cfg.get("results_file") or os.path.join(cfg.paths.output_dir, "fid.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2), flush=True)
    return result
