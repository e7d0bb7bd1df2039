"""timm's training augmentations after the random resized crop, batched in torch on the batch's device.

The loader decodes and crops on the GPU; this module does the rest of timm's ``transforms_imagenet_train``
before normalisation: horizontal / vertical flips, RandAugment (``auto_augment="rand-..."``) and, when
RandAugment is off, torchvision's ``ColorJitter``.  Input and output are uint8 ``[B, 3, H, W]`` batches, so
:class:`namodels.data.device_transforms.DeviceNormalize` (normalisation, random erasing) follows unchanged.

Every sample gets its own random parameters, as timm's per-image PIL transform would draw them.  They are drawn
on the host from one CPU ``torch.Generator`` in a few calls for the whole batch (:meth:`GPUAugment.draw`,
:func:`draw_rand_augment`, :func:`draw_color_jitter`); the host then knows which samples drew which op, so the
batch is split into a few groups per RandAugment layer (point ops as per-channel lookup tables, PIL blends,
affine warps per interpolation mode) with index tensors built on the host.  All of a call's index and parameter
tensors go to the device in one copy per dtype, and the device work is a fixed handful of batched ops per group:
no per-sample kernels and no device-to-host reads.

The ops follow Pillow's integer semantics (timm runs them on PIL images): ``convert("L")`` luma in 16-bit fixed
point, ``Image.blend``'s float32 blend truncated to uint8, ``ImageFilter.SMOOTH`` with borders kept,
``ImageOps.autocontrast`` / ``equalize`` lookup tables from per-channel histograms, PIL's affine ``transform``
(output pixel centres mapped through the inverse matrix, taps clamped at the border, fill outside the source,
bilinear and PIL's a = -1 bicubic kernel, truncation to uint8), and PIL's RGB <-> HSV conversion for hue.
Posterize to 0 bits gives black, as Pillow before 13 did (Pillow 13 rejects 0 bits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Optional, Sequence

import torch

IMAGENET_DEFAULT_MEAN = (0.485, 0.456, 0.406)

# timm's RandAugment magnitude scale: magnitude / _LEVEL_DENOM is the op's fractional level
_LEVEL_DENOM = 10.0

INTERPOLATIONS = ("nearest", "bilinear", "bicubic")
_NEAREST, _BILINEAR, _BICUBIC = range(3)

# op groups: each RandAugment layer runs one batched pass per group over the samples that drew an op of it
_LUT, _BLEND, _GEO = "lut", "blend", "geo"
# point ops, as per-sample-channel 256-entry lookup tables
_AUTOCONTRAST, _EQUALIZE, _INVERT, _POSTERIZE, _SOLARIZE, _SOLARIZE_ADD = range(6)
# PIL ImageEnhance blends, by their "degenerate" image
_TO_GRAY, _TO_MEAN, _TO_BLACK, _TO_SMOOTH = range(4)

# timm op name -> (group, code within the group); the affine ops' code is unused (their matrix says it all)
_OPS = {
    "AutoContrast": (_LUT, _AUTOCONTRAST),
    "Equalize": (_LUT, _EQUALIZE),
    "Invert": (_LUT, _INVERT),
    "Posterize": (_LUT, _POSTERIZE),
    "PosterizeIncreasing": (_LUT, _POSTERIZE),
    "PosterizeOriginal": (_LUT, _POSTERIZE),
    "Solarize": (_LUT, _SOLARIZE),
    "SolarizeIncreasing": (_LUT, _SOLARIZE),
    "SolarizeAdd": (_LUT, _SOLARIZE_ADD),
    "Color": (_BLEND, _TO_GRAY),
    "ColorIncreasing": (_BLEND, _TO_GRAY),
    "Desaturate": (_BLEND, _TO_GRAY),
    "Contrast": (_BLEND, _TO_MEAN),
    "ContrastIncreasing": (_BLEND, _TO_MEAN),
    "Brightness": (_BLEND, _TO_BLACK),
    "BrightnessIncreasing": (_BLEND, _TO_BLACK),
    "Sharpness": (_BLEND, _TO_SMOOTH),
    "SharpnessIncreasing": (_BLEND, _TO_SMOOTH),
    "Rotate": (_GEO, 0),
    "ShearX": (_GEO, 0),
    "ShearY": (_GEO, 0),
    "TranslateX": (_GEO, 0),
    "TranslateY": (_GEO, 0),
    "TranslateXRel": (_GEO, 0),
    "TranslateYRel": (_GEO, 0),
}
SUPPORTED_OPS = tuple(_OPS)

# ColorJitter's ops in torchvision's order (its fn_idx values) and the blend each one is on PIL images
_CJ_NAMES = ("brightness", "contrast", "saturation", "hue")
_CJ_BLEND = (_TO_BLACK, _TO_MEAN, _TO_GRAY)


# ---------------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RandAugmentSpec:
    """A parsed RandAugment config (timm's ``rand_augment_transform`` fields).

    ops: timm op names to choose from; num_layers: ops per image; prob: chance that a chosen op is applied;
    magnitude / magnitude_std / magnitude_max: the magnitude draw (``inf`` std: uniform in [0, magnitude]; the
    clip's upper bound is ``magnitude_max or 10``); choice_weights: None (uniform choice with replacement) or
    one weight per op (choice without replacement); translate_pct: TranslateXRel/YRel's range; interpolation:
    'random' (bilinear or bicubic per op application) or one of :data:`INTERPOLATIONS`.
    """
    ops: tuple
    num_layers: int = 2
    prob: float = 0.5
    magnitude: float = 10.0
    magnitude_std: float = 0.0
    magnitude_max: Optional[float] = None
    choice_weights: Optional[tuple] = None
    translate_pct: float = 0.45
    interpolation: str = "random"


def parse_rand_augment(config: str, interpolation: str = "random") -> RandAugmentSpec:
    """Parses ``rand-m{M}[-n{N}][-mstd{S}][-mmax{X}][-inc{0,1}][-p{P}][-t{set}]`` with timm's own parser.

    timm's ``rand_augment_transform`` builds its ``RandAugment`` from the string; the spec copies the op names,
    layer count, probability, magnitude settings and choice weights from it, so the two cannot disagree.
    """
    if not isinstance(config, str) or not config.startswith("rand"):
        raise ValueError(f"auto_augment: only RandAugment configs ('rand-m9-mstd0.5-inc1', ...) are supported, "
                         f"got {config!r}")
    _check_interpolation(interpolation)
    from timm.data.auto_augment import rand_augment_transform

    try:
        ra = rand_augment_transform(config, dict(translate_const=250, img_mean=(128, 128, 128)))
    except (AssertionError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"auto_augment: timm cannot parse {config!r} ({type(err).__name__}: {err})") from err
    names = tuple(op.name for op in ra.ops)
    unsupported = sorted(set(names) - set(_OPS))
    if unsupported:
        raise ValueError(f"auto_augment: {config!r} uses ops without a batched version: {unsupported}")
    first = ra.ops[0]
    weights = None
    if ra.choice_weights is not None:
        weights = tuple(float(w) for w in ra.choice_weights)
        if ra.num_layers > sum(w > 0 for w in weights):
            raise ValueError(f"auto_augment: {config!r} picks {ra.num_layers} distinct ops out of "
                             f"{sum(w > 0 for w in weights)} with non-zero weight")
    if ra.num_layers < 0:
        raise ValueError(f"auto_augment: negative layer count in {config!r}")
    return RandAugmentSpec(
        ops=names, num_layers=int(ra.num_layers), prob=float(first.prob), magnitude=float(first.magnitude),
        magnitude_std=float(first.magnitude_std), magnitude_max=first.magnitude_max, choice_weights=weights,
        translate_pct=float(first.hparams.get("translate_pct", 0.45)), interpolation=interpolation,
    )


@dataclass(frozen=True)
class ColorJitterSpec:
    """torchvision ``ColorJitter`` factor ranges (None: op off) and timm's optional ``color_jitter_prob``."""
    brightness: Optional[tuple] = None
    contrast: Optional[tuple] = None
    saturation: Optional[tuple] = None
    hue: Optional[tuple] = None
    prob: Optional[float] = None

    def ranges(self) -> tuple:
        return self.brightness, self.contrast, self.saturation, self.hue


def _jitter_range(name: str, value, center: float, low: float, high: float, clip_first: bool):
    """torchvision's ``ColorJitter._check_input``: a number v -> [center - v, center + v]; a pair is kept."""
    if isinstance(value, Real) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"color_jitter: {name} must be >= 0, got {value}")
        lo, hi = center - float(value), center + float(value)
        if clip_first:
            lo = max(lo, 0.0)
    elif isinstance(value, Sequence) and len(value) == 2 and all(isinstance(v, Real) for v in value):
        lo, hi = float(value[0]), float(value[1])
    else:
        raise ValueError(f"color_jitter: {name} must be a number or a (min, max) pair, got {value!r}")
    if not low <= lo <= hi <= high:
        raise ValueError(f"color_jitter: {name} range {(lo, hi)} must lie in [{low}, {high}] with min <= max")
    if lo == hi == center:
        return None
    return lo, hi


def parse_color_jitter(color_jitter, prob: Optional[float] = None) -> Optional[ColorJitterSpec]:
    """timm's handling of ``color_jitter``: a scalar s is (s, s, s) with no hue; a 3- or 4-sequence is
    (brightness, contrast, saturation[, hue]).  Returns None when every op is off."""
    if color_jitter is None:
        return None
    if isinstance(color_jitter, Real) and not isinstance(color_jitter, bool):
        values = (float(color_jitter),) * 3
    elif isinstance(color_jitter, Sequence) and not isinstance(color_jitter, str) and len(color_jitter) in (3, 4):
        values = tuple(color_jitter)
    else:
        raise ValueError(f"color_jitter: expected None, a number or 3/4 values, got {color_jitter!r}")
    inf = float("inf")
    ranges = [_jitter_range(name, v, 1.0, 0.0, inf, True) for name, v in zip(_CJ_NAMES[:3], values[:3])]
    ranges.append(_jitter_range("hue", values[3], 0.0, -0.5, 0.5, False) if len(values) == 4 else None)
    if prob is not None and not (isinstance(prob, Real) and 0.0 <= prob <= 1.0):
        raise ValueError(f"color_jitter_prob: expected None or a number in [0, 1], got {prob!r}")
    if all(r is None for r in ranges) or prob == 0.0:
        return None
    return ColorJitterSpec(*ranges, prob=None if prob is None else float(prob))


def _check_interpolation(interpolation) -> None:
    if interpolation != "random" and interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation: expected 'random' or one of {INTERPOLATIONS} (PIL's affine transform "
                         f"takes no other filter), got {interpolation!r}")


def _check_generator(generator) -> torch.Generator:
    if generator is None:
        return torch.default_generator
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise ValueError(f"generator: expected a CPU torch.Generator (parameters are drawn on the host), "
                         f"got {generator!r}")
    return generator


# ---------------------------------------------------------------------------------------------------------------
# parameter drawing (host)
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class RandAugmentDraw:
    """Per-sample, per-layer RandAugment parameters, all ``[B, num_layers]`` host tensors.

    op: index into ``spec.ops``; applied: the op passed its ``prob`` test; magnitude: after noise and clipping;
    negate: the random sign of signed ops; interpolation: index into :data:`INTERPOLATIONS`; arg: the op's
    argument as timm's level function gives it (degrees, factor, bits, threshold, shear, pixels or fraction).
    """
    op: torch.Tensor
    applied: torch.Tensor
    magnitude: torch.Tensor
    negate: torch.Tensor
    interpolation: torch.Tensor
    arg: torch.Tensor


def level_to_arg(name: str, magnitude: torch.Tensor, negate: torch.Tensor, translate_const: float,
                 translate_pct: float = 0.45) -> torch.Tensor:
    """timm's ``LEVEL_TO_ARG[name]`` on float64 tensors, in the same order of float operations."""
    level = magnitude.double() / _LEVEL_DENOM

    def signed(v):
        return torch.where(negate, -v, v)

    if name in ("AutoContrast", "Equalize", "Invert"):
        return torch.zeros_like(level)
    if name == "Rotate":
        return signed(level * 30.0)
    if name == "Posterize":
        return torch.floor(level * 4)          # int() of a non-negative number
    if name == "PosterizeIncreasing":
        return 4 - torch.floor(level * 4)
    if name == "PosterizeOriginal":
        return torch.floor(level * 4) + 4
    if name == "Solarize":
        return torch.clamp(torch.floor(level * 256), max=256)
    if name == "SolarizeIncreasing":
        return 256 - torch.clamp(torch.floor(level * 256), max=256)
    if name == "SolarizeAdd":
        return torch.clamp(torch.floor(level * 110), max=128)
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return level * 1.8 + 0.1
    if name in ("ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing"):
        return torch.clamp(1.0 + signed(level * 0.9), min=0.1)
    if name in ("ShearX", "ShearY"):
        return signed(level * 0.3)
    if name in ("TranslateX", "TranslateY"):
        return signed(level * float(translate_const))
    if name in ("TranslateXRel", "TranslateYRel"):
        return signed(level * translate_pct)
    if name == "Desaturate":
        return torch.clamp(0.5 + 0.5 * level, 0.5, 1.0)
    raise ValueError(f"op: no batched version of {name!r}")


def draw_rand_augment(spec: RandAugmentSpec, batch_size: int, generator: Optional[torch.Generator] = None,
                      image_size: tuple = (224, 224)) -> RandAugmentDraw:
    """Draws the whole batch's RandAugment parameters with ``generator`` (CPU) in a few tensor calls.

    Distributions as timm's ``RandAugment`` / ``AugmentOp`` per image: ``num_layers`` ops chosen uniformly with
    replacement (or, with choice weights, without replacement: successive weighted sampling, here as Gumbel
    top-k); each applied when ``random() < prob``; magnitude ``gauss(M, std)`` (or ``uniform(0, M)`` for an
    infinite std), clipped to [0, magnitude_max or 10]; a fair random sign; bilinear or bicubic with equal odds
    when the interpolation is 'random'.  ``image_size`` (H, W) gives TranslateX/Y's ``translate_const``
    (``int(min(H, W) * 0.45)``, as timm's ``transforms_imagenet_train`` sets it).
    """
    generator = _check_generator(generator)
    b, layers, k = int(batch_size), spec.num_layers, len(spec.ops)
    if spec.choice_weights is None:
        op = torch.randint(k, (b, layers), generator=generator)
    else:
        weights = torch.tensor(spec.choice_weights, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(torch.rand((b, k), generator=generator, dtype=torch.float64)))
        op = torch.topk(weights.log() + gumbel, layers, dim=1).indices
    uniform = torch.rand((4, b, layers), generator=generator, dtype=torch.float64)
    normal = torch.randn((b, layers), generator=generator, dtype=torch.float64)
    applied = uniform[0] < spec.prob
    magnitude = torch.full((b, layers), spec.magnitude, dtype=torch.float64)
    if spec.magnitude_std == float("inf"):
        magnitude = magnitude * uniform[1]
    elif spec.magnitude_std > 0:
        magnitude = magnitude + spec.magnitude_std * normal
    magnitude = magnitude.clamp(0.0, float(spec.magnitude_max or _LEVEL_DENOM))
    negate = uniform[2] > 0.5
    if spec.interpolation == "random":
        interpolation = torch.where(uniform[3] < 0.5, _BILINEAR, _BICUBIC)
    else:
        interpolation = torch.full((b, layers), INTERPOLATIONS.index(spec.interpolation))
    translate_const = int(min(image_size) * 0.45)
    arg = torch.zeros((b, layers), dtype=torch.float64)
    for index, name in enumerate(spec.ops):
        chosen = op == index
        arg = torch.where(chosen, level_to_arg(name, magnitude, negate, translate_const, spec.translate_pct), arg)
    return RandAugmentDraw(op=op, applied=applied, magnitude=magnitude, negate=negate,
                           interpolation=interpolation, arg=arg)


@dataclass
class ColorJitterDraw:
    """Per-sample ColorJitter parameters: order ``[B, 4]`` (a permutation of torchvision's fn_idx 0..3),
    factor ``[B, 4]`` (brightness, contrast, saturation, hue; NaN where the op is off), applied ``[B]``."""
    order: torch.Tensor
    factor: torch.Tensor
    applied: torch.Tensor


def draw_color_jitter(spec: ColorJitterSpec, batch_size: int,
                      generator: Optional[torch.Generator] = None) -> ColorJitterDraw:
    """torchvision's ``ColorJitter.get_params`` per sample (a uniform random op order, each factor uniform in
    its range), plus timm's ``RandomApply`` probability when ``spec.prob`` is set."""
    generator = _check_generator(generator)
    b = int(batch_size)
    order = torch.argsort(torch.rand((b, 4), generator=generator), dim=1)
    uniform = torch.rand((b, 5), generator=generator, dtype=torch.float64)
    factor = torch.full((b, 4), float("nan"), dtype=torch.float64)
    for j, bounds in enumerate(spec.ranges()):
        if bounds is not None:
            factor[:, j] = bounds[0] + (bounds[1] - bounds[0]) * uniform[:, j]
    applied = torch.ones(b, dtype=torch.bool) if spec.prob is None else uniform[:, 4] < spec.prob
    return ColorJitterDraw(order=order, factor=factor, applied=applied)


@dataclass
class AugmentParams:
    """Everything :meth:`GPUAugment.apply` needs for one batch (host tensors)."""
    image_size: tuple
    hflip: torch.Tensor
    vflip: torch.Tensor
    rand_augment: Optional[RandAugmentDraw] = None
    color_jitter: Optional[ColorJitterDraw] = None


# ---------------------------------------------------------------------------------------------------------------
# host-side plan: op parameters -> per-group steps
# ---------------------------------------------------------------------------------------------------------------
def _round15(v: torch.Tensor) -> torch.Tensor:
    """``round(v, 15)`` as PIL's ``rotate`` rounds its matrix entries."""
    return torch.round(v * 1e15) / 1e15


def affine_matrices(names: Sequence[str], arg: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """PIL ``Image.transform`` AFFINE data ``(a, b, c, d, e, f)`` per sample (float64 ``[N, 6]``): the source
    point of output pixel centre (x + .5, y + .5) is (a x + b y + c, d x + e y + f).  Rotate is PIL's
    ``Image.rotate`` matrix about the image centre."""
    n = len(names)
    m = torch.zeros((n, 6), dtype=torch.float64)
    m[:, 0] = 1.0
    m[:, 4] = 1.0
    rows = {name: [i for i, nm in enumerate(names) if nm == name] for name in set(names)}
    for name, idx in rows.items():
        idx = torch.tensor(idx, dtype=torch.long)
        a = arg[idx].double()
        if name == "ShearX":
            m[idx, 1] = a
        elif name == "ShearY":
            m[idx, 3] = a
        elif name == "TranslateX":
            m[idx, 2] = a
        elif name == "TranslateY":
            m[idx, 5] = a
        elif name == "TranslateXRel":
            m[idx, 2] = a * width
        elif name == "TranslateYRel":
            m[idx, 5] = a * height
        elif name == "Rotate":
            angle = -torch.deg2rad(a)
            cos, sin = _round15(torch.cos(angle)), _round15(torch.sin(angle))
            cx, cy = width / 2.0, height / 2.0
            m[idx, 0], m[idx, 1], m[idx, 3], m[idx, 4] = cos, sin, -sin, cos
            m[idx, 2] = cos * -cx + sin * -cy + 0.0 + cx
            m[idx, 5] = -sin * -cx + cos * -cy + 0.0 + cy
        else:
            raise ValueError(f"op: {name!r} is not an affine op")
    return m


@dataclass
class _Step:
    """One batched pass: ``kind`` over the samples ``index``, with per-sample ``tensors`` and host ``static``."""
    kind: str
    index: torch.Tensor
    tensors: tuple
    static: object = None


def blend_factors(spec: RandAugmentSpec, op: torch.Tensor, arg: torch.Tensor) -> torch.Tensor:
    """The PIL blend factor of each sample's op (``op`` indexes ``spec.ops``): its argument, except timm's
    Desaturate, a Color enhance by ``min(1, max(0, 1 - arg))``."""
    desaturate = torch.tensor([name == "Desaturate" for name in spec.ops], dtype=torch.bool)[op]
    return torch.where(desaturate, (1.0 - arg).clamp(0.0, 1.0), arg)


def _rand_augment_steps(spec: RandAugmentSpec, draw: RandAugmentDraw, height: int, width: int) -> list:
    group = [_OPS[name][0] for name in spec.ops]
    code = torch.tensor([_OPS[name][1] for name in spec.ops], dtype=torch.long)
    steps = []
    for layer in range(spec.num_layers):
        op, arg = draw.op[:, layer], draw.arg[:, layer]
        applied = draw.applied[:, layer]
        for kind in (_LUT, _BLEND, _GEO):
            in_group = torch.tensor([g == kind for g in group], dtype=torch.bool)[op] & applied
            index = in_group.nonzero().flatten()
            if index.numel() == 0:
                continue
            ops = op[index]
            names = [spec.ops[i] for i in ops.tolist()]
            if kind == _LUT:
                codes = code[ops]
                needs_histogram = bool(((codes == _AUTOCONTRAST) | (codes == _EQUALIZE)).any())
                steps.append(_Step(_LUT, index, (codes, arg[index].float()), needs_histogram))
            elif kind == _BLEND:
                factor = blend_factors(spec, ops, arg[index])
                codes = code[ops]
                steps.append(_Step(_BLEND, index, (codes, factor.float()), frozenset(codes.tolist())))
            else:
                matrices = affine_matrices(names, arg[index], height, width)
                modes = draw.interpolation[index, layer]
                for mode in range(len(INTERPOLATIONS)):
                    pick = (modes == mode).nonzero().flatten()
                    if pick.numel():
                        steps.append(_Step(_GEO, index[pick], (matrices[pick],), mode))
    return steps


def _color_jitter_steps(draw: ColorJitterDraw) -> list:
    steps = []
    enabled = ~torch.isnan(draw.factor)          # [B, 4]
    for position in range(4):
        fn = draw.order[:, position]
        factor = draw.factor.gather(1, fn[:, None]).squeeze(1)
        active = draw.applied & enabled.gather(1, fn[:, None]).squeeze(1)
        blend = (active & (fn < 3)).nonzero().flatten()
        if blend.numel():
            codes = torch.tensor(_CJ_BLEND, dtype=torch.long)[fn[blend]]
            steps.append(_Step(_BLEND, blend, (codes, factor[blend].float()), frozenset(codes.tolist())))
        hue = (active & (fn == 3)).nonzero().flatten()
        if hue.numel():
            # torchvision: np.int32(hue_factor * 255).astype(np.uint8), i.e. truncation, then mod 256
            shift = torch.trunc(factor[hue] * 255).long() % 256
            steps.append(_Step("hue", hue, (shift,)))
    return steps


def _to_device(tensors: list, device: torch.device) -> list:
    """Copies host tensors to ``device`` as one transfer per dtype (pinned, non-blocking on CUDA)."""
    if device.type == "cpu" or not tensors:
        return tensors
    out = [None] * len(tensors)
    for dtype in {t.dtype for t in tensors}:
        ids = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        flat = torch.cat([tensors[i].reshape(-1) for i in ids])
        if device.type == "cuda":
            flat = flat.pin_memory()
        flat = flat.to(device, non_blocking=True)
        for i, piece in zip(ids, flat.split([tensors[i].numel() for i in ids])):
            out[i] = piece.view(tensors[i].shape)
    return out


# ---------------------------------------------------------------------------------------------------------------
# batched ops (device); each takes and returns uint8 [N, 3, H, W]
# ---------------------------------------------------------------------------------------------------------------
def _div(a: torch.Tensor, b) -> torch.Tensor:
    """Correctly rounded ``a / b``: torch turns ``scalar / tensor`` (and, on CUDA, ``tensor / python scalar``)
    into a multiplication by the reciprocal, which can land one ulp off and flip a later floor or trunc."""
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(a, float(b))
    return torch.div(a, b)


def _luma(x: torch.Tensor) -> torch.Tensor:
    """PIL ``convert("L")``: (19595 R + 38470 G + 7471 B + 0x8000) >> 16, int32 ``[N, 1, H, W]``."""
    xi = x.to(torch.int32)
    return (xi[:, 0:1] * 19595 + xi[:, 1:2] * 38470 + xi[:, 2:3] * 7471 + 0x8000) >> 16


def _smooth(x: torch.Tensor) -> torch.Tensor:
    """PIL ``ImageFilter.SMOOTH`` (3x3 [[1,1,1],[1,5,1],[1,1,1]] / 13, rounded; the 1-pixel border is kept), as
    float32.  Integer box sums rather than a convolution: exact on every device (cuDNN may run float convs in
    TF32, which cannot hold sums up to 13 * 255)."""
    h, w = x.shape[-2:]
    out = x.float()
    if h < 3 or w < 3:
        return out
    xi = x.to(torch.int32)
    rows = xi[..., :, :-2] + xi[..., :, 1:-1] + xi[..., :, 2:]
    sums = rows[..., :-2, :] + rows[..., 1:-1, :] + rows[..., 2:, :] + 4 * xi[..., 1:-1, 1:-1]
    out[..., 1:-1, 1:-1] = torch.div(2 * sums + 13, 26, rounding_mode="floor").float()   # floor(sums / 13 + .5)
    return out


def _blend(x: torch.Tensor, codes: torch.Tensor, factor: torch.Tensor, present: frozenset) -> torch.Tensor:
    """PIL ``ImageEnhance``: ``Image.blend(degenerate, image, factor)`` = degenerate + factor * (image -
    degenerate) in float32, truncated and clipped to uint8.  Degenerate: the luma (Color), the luma's mean
    rounded to an integer (Contrast), black (Brightness) or the SMOOTH-filtered image (Sharpness)."""
    n, c, h, w = x.shape
    xf = x.float()
    k = codes.view(n, 1, 1, 1)
    degenerate = xf.new_zeros(())
    if _TO_GRAY in present or _TO_MEAN in present:
        luma = _luma(x)
        if _TO_GRAY in present:
            degenerate = torch.where(k == _TO_GRAY, luma.float(), degenerate)
        if _TO_MEAN in present:
            # ImageStat mean from the histogram (sum / count in double), then int(mean + 0.5)
            mean = torch.floor(_div(luma.sum(dim=(1, 2, 3), dtype=torch.int64).double(), h * w) + 0.5)
            degenerate = torch.where(k == _TO_MEAN, mean.float().view(n, 1, 1, 1), degenerate)
    if _TO_SMOOTH in present:
        degenerate = torch.where(k == _TO_SMOOTH, _smooth(x), degenerate)
    out = (xf - degenerate) * factor.view(n, 1, 1, 1) + degenerate
    return out.floor_().clamp_(0, 255).to(torch.uint8)


def _histogram(x: torch.Tensor) -> torch.Tensor:
    """Per sample-channel 256-bin histograms, int64 ``[N, C, 256]``, by one scatter-add (no host sync)."""
    n, c, h, w = x.shape
    offset = (torch.arange(n * c, device=x.device) * 256).view(n * c, 1)
    bins = (x.reshape(n * c, h * w).long() + offset).view(-1)
    hist = torch.zeros(n * c * 256, dtype=torch.int64, device=x.device)
    hist.scatter_add_(0, bins, torch.ones((), dtype=torch.int64, device=x.device).expand(bins.numel()))
    return hist.view(n, c, 256)


def _point(x: torch.Tensor, codes: torch.Tensor, arg: torch.Tensor, needs_histogram: bool) -> torch.Tensor:
    """Point ops as one lookup table per sample-channel (:func:`point_tables`), applied."""
    n, c, h, w = x.shape
    lut = point_tables(x, codes, arg, needs_histogram)
    out = lut.reshape(n * c, 256).gather(1, x.reshape(n * c, h * w).long())
    return out.to(torch.uint8).view(n, c, h, w)


def point_tables(x: torch.Tensor, codes: torch.Tensor, arg: torch.Tensor, needs_histogram: bool) -> torch.Tensor:
    """Per sample-channel 256-entry lookup tables, int64 ``[N, C, 256]``, of the point ops ``codes`` (any other
    code: the identity): Invert, Posterize (bits kept; <= 0 bits: black, >= 8: unchanged), Solarize (threshold),
    SolarizeAdd (add below 128, capped at 255), and from histograms of ``x`` ImageOps.autocontrast (min/max
    stretch, truncated) and ImageOps.equalize (PIL's step rule)."""
    n, c, h, w = x.shape
    k = codes.view(n, 1, 1)
    a = arg.view(n, 1, 1)
    v = torch.arange(256, device=x.device, dtype=torch.int64).view(1, 1, 256)
    lut = v.expand(n, c, 256)
    lut = torch.where(k == _INVERT, 255 - v, lut)
    shift = 8 - a.long().clamp(0, 8)
    lut = torch.where(k == _POSTERIZE, v & -torch.bitwise_left_shift(torch.ones_like(shift), shift), lut)
    lut = torch.where(k == _SOLARIZE, torch.where(v < a, v, 255 - v), lut)
    lut = torch.where(k == _SOLARIZE_ADD, torch.where(v < 128, (v + a.long()).clamp(max=255), v), lut)
    if needs_histogram:
        hist = _histogram(x)
        present = hist > 0
        lo = present.int().argmax(dim=-1, keepdim=True)                      # first non-empty bin
        hi = 255 - present.flip(-1).int().argmax(dim=-1, keepdim=True)       # last non-empty bin
        span = (hi - lo).clamp(min=1).double()
        scale = _div(torch.full_like(span, 255.0), span)
        stretched = torch.trunc(v.double() * scale + (-lo.double() * scale)).clamp(0, 255).long()
        lut = torch.where((k == _AUTOCONTRAST) & (hi > lo), stretched, lut)
        # equalize: step = (pixels - count of the last non-empty bin) // 255, lut[i] = (step // 2 + sum h[<i]) // step
        last = hist.gather(-1, hi)
        step = (h * w - last) // 255
        before = hist.cumsum(-1) - hist
        equalized = ((step // 2 + before) // step.clamp(min=1)).clamp(max=255)
        usable = (present.sum(-1, keepdim=True) > 1) & (step > 0)
        lut = torch.where((k == _EQUALIZE) & usable, equalized, lut)
    return lut


def _cubic(v1, v2, v3, v4, d):
    """PIL Geometry.c's bicubic (a = -1) through four taps at fractional offset d."""
    p2 = -v1 + v3
    p3 = 2 * (v1 - v2) + v3 - v4
    p4 = -v1 + v2 - v3 + v4
    return v2 + d * (p2 + d * (p3 + d * p4))


def _affine(x: torch.Tensor, matrix: torch.Tensor, mode: int, fill: torch.Tensor) -> torch.Tensor:
    """PIL's affine ``Image.transform`` with ``fillcolor``: output pixel centres mapped by ``matrix`` ([N, 6],
    PIL data order); sources outside [0, W) x [0, H) take ``fill``; inside, taps are clamped to the border.
    Nearest takes the pixel under the point; bilinear and bicubic (a = -1) interpolate between pixel centres,
    then truncate to uint8 (bicubic clipped to [0, 255] first).  Computed in float64 as PIL does: float32
    moves ~1 % of the pixels of a fractional translation across an integer and so one level."""
    n, c, h, w = x.shape
    m = matrix.double().view(n, 6, 1, 1)
    xs = (torch.arange(w, device=x.device, dtype=torch.float64) + 0.5).view(1, 1, w)
    ys = (torch.arange(h, device=x.device, dtype=torch.float64) + 0.5).view(1, h, 1)
    sx = m[:, 0] * xs + m[:, 1] * ys + m[:, 2]          # [N, H, W] source coordinates, pixel units
    sy = m[:, 3] * xs + m[:, 4] * ys + m[:, 5]
    inside = (sx >= 0) & (sx < w) & (sy >= 0) & (sy < h)
    src = x.reshape(n, c, h * w).double()

    def tap(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
        index = (row.clamp(0, h - 1) * w + col.clamp(0, w - 1)).view(n, 1, h * w).expand(n, c, h * w)
        return src.gather(2, index).view(n, c, h, w)

    if mode == _NEAREST:
        value = tap(sy.floor().long(), sx.floor().long())
    else:
        fx, fy = sx - 0.5, sy - 0.5
        x0, y0 = fx.floor(), fy.floor()
        dx, dy = (fx - x0).unsqueeze(1), (fy - y0).unsqueeze(1)
        x0, y0 = x0.long(), y0.long()
        if mode == _BILINEAR:
            top = tap(y0, x0)
            top = top + (tap(y0, x0 + 1) - top) * dx
            bottom = tap(y0 + 1, x0)
            bottom = bottom + (tap(y0 + 1, x0 + 1) - bottom) * dx
            value = (top + (bottom - top) * dy).floor_()
        else:
            rows = [_cubic(*(tap(y0 + r - 1, x0 + i - 1) for i in range(4)), dx) for r in range(4)]
            value = _cubic(*rows, dy).clamp_(0, 255).floor_()
    out = torch.where(inside.unsqueeze(1), value, fill.double().view(1, c, 1, 1))
    return out.to(torch.uint8)


# hsv2rgb's output per sector i = 0..5 as indices into (v, p, q, t): R, G and B rows
_HSV_PICK = ((0, 2, 1, 1, 3, 0), (3, 0, 0, 2, 1, 1), (1, 1, 3, 0, 0, 2))
_HSV_PICK_PACKED = tuple(sum(k << (2 * i) for i, k in enumerate(row)) for row in _HSV_PICK)


def _hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """torchvision's PIL ``adjust_hue``: PIL RGB -> HSV (uint8), H + shift mod 256, HSV -> RGB, following
    Pillow's Convert.c float / double steps."""
    n = x.shape[0]
    xi = x.to(torch.int32)
    r, g, b = xi[:, 0], xi[:, 1], xi[:, 2]
    maxc = torch.maximum(r, torch.maximum(g, b))
    minc = torch.minimum(r, torch.minimum(g, b))
    gray = maxc == minc
    cr = (maxc - minc).float()
    cr_safe = torch.where(gray, torch.ones_like(cr), cr)
    sat = cr / maxc.float().clamp(min=1.0)
    rc, gc, bc = ((maxc - r).float() / cr_safe, (maxc - g).float() / cr_safe, (maxc - b).float() / cr_safe)
    hue = torch.where(r == maxc, (bc - gc).double(),
                      torch.where(g == maxc, 2.0 + rc.double() - bc.double(), 4.0 + gc.double() - rc.double()))
    hue = hue.float().double()                                     # C stores h as float
    hue = torch.fmod(_div(hue, 6.0) + 1.0, 1.0).float().double()
    uh = torch.where(gray, 0, torch.trunc(hue * 255.0).long().clamp(0, 255))
    us = torch.where(gray, 0, torch.trunc(sat.double() * 255.0).long().clamp(0, 255))
    uv = maxc.long()
    uh = (uh + shift.view(n, 1, 1)) % 256
    # HSV -> RGB
    hh = _div(uh.double() * 6.0, 255.0)
    sector = torch.floor(hh)
    frac = (hh - sector).float()
    fs = _div(us.double(), 255.0).float()
    vd = uv.double()

    def rounded(t):
        return torch.floor(t + 0.5).clamp(0, 255).long()       # C round() of a non-negative double

    p = rounded(vd * (1.0 - fs.double()))
    q = rounded(vd * (1.0 - (fs * frac).double()))
    t = rounded(vd * (1.0 - fs.double() * (1.0 - frac.double())))
    parts = torch.stack((uv, p, q, t), dim=1)                      # [N, 4, H, W]
    # Convert.c's switch on i % 6: channel c takes parts[_HSV_PICK[c][i]], with each channel's six indices
    # packed as 2-bit fields of one integer (no table tensor to copy to the device)
    sector = (sector.long() % 6).unsqueeze(1)
    fields = torch.cat([torch.bitwise_right_shift(torch.full_like(sector, code), 2 * sector) & 3
                        for code in _HSV_PICK_PACKED], dim=1)      # [N, 3, H, W]
    rgb = parts.gather(1, fields)
    rgb = torch.where((us == 0).unsqueeze(1), uv.unsqueeze(1).expand_as(rgb), rgb)
    return rgb.to(torch.uint8)


# ---------------------------------------------------------------------------------------------------------------
# public transform
# ---------------------------------------------------------------------------------------------------------------
class GPUAugment:
    """timm ``transforms_imagenet_train``'s flips, RandAugment and ColorJitter on uint8 ``[B, 3, H, W]`` batches.

    Args:
        hflip, vflip: per-sample flip probabilities (timm applies hflip, then vflip, then the rest).
        auto_augment: a RandAugment config string (``'rand-m9-mstd0.5-inc1'``, see :func:`parse_rand_augment`)
            or None.  Other timm auto-augment kinds (AutoAugment policies, AugMix) are refused.
        color_jitter: timm's ``color_jitter`` (a number s -> brightness = contrast = saturation = s, or 3/4
            values); as in timm it is off while ``auto_augment`` is set, unless ``force_color_jitter`` or the
            config has '3a'.
        mean: the normalisation mean; RandAugment's fill for pixels uncovered by an affine op is
            ``min(255, round(255 * mean))`` per channel, as timm's ``img_mean`` hparam.
        interpolation: 'random' (bilinear or bicubic per geometric op, timm's default) or 'nearest' /
            'bilinear' / 'bicubic'.
        color_jitter_prob: timm's optional ``RandomApply`` probability around ColorJitter.
        force_color_jitter: keep ColorJitter with RandAugment (timm's flag).

    ``aug(images, generator)`` returns a new uint8 batch of the same shape; ``images`` is not modified.
    ``draw`` + ``apply`` are the same in two steps (the parameters are host tensors, see :class:`AugmentParams`).
    """

    def __init__(self, hflip: float = 0.5, vflip: float = 0.0, auto_augment: Optional[str] = None,
                 color_jitter=0.4, mean: Sequence[float] = IMAGENET_DEFAULT_MEAN, interpolation: str = "random",
                 color_jitter_prob: Optional[float] = None, force_color_jitter: bool = False):
        for name, value in (("hflip", hflip), ("vflip", vflip)):
            if not isinstance(value, Real) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}: expected a probability in [0, 1], got {value!r}")
        _check_interpolation(interpolation)
        if (isinstance(mean, str) or not isinstance(mean, Sequence) or len(mean) != 3
                or not all(isinstance(m, Real) and math.isfinite(m) and m >= 0 for m in mean)):
            raise ValueError(f"mean: expected 3 non-negative numbers (RGB), got {mean!r}")
        if auto_augment is not None and not isinstance(auto_augment, str):
            raise ValueError(f"auto_augment: expected None or a config string, got {auto_augment!r}")
        self.hflip, self.vflip = float(hflip), float(vflip)
        self.interpolation = interpolation
        self.fill = tuple(min(255, round(255 * float(m))) for m in mean)
        self.rand_augment = parse_rand_augment(auto_augment, interpolation) if auto_augment else None
        # timm: color jitter is typically disabled with auto-augment, unless forced or a '3a' config
        jitter_off = bool(auto_augment) and not (force_color_jitter or "3a" in auto_augment)
        spec = parse_color_jitter(color_jitter, color_jitter_prob)
        self.color_jitter = None if jitter_off else spec

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(hflip={self.hflip}, vflip={self.vflip}, rand_augment={self.rand_augment}, "
                f"color_jitter={self.color_jitter}, fill={self.fill}, interpolation={self.interpolation!r})")

    def draw(self, batch_size: int, image_size: tuple, generator: Optional[torch.Generator] = None
             ) -> AugmentParams:
        """All of a batch's random parameters, drawn on the host from ``generator`` (a CPU generator)."""
        generator = _check_generator(generator)
        flips = torch.rand((2, int(batch_size)), generator=generator)
        ra = cj = None
        if self.rand_augment is not None:
            ra = draw_rand_augment(self.rand_augment, batch_size, generator, image_size)
        if self.color_jitter is not None:
            cj = draw_color_jitter(self.color_jitter, batch_size, generator)
        return AugmentParams(image_size=tuple(image_size), hflip=flips[0] < self.hflip, vflip=flips[1] < self.vflip,
                             rand_augment=ra, color_jitter=cj)

    def plan(self, params: AugmentParams) -> list:
        """The batched passes for ``params`` in timm's order: flips, RandAugment layers, ColorJitter."""
        h, w = params.image_size
        steps = []
        for kind, mask in (("hflip", params.hflip), ("vflip", params.vflip)):
            index = mask.nonzero().flatten()
            if index.numel():
                steps.append(_Step(kind, index, ()))
        if params.rand_augment is not None:
            steps += _rand_augment_steps(self.rand_augment, params.rand_augment, h, w)
        if params.color_jitter is not None:
            steps += _color_jitter_steps(params.color_jitter)
        return steps

    def apply(self, images: torch.Tensor, params: AugmentParams, kernels: Optional[bool] = None) -> torch.Tensor:
        """Runs the drawn augmentation on ``images`` (uint8 [B, 3, H, W], any device).

        ``kernels``: flips and RandAugment as one Triton launch per layer
        (:mod:`namodels.data.gpu_augment_kernel`, the same arithmetic) instead of the batched torch ops; by
        default on CUDA batches where Triton is installed.  ColorJitter always takes the torch ops."""
        _check_images(images)
        if tuple(images.shape[2:]) != tuple(params.image_size) or params.hflip.numel() != images.shape[0]:
            raise ValueError(f"images: shape {tuple(images.shape)} does not match the drawn parameters "
                             f"(batch {params.hflip.numel()}, size {params.image_size})")
        from . import gpu_augment_kernel

        if kernels is None:
            kernels = images.device.type == "cuda" and gpu_augment_kernel.available()
        if kernels:
            images = gpu_augment_kernel.apply_layers(self, images, params)
            steps = _color_jitter_steps(params.color_jitter) if params.color_jitter is not None else []
            return self._run(images, steps) if steps else images
        steps = self.plan(params)
        if not steps:
            return images.clone()
        return self._run(images, steps)

    def _run(self, images: torch.Tensor, steps: list) -> torch.Tensor:
        # one host -> device copy per dtype for every index and parameter tensor of the call
        host = [torch.tensor(self.fill, dtype=torch.float32)]
        for step in steps:
            host += [step.index, *step.tensors]
        on_device = iter(_to_device(host, images.device))
        fill = next(on_device)
        out = images.clone()
        for step in steps:
            index = next(on_device)
            tensors = [next(on_device) for _ in step.tensors]
            sub = out.index_select(0, index)
            if step.kind == "hflip":
                sub = sub.flip(-1)
            elif step.kind == "vflip":
                sub = sub.flip(-2)
            elif step.kind == _LUT:
                sub = _point(sub, tensors[0], tensors[1], step.static)
            elif step.kind == _BLEND:
                sub = _blend(sub, tensors[0], tensors[1], step.static)
            elif step.kind == _GEO:
                sub = _affine(sub, tensors[0], step.static, fill)
            else:
                sub = _hue(sub, tensors[0])
            out.index_copy_(0, index, sub)
        return out

    def __call__(self, images: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        _check_images(images)
        return self.apply(images, self.draw(images.shape[0], tuple(images.shape[2:]), generator))


def _check_images(images) -> None:
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4 \
            or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        dtype = images.dtype if isinstance(images, torch.Tensor) else ""
        raise ValueError(f"images: expected a uint8 [B, 3, H, W] batch, got {dtype} {shape}")
