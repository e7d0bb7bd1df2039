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
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
VIDEO_EXTENSIONS = (".gif", ".mp4", ".avi", ".mkv", ".mov", ".webm")
SAMPLINGS = ("random", "uniform")


def _natural_key(name: str):
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def _pil_to_tensor(image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)


def read_image(path: str) -> torch.Tensor:
    """``[C, H, W]`` uint8 RGB (palette / alpha / grey images converted)."""
    from PIL import Image

    with Image.open(path) as image:
        return _pil_to_tensor(image)


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
    """

    def __init__(self, root: str, num_frames: int = 16, frame_stride: int = 1, image_size=64,
                 clips_per_video: int = 1, sampling: str = "uniform", center_crop: bool = True,
                 grayscale: bool = False):
        if num_frames < 1 or frame_stride < 1 or clips_per_video < 1:
            raise ValueError("num_frames: num_frames, frame_stride and clips_per_video must be >= 1")
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling: expected one of {SAMPLINGS}, got {sampling!r}")
        self.num_frames, self.frame_stride, self.clips_per_video = num_frames, frame_stride, clips_per_video
        self.image_size = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
        self.sampling, self.center_crop, self.grayscale = sampling, center_crop, grayscale
        videos, self.classes = discover_videos(root)
        span = (num_frames - 1) * frame_stride + 1
        self.videos = [v for v in videos if len(v) >= span]
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
