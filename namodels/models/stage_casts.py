"""The GEMM weights of a stage's blocks cast to the compute dtype together, in one multi-tensor copy.

Under autocast every block's GEMMs read bfloat16 / float16 casts of float32 weights.  Cast per tensor, that is one op
per weight and block; here a stage opens a scope (:func:`stage_casts`) and the first block that needs a cast in it
casts every block's weights in one multi-tensor copy, into a buffer kept per stage with each block's views into it,
so that a block's cast costs a lookup instead of an allocation, eight views and a copy.  The buffer is refilled in
place on the next call when nothing can still read it: the previous call's lease (a tensor every block saves for its
backward) is gone, the call runs on the same stream, and no CUDA graph is being captured (a graph keeps reading the
memory it captured).  Otherwise a new buffer is made.  Every call copies the current weights, so the casts follow any
change to them, ``.data`` writes included.
"""
from __future__ import annotations

import contextlib
import contextvars
import operator
import weakref
from dataclasses import dataclass
from typing import Callable
from weakref import WeakKeyDictionary

import torch
from torch import nn

STAGE_BUFFERS: WeakKeyDictionary = WeakKeyDictionary()  # blocks container -> _StageBuffer
_SCOPE: contextvars.ContextVar = contextvars.ContextVar("namodels_stage_casts", default=None)


@dataclass
class _StageBuffer:
    """A stage's cast buffer: the weights it holds casts of, and each block's views into it."""

    sources: list  # the weights cast, in order
    shapes: list
    stream: int | None
    views: list  # the casts, one per source
    views_of: dict  # block -> its views
    lease: object = None  # weakref to the last call's lease


class _Scope:
    __slots__ = ("blocks", "members", "lease", "dtype")

    def __init__(self, blocks):
        self.blocks, self.members, self.lease, self.dtype = blocks, None, None, None


@contextlib.contextmanager
def stage_casts(blocks: nn.Module):
    """Runs ``blocks`` (a container of blocks called in this scope) with their weight casts shared."""
    token = _SCOPE.set(_Scope(blocks))
    try:
        yield
    finally:
        _SCOPE.reset(token)


def cast(tensors, dtype):
    """The tensors in ``dtype``: one multi-tensor copy where torch's per-tensor casts would be one op each."""
    if all(t.dtype == dtype for t in tensors):
        return tensors
    # one allocation split into the casts (an allocation costs a few views' host time), each starting on a multiple
    # of 8 elements, so the GEMMs see aligned operands whatever the widths
    sizes = [-(-t.numel() // 8) * 8 for t in tensors]
    flat = torch.empty(sum(sizes), dtype=dtype, device=tensors[0].device)
    out = []
    for chunk, t in zip(flat.split(sizes), tensors):
        chunk = chunk if chunk.numel() == t.numel() else chunk[:t.numel()]
        out.append(chunk if t.dim() == 1 else chunk.view(t.shape))
    torch._foreach_copy_(out, list(tensors))
    return out


def _stream_of(t: torch.Tensor):
    return torch._C._cuda_getCurrentRawStream(t.get_device()) if t.is_cuda else None


def _fill_stage(blocks, dtype, device, gemm_weights: Callable) -> tuple[dict, object]:
    """``(block -> (its weights, their versions, their casts), lease)``: the GEMM weights (``gemm_weights(block)``,
    None for a block that casts none) of every block of ``blocks`` that needs a cast, cast in one copy into the
    stage's buffer (refilled in place where nothing can still read it)."""
    members, sources = {}, []
    for block in blocks._modules.values():
        weights = gemm_weights(block)
        if weights is None or weights[0].dtype == dtype or weights[0].device != device:
            continue
        members[block] = (weights, tuple([w._version for w in weights]))
        sources.extend(weights)
    if not sources:
        return {}, None
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    shapes = [w.shape for w in sources]
    stream = _stream_of(sources[0])
    buffer = STAGE_BUFFERS.get(blocks)
    # (a buffer made under torch.inference_mode can only be written there, and one made outside it not refilled there)
    reusable = (buffer is not None and not capturing and buffer.views[0].dtype == dtype and buffer.stream == stream
                and buffer.views[0].is_inference() == torch.is_inference_mode_enabled()
                and (buffer.lease is None or buffer.lease() is None) and len(buffer.sources) == len(sources)
                and all(map(operator.is_, buffer.sources, sources)) and buffer.shapes == shapes)
    if reusable:
        torch._foreach_copy_(buffer.views, sources)
    else:
        views = cast(sources, dtype)
        spans, start = {}, 0
        for block, (weights, _) in members.items():
            spans[block] = views[start:start + len(weights)]
            start += len(weights)
        buffer = _StageBuffer(sources, shapes, stream, views, spans)
        if not capturing:  # (memory a graph captured is not the eager calls' to reuse)
            STAGE_BUFFERS[blocks] = buffer
    lease = torch.empty(0)
    buffer.lease = weakref.ref(lease)
    return {block: (weights, versions, buffer.views_of[block]) for block, (weights, versions) in members.items()}, lease


def weight_casts(block, weights, dtype, gemm_weights: Callable) -> tuple[list, object]:
    """``(weights in dtype, the lease of the shared buffer they are views of, or None)``: from the stage's buffer
    inside :func:`stage_casts`, else cast here.  ``gemm_weights(block)`` gives any block's weights (for the stage's
    copy); the caller holds the lease for as long as something can read the casts."""
    scope = _SCOPE.get()
    if scope is not None:
        if scope.members is None or scope.dtype != dtype:
            scope.members, scope.lease = _fill_stage(scope.blocks, dtype, weights[0].device, gemm_weights)
            scope.dtype = dtype
        entry = scope.members.get(block)
        # (a hook outside the block's modules may have swapped or changed a weight since the stage's copy)
        if (entry is not None and all(map(operator.is_, entry[0], weights))
                and entry[1] == tuple([w._version for w in weights])):
            return entry[2], scope.lease
    return cast(weights, dtype), None
