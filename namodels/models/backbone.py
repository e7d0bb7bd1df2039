"""timm model conventions shared by NAT / DiNAT (``levels``) and DiNAT_s (``layers``).

Both are hierarchical channels-last backbones: stem -> 4 stages (blocks, then a downsampler at the
*end* of stages 0-2, as in the official code) -> ``norm`` -> global average pool -> ``head``.

* ``forward_features`` returns the normalised last stage **channels-last** ``[B, H/32, W/32, C]``
  (``model.output_fmt == 'NHWC'``, like timm's Swin);
* ``forward_intermediates`` / ``features_only=True`` return the stage outputs *before* their
  downsampler, **NCHW** like other timm CNN-style backbones, at reductions 4, 8, 16, 32.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
from timm.models import checkpoint_seq
from timm.models._features import feature_take_indices  # not re-exported by timm.models in 1.0.x
from torch import nn

from . import tape
from .stage_casts import stage_casts
from .layers import NATBlock, refuse_scripting, stage_dilations

GLOBAL_POOLS = ("avg", "")


# --- argument checks shared by the model constructors (NAT, DiNAT_s, nat_digits, video, StyleNAT) ------------

def _flat(values):
    if isinstance(values, (list, tuple)):
        for v in values:
            yield from _flat(v)
    else:
        yield values


def check_kernel_sizes(kernel_size, name: str = "kernel_size") -> None:
    """Every window size (an int, or nested sequences of them) is a positive odd integer: a window
    centred on its query."""
    for k in _flat(kernel_size):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k % 2 == 0:
            raise ValueError(f"{name}: must be odd (a window centred on its query), got {k!r} in {kernel_size!r}")


def check_mlp_ratio(mlp_ratio) -> None:
    if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, (int, float)) or not mlp_ratio > 0:
        raise ValueError(f"mlp_ratio: must be > 0, got {mlp_ratio!r}")


def check_drop_path_rate(drop_path_rate) -> None:
    if isinstance(drop_path_rate, bool) or not isinstance(drop_path_rate, (int, float)) \
            or not 0 <= drop_path_rate < 1:
        raise ValueError(f"drop_path_rate: must be in [0, 1), got {drop_path_rate!r}")


def check_backend(backend) -> None:
    """``None`` (automatic / ``ops.use_backend``) or a registered NA backend name."""
    import ops

    known = ops.available_backends()
    if backend is not None and backend not in known:
        raise ValueError(f"backend: unknown backend {backend!r}; choose one of {sorted(known)} or None")


def check_model_arguments(*, kernel_size=None, kernel_name: str = "kernel_size", mlp_ratio=None,
                          drop_path_rate=None, backend=None) -> None:
    """The constructor checks of the NA models: ``ValueError`` naming the argument (arguments left
    ``None`` are not checked, except ``backend``, for which None is valid)."""
    if kernel_size is not None:
        check_kernel_sizes(kernel_size, kernel_name)
    if mlp_ratio is not None:
        check_mlp_ratio(mlp_ratio)
    if drop_path_rate is not None:
        check_drop_path_rate(drop_path_rate)
    check_backend(backend)


def check_batch(x: torch.Tensor, name: str = "x") -> None:
    """An empty batch fails here, by name, instead of deep inside the attention kernels."""
    if x.shape[0] == 0:
        raise ValueError(f"{name}: empty batch (0 samples) of shape {tuple(x.shape)}; drop empty batches before "
                         "the model")


class NAStage(nn.Module):
    """``blocks`` (run in sequence, optionally checkpointed) then ``downsample`` (Identity in the last stage)."""

    def __init__(self, blocks: List[nn.Module], downsample: Optional[nn.Module]):
        super().__init__()
        self.grad_checkpointing = False
        self.blocks = nn.Sequential(*blocks)
        self.downsample = downsample if downsample is not None else nn.Identity()

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.blocks, x)
        if torch.compiler.is_compiling() or not tape.ENABLED:
            return self.blocks(x)
        with stage_casts(self.blocks):  # eager: the taped blocks' weights cast in one copy
            return self.blocks(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.downsample(self.forward_blocks(x))


def build_stages(embed_dim: int, depths: Sequence[int], num_heads: Sequence[int], kernel_size: int, dilations,
                 downsampler: Callable[[int], nn.Module], drop_path_rate: float,
                 **block_kwargs) -> Tuple[List[int], nn.ModuleList]:
    """Stage widths (doubling from ``embed_dim``) and the stages: ``NATBlock``s with stochastic depth
    rising linearly over all blocks; every stage but the last ends in ``downsampler(width)``."""
    if len(depths) != len(num_heads):
        raise ValueError(f"num_heads: expected one entry per stage ({len(depths)}), got {list(num_heads)}")
    dilations = stage_dilations(depths, dilations)
    dims = [int(embed_dim * 2 ** i) for i in range(len(depths))]
    drop_path = torch.linspace(0, drop_path_rate, sum(depths), device="cpu").tolist()
    stages = []
    for i, depth in enumerate(depths):
        first = sum(depths[:i])
        blocks = [NATBlock(dims[i], num_heads[i], kernel_size, dilation=dilations[i][j], drop_path=drop_path[first + j],
                           **block_kwargs) for j in range(depth)]
        stages.append(NAStage(blocks, downsampler(dims[i]) if i < len(depths) - 1 else None))
    return dims, nn.ModuleList(stages)


class ClassifierHooks:
    """timm's classifier hooks of every classifier of the project: the classifier is ``self.head``, the
    gradient-checkpointing switch ``self.grad_checkpointing``."""

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable


class NABackbone(ClassifierHooks, nn.Module):
    """Mixin-style base: subclasses build ``patch_embed``, the stage list (named ``stage_attr``),
    ``norm`` and then call :meth:`_init_head`."""

    stage_attr = "levels"
    output_fmt = "NHWC"
    __prepare_scriptable__ = refuse_scripting  # torch.jit.script: an error naming the routes that work

    @property
    def stages(self) -> nn.ModuleList:
        return getattr(self, self.stage_attr)

    def _init_head(self, num_classes: int, global_pool: str, drop_rate: float):
        if global_pool not in GLOBAL_POOLS:
            raise ValueError(f"global_pool: expected one of {GLOBAL_POOLS}, got {global_pool!r}")
        if num_classes < 0:
            raise ValueError(f"num_classes: must be >= 0, got {num_classes}")
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.head_hidden_size = self.num_features
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.in_chans:
            raise ValueError(f"x: expected an image batch [B, {self.in_chans}, H, W], got {tuple(x.shape)}")
        check_batch(x)

    # --- classification -------------------------------------------------------------------------------
    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x = self.pos_drop(self.patch_embed(x))
        for stage in self.stages:
            x = stage(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(1, 2))
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def reset_classifier(self, num_classes: int, global_pool: Optional[str] = None) -> None:
        if global_pool is not None:
            if global_pool not in GLOBAL_POOLS:
                raise ValueError(f"global_pool: expected one of {GLOBAL_POOLS}, got {global_pool!r}")
            self.global_pool = global_pool
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()

    # --- training helpers -------------------------------------------------------------------------------
    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        super().set_grad_checkpointing(enable)
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def no_weight_decay(self) -> set:
        """Full names of the parameters to exclude from weight decay: relative positional biases, and
        every 1-D parameter (norm weights and biases, linear/conv biases, layer-scale gammas)."""
        return {name for name, p in self.named_parameters() if p.ndim <= 1 or name.endswith(".rpb")}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups in depth order (for layer-wise lr decay): stem, then each block; a stage's
        downsampler comes after its blocks; the final norm joins the last group."""
        s = self.stage_attr
        return dict(
            stem=r"^patch_embed",
            blocks=rf"^{s}\.(\d+)" if coarse else [
                (rf"^{s}\.(\d+)\.blocks\.(\d+)", None),
                (rf"^{s}\.(\d+)\.downsample", (99998,)),
                (r"^norm", (99999,)),
            ],
        )

    # --- features ---------------------------------------------------------------------------------------
    def _build_feature_info(self, dims: List[int]) -> None:
        self.feature_info = [
            dict(num_chs=d, reduction=4 * 2 ** i, module=f"{self.stage_attr}.{i}") for i, d in enumerate(dims)
        ]

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]]]:
        """Stage outputs (before each stage's downsampler) as NCHW (or NHWC) tensors.

        Args:
            indices: take the last n stages if int, all if None, these stages if a sequence.
            norm: apply the final norm to the last stage's output (it is sized for that stage only).
            stop_early: stop after the last requested stage.
            output_fmt: 'NCHW' (default, like timm's CNNs) or 'NHWC' (the models' own layout).
            intermediates_only: return only the list of intermediates.
        Returns:
            the intermediates, or ``(final normalised NHWC features, intermediates)``.
        """
        if output_fmt not in ("NCHW", "NHWC"):
            raise ValueError(f"output_fmt: expected 'NCHW' or 'NHWC', got {output_fmt!r}")
        self._check_input(x)
        stages = self.stages
        take_indices, max_index = feature_take_indices(len(stages), indices)
        last = len(stages) - 1
        if not torch.jit.is_scripting() and stop_early:
            stages = stages[: max_index + 1]
        intermediates = []
        x = self.pos_drop(self.patch_embed(x))
        for i, stage in enumerate(stages):
            x = stage.forward_blocks(x)
            if i in take_indices:
                y = self.norm(x) if norm and i == last else x
                intermediates.append(y.permute(0, 3, 1, 2).contiguous() if output_fmt == "NCHW" else y)
            x = stage.downsample(x)
        if intermediates_only:
            return intermediates
        if len(stages) == last + 1:
            x = self.norm(x)
        return x, intermediates

    def prune_intermediate_layers(
        self, indices: Union[int, List[int]] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> List[int]:
        """Drops the stages after the last requested one (and the head / final norm if asked)."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        prune_end = max_index < len(self.stages) - 1
        kept = self.stages[: max_index + 1]
        if prune_end:
            kept[-1].downsample = nn.Identity()  # its output is never used
        setattr(self, self.stage_attr, kept)
        if prune_norm or prune_end:
            self.norm = nn.Identity()  # sized for the last stage only
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices
