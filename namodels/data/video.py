"""Real video as clips: folders of frames or video files, with clip sampling.

Layouts under ``root`` (searched recursively):

* frame folders: a directory whose files are images (``.png .jpg .jpeg .bmp .webp``) is one video;
  frames are ordered by natural sort (``frame2.png`` before ``frame10.png``);
* video files: ``.gif`` (decoded with Pillow) and ``.mp4 .avi .mkv .mov .webm`` (decoded by
  ``torchcodec`` if installed -- torchvision >= 0.24 moved video decoding there --, else
  ``torchvision.io.read_video`` on torchvision versions that still have it, else PyAV).

Labels (classification option): with ``root/<class>/<video>`` the class is the first path component
under ``root`` (classes sorted by name); videos directly under ``root`` get label ``-1``.

Sampling: a clip is ``num_frames`` frames, ``frame_stride`` apart.  ``sampling='random'`` (training)
draws a random start per item (``torch`` RNG, so Lightning's worker seeding applies) and makes
``clips_per_video`` items per video; ``sampling='uniform'`` (evaluation) takes ``clips_per_video``
evenly spaced starts, deterministic per index.  Videos shorter than one clip are skipped (counted
in ``skipped``).  Frames are resized (bilinear, antialiased) to ``image_size`` (optionally after a
center crop to a square), scaled to ``[0, 1]``.  Items are ``(clip [T, C, H, W], label)``.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import numpy as np
import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from .decoding import open_rgb, to_rgb8
from .moving_digits import MovingDigits

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
VIDEO_EXTENSIONS = (".gif", ".mp4", ".avi", ".mkv", ".mov", ".webm")
SAMPLINGS = ("random", "uniform")


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def _pil_to_tensor(image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(to_rgb8(image)).copy()).permute(2, 0, 1)


def read_image(path: str) -> torch.Tensor:
    """``[C, H, W]`` uint8 RGB (palette / alpha / grey images converted, 16-bit images scaled)."""
    return _pil_to_tensor(open_rgb(path))


def read_video_file(path: str) -> torch.Tensor:
    """Every frame of a video file as ``[T, C, H, W]`` uint8 RGB."""
    if path.lower().endswith(".gif"):
        from PIL import Image, ImageSequence

        with Image.open(path) as image:
            return torch.stack([_pil_to_tensor(frame) for frame in ImageSequence.Iterator(image)])
    try:
        from torchcodec.decoders import VideoDecoder  # torchvision's successor for video decoding

        return VideoDecoder(path)[:]
    except ImportError:
        pass
    import torchvision.io as tio

    if hasattr(tio, "read_video"):  # torchvision < 0.24
        frames, _, _ = tio.read_video(path, pts_unit="sec", output_format="TCHW")
        return frames
    try:
        import av
    except ImportError as err:
        raise RuntimeError(
            f"{path}: decoding {Path(path).suffix} files needs torchcodec (pip install torchcodec) or PyAV; "
            f"this torchvision has no read_video. GIFs and frame folders work without them."
        ) from err
    with av.open(path) as container:
        frames = [torch.from_numpy(f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
    return torch.stack(frames).permute(0, 3, 1, 2)


class _Video:
    """One source: a frame folder (list of files) or a video file (decoded on demand)."""

    def __init__(self, path: str, frames: Optional[List[str]], label: int):
        self.path, self.frames, self.label = path, frames, label
        self._length: Optional[int] = None

    def __len__(self) -> int:
        if self.frames is not None:
            return len(self.frames)
        if self._length is None:
            self._length = int(read_video_file(self.path).shape[0])
        return self._length

    def read(self, indices: Sequence[int]) -> torch.Tensor:
        if self.frames is not None:
            return torch.stack([read_image(self.frames[i]) for i in indices])
        return read_video_file(self.path)[list(indices)]


def discover_videos(root: str) -> Tuple[List[_Video], List[str]]:
    """Frame folders and video files under ``root``; returns the videos and the sorted class names."""
    if not os.path.isdir(root):
        raise ValueError(f"root: {root!r} is not a directory")
    found: List[Tuple[str, Optional[List[str]]]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort(key=_natural_key)
        images = sorted((f for f in filenames if f.lower().endswith(IMAGE_EXTENSIONS)), key=_natural_key)
        if images:
            found.append((dirpath, [os.path.join(dirpath, f) for f in images]))
        for f in sorted(filenames, key=_natural_key):
            if f.lower().endswith(VIDEO_EXTENSIONS):
                found.append((os.path.join(dirpath, f), None))
    found.sort(key=lambda item: _natural_key(os.path.relpath(item[0], root)))

    def class_of(path: str) -> Optional[str]:
        parts = Path(os.path.relpath(path, root)).parts
        return parts[0] if len(parts) >= 2 else None

    classes = sorted({c for c in (class_of(p) for p, _ in found) if c is not None}, key=_natural_key)
    index = {c: i for i, c in enumerate(classes)}
    videos = [_Video(p, frames, index.get(class_of(p), -1)) for p, frames in found]
    return videos, classes


class VideoClips(Dataset):
    """Fixed-length clips from frame folders and video files under ``root`` (see the module doc).

    Args:
        root: directory to search.
        num_frames: frames per clip; frame_stride: step between sampled frames.
        image_size: output side (square) or (H, W).
        clips_per_video: items per video.
        sampling: 'random' (random start per item) or 'uniform' (evenly spaced, deterministic).
        center_crop: crop the largest centred square before resizing.
        grayscale: one channel (ITU-R 601 luma) instead of RGB.
        subset: ``(start, stop)`` fractions of the sorted video list to use (e.g. ``(0.9, 1.0)``
            holds the last 10 % of the videos out for validation).
    """

    def __init__(self, root: str, num_frames: int = 16, frame_stride: int = 1, image_size=64,
                 clips_per_video: int = 1, sampling: str = "uniform", center_crop: bool = True,
                 grayscale: bool = False, subset: Sequence[float] = (0.0, 1.0)):
        if num_frames < 1 or frame_stride < 1 or clips_per_video < 1:
            raise ValueError("num_frames: num_frames, frame_stride and clips_per_video must be >= 1")
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling: expected one of {SAMPLINGS}, got {sampling!r}")
        self.num_frames, self.frame_stride, self.clips_per_video = num_frames, frame_stride, clips_per_video
        self.image_size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.sampling, self.center_crop, self.grayscale = sampling, center_crop, grayscale
        if len(subset) != 2 or not 0.0 <= subset[0] < subset[1] <= 1.0:
            raise ValueError(f"subset: expected (start, stop) with 0 <= start < stop <= 1, got {tuple(subset)}")
        videos, self.classes = discover_videos(root)
        videos = videos[round(subset[0] * len(videos)):round(subset[1] * len(videos))]
        span = (num_frames - 1) * frame_stride + 1
        # a video file's length means decoding it: a progress bar (on a terminal) when there are files to decode
        files = sum(v.frames is None for v in videos)
        scan = tqdm(videos, desc="video lengths", unit="video", leave=False, disable=None if files else True)
        self.videos = [v for v in scan if len(v) >= span]
        self.skipped = len(videos) - len(self.videos)
        if not self.videos:
            raise ValueError(f"root: no video under {root!r} has the {span} frames a clip needs "
                             f"({len(videos)} found, all shorter)")
        self.span = span

    def __len__(self) -> int:
        return len(self.videos) * self.clips_per_video

    def _start(self, video: _Video, clip: int) -> int:
        room = len(video) - self.span  # last admissible start
        if self.sampling == "random":
            return int(torch.randint(0, room + 1, ()).item())
        if self.clips_per_video == 1:
            return room // 2
        return round(clip * room / (self.clips_per_video - 1))

    def _resize(self, frames: torch.Tensor) -> torch.Tensor:
        x = frames.float() / 255.0
        if self.center_crop:
            h, w = x.shape[-2:]
            s = min(h, w)
            top, left = (h - s) // 2, (w - s) // 2
            x = x[..., top:top + s, left:left + s]
        if tuple(x.shape[-2:]) != self.image_size:
            x = F.interpolate(x, size=self.image_size, mode="bilinear", align_corners=False, antialias=True)
        if self.grayscale:
            x = (x * x.new_tensor([0.299, 0.587, 0.114])[:, None, None]).sum(1, keepdim=True)
        return x.clamp(0.0, 1.0)

    def __getitem__(self, index: int):
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} clips")
        video = self.videos[index // self.clips_per_video]
        start = self._start(video, index % self.clips_per_video)
        frames = video.read(range(start, start + self.span, self.frame_stride))
        return self._resize(frames), video.label


# --------------------------------------------------------------------------------------------- data module

DEFAULT_DATA = dict(
    name=None, source="moving_digits", channels=None, num_classes=10, img_size=32, num_frames=10,
    batch_size=16, val_batch_size=None, num_workers=0, pin_memory=False,
    # moving digits
    train_clips=100000, val_clips=256, num_digits=2, digit_scale=1, speed=(1.0, 3.0),
    # frame folders / video files
    root=None, val_root=None, val_fraction=0.1, frame_stride=1, clips_per_video=4, val_clips_per_video=1,
    center_crop=True, grayscale=False,
)
SOURCES = ("moving_digits", "folder")


def check_data_config(data: dict) -> dict:
    """Fills defaults and checks a video ``data`` config; raises ``ValueError`` naming the key."""
    from ..utils.checks import check_choice, check_range

    cfg = {**DEFAULT_DATA, **dict(data)}
    unknown = set(cfg) - set(DEFAULT_DATA)
    if unknown:
        raise ValueError(f"data: unknown keys {sorted(unknown)} for a video data config; known: {sorted(DEFAULT_DATA)}")
    check_choice("data.source", cfg["source"], SOURCES)
    for key in ("img_size", "num_frames", "batch_size", "train_clips", "val_clips", "num_digits", "digit_scale",
                "frame_stride", "clips_per_video", "val_clips_per_video"):
        check_range(f"data.{key}", cfg[key], 1, integer=True)
    check_range("data.num_frames", cfg["num_frames"], 2, integer=True)  # next-frame targets need 2 frames
    check_range("data.val_batch_size", cfg["val_batch_size"], 1, integer=True, allow_none=True)
    check_range("data.num_workers", cfg["num_workers"], 0, integer=True)
    check_range("data.num_classes", cfg["num_classes"], 0, integer=True)
    check_range("data.val_fraction", cfg["val_fraction"], 0, 1, low_open=True, high_open=True)
    natural = 1 if cfg["source"] == "moving_digits" or cfg["grayscale"] else 3
    if cfg["channels"] is None:
        cfg["channels"] = natural
    elif cfg["channels"] != natural:
        raise ValueError(f"data.channels: the {cfg['source']} source gives {natural} channel(s), got {cfg['channels']}")
    if cfg["source"] == "folder" and not cfg["root"]:
        raise ValueError("data.root: source=folder needs data.root=<folder of frame folders / video files>")
    return cfg


class VideoDataModule(L.LightningDataModule):
    """Train/val clip loaders for a video ``data`` config (``configs/data/moving_digits.yaml``,
    ``configs/data/video_folder.yaml``).  Batches are ``(clips [B, T, C, H, W], labels [B])``.

    Validation clips are held out: moving digits use other sprites and seeds (split ``val``);
    folders use ``val_root`` or, without it, the last ``val_fraction`` of the videos (sorted order).
    """

    def __init__(self, data: dict, seed: int = 0):
        super().__init__()
        self.cfg = check_data_config(data)
        self.seed = int(seed)
        self.train_set = self.val_set = None

    @property
    def batch_size(self) -> int:
        return int(self.cfg["batch_size"])

    def _datasets(self):
        c = self.cfg
        if c["source"] == "moving_digits":
            common = dict(num_frames=c["num_frames"], image_size=c["img_size"], num_digits=c["num_digits"],
                          digit_scale=c["digit_scale"], speed=tuple(c["speed"]), seed=self.seed)
            return (MovingDigits(c["train_clips"], split="train", **common),
                    MovingDigits(c["val_clips"], split="val", **common))
        common = dict(num_frames=c["num_frames"], frame_stride=c["frame_stride"], image_size=c["img_size"],
                      center_crop=c["center_crop"], grayscale=c["grayscale"])
        if c["val_root"]:
            train = VideoClips(c["root"], clips_per_video=c["clips_per_video"], sampling="random", **common)
            val = VideoClips(c["val_root"], clips_per_video=c["val_clips_per_video"], sampling="uniform", **common)
        else:
            cut = 1.0 - c["val_fraction"]
            train = VideoClips(c["root"], clips_per_video=c["clips_per_video"], sampling="random",
                               subset=(0.0, cut), **common)
            val = VideoClips(c["root"], clips_per_video=c["val_clips_per_video"], sampling="uniform",
                             subset=(cut, 1.0), **common)
        return train, val

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set = self._datasets()

    def _loader(self, dataset, batch_size: int, shuffle: bool) -> DataLoader:
        workers = int(self.cfg["num_workers"])
        generator = torch.Generator().manual_seed(self.seed) if shuffle else None
        return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, drop_last=shuffle, generator=generator,
                          num_workers=workers, persistent_workers=workers > 0,
                          pin_memory=bool(self.cfg["pin_memory"]) and torch.cuda.is_available())

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        if len(self.train_set) < self.batch_size:
            raise ValueError(f"data.batch_size: {self.batch_size} exceeds the {len(self.train_set)} training clips")
        return self._loader(self.train_set, self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._loader(self.val_set, int(self.cfg["val_batch_size"] or self.batch_size), shuffle=False)
