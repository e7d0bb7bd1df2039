"""Batched JPEG decoding on a CUDA device, for the GPU input pipeline.

Two decoders, chosen by ``data.gpu.decoder``:

* ``nvimgcodec`` (the package ``nvidia-nvimgcodec-cu13`` with ``nvidia-nvjpeg``): NVIDIA's codec library, which
  sends baseline JPEGs to the GPU's hardware JPEG engines where the GPU has them (A100, H100, H200), so decoding
  takes no SM time from the training step; the rest goes to its CUDA or hybrid CPU/GPU decoders.
* ``torchvision``: ``torchvision.io.decode_jpeg(list, device="cuda")``, batched nvJPEG on the SMs; installed
  everywhere torchvision is.

``auto`` takes ``nvimgcodec`` where it imports and finds its nvJPEG, else ``torchvision``.  A file a decoder
refuses comes back as None and is decoded on the CPU by the caller (:func:`~namodels.data.decoding.open_rgb`).
"""
from __future__ import annotations

import contextlib
import logging
import warnings

import torch

log = logging.getLogger(__name__)

DECODERS = ("auto", "nvimgcodec", "torchvision")


def _nvimgcodec():
    """The nvimgcodec module if it imports and can decode JPEGs on the GPU, else None."""
    try:
        from nvidia import nvimgcodec
    except ImportError:
        return None
    return nvimgcodec


class NvImgCodecDecoder:
    """nvImageCodec's batched decoder (hardware JPEG engines first) writing RGB ``[3, H, W]`` uint8 tensors."""

    name = "nvimgcodec"

    def __init__(self, device: torch.device, cpu_threads: int):
        codec = _nvimgcodec()
        if codec is None:
            raise ImportError("data.gpu.decoder: 'nvimgcodec' needs the packages nvidia-nvimgcodec-cu13 and "
                              "nvidia-nvjpeg (pip install nvidia-nvimgcodec-cu13[nvjpeg])")
        self.codec = codec
        # host threads parse the files (and run the Huffman stage of what the hardware decoder does not take)
        self.decoder = codec.Decoder(device_id=device.index if device.index is not None else 0,
                                     max_num_cpu_threads=cpu_threads)
        # PIL, and so the CPU pipeline, ignores EXIF orientation: the GPU pipeline must see the same pixels
        self.params = codec.DecodeParams(apply_exif_orientation=False, color_spec=codec.ColorSpec.SRGB,
                                         allow_any_depth=False, sample_format=codec.SampleFormat.I_RGB)
        # Without its nvJPEG library nvImageCodec imports but decodes nothing: find out now, not per file
        probe = self(_probe_jpeg(), torch.cuda.current_stream(device))
        if probe[0] is None or tuple(probe[0].shape) != (3, 8, 8):
            raise RuntimeError("nvImageCodec decoded no JPEG (is the nvidia-nvjpeg package installed?)")

    def __call__(self, data: list[torch.Tensor], stream: torch.cuda.Stream) -> list[torch.Tensor | None]:
        streams = [self.codec.CodeStream(d.numpy()) for d in data]
        images = self.decoder.decode(streams, params=self.params, cuda_stream=stream.cuda_stream)
        out = []
        for image in images:
            if image is None:
                out.append(None)
                continue
            hwc = torch.as_tensor(image, device=f"cuda:{image.device_id}")  # keeps ``image`` alive
            out.append(hwc.permute(2, 0, 1) if hwc.dim() == 3 else hwc[None].expand(3, -1, -1))
        return out


def _probe_jpeg() -> list[torch.Tensor]:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 90)).save(buf, "JPEG")
    return [torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)]


class TorchvisionDecoder:
    """torchvision's batched nvJPEG decode (libjpeg-turbo on a CPU ``device``, which tests use); a batch that
    fails is decoded file by file to find the bad files."""

    name = "torchvision"

    def __init__(self, device: torch.device):
        from torchvision.io import ImageReadMode, decode_jpeg

        self.decode_jpeg, self.mode, self.device = decode_jpeg, ImageReadMode.RGB, device
        # torchvision >= 0.29 warns on every call that its decoders move to TorchCodec; they still work
        warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                                category=DeprecationWarning)

    def __call__(self, data: list[torch.Tensor], stream: torch.cuda.Stream | None) -> list[torch.Tensor | None]:
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            try:
                return list(self.decode_jpeg(data, mode=self.mode, device=self.device))
            except RuntimeError:
                pass
            out = []
            for d in data:
                try:
                    out.append(self.decode_jpeg(d, mode=self.mode, device=self.device))
                except RuntimeError:
                    out.append(None)
            return out


def make_decoder(name: str, device: torch.device, cpu_threads: int = 2):
    """The decoder ``name`` (one of :data:`DECODERS`) for ``device`` with ``cpu_threads`` host threads (nvImageCodec);
    logs which one ``auto`` took and why."""
    if name not in DECODERS:
        raise ValueError(f"data.gpu.decoder: expected one of {DECODERS}, got {name!r}")
    if device.type != "cuda":
        return TorchvisionDecoder(device)
    if name in ("auto", "nvimgcodec"):
        try:
            decoder = NvImgCodecDecoder(device, cpu_threads)
            log.info("GPU input pipeline: JPEGs decoded by nvImageCodec %s", getattr(decoder.codec, "__version__", ""))
            return decoder
        except (ImportError, RuntimeError) as err:
            if name == "nvimgcodec":
                raise
            log.info("GPU input pipeline: nvImageCodec not usable (%s); JPEGs decoded by torchvision's nvJPEG", err)
    return TorchvisionDecoder(device)
