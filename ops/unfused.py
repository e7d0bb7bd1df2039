"""Unfused neighborhood attention: the attention weights themselves, on demand.

Fused kernels never materialise the weights; these two operators do, so the weights can be inspected,
visualised, dropped out, or put through another normalisation:

* ``na_qk(rank, query, key, kernel_size, ...)`` -> logits ``[B, *spatial, H, prod(K)]``: entry ``t`` of a
  query is its dot product with the key in window slot ``t`` (slots row-major over the window offsets,
  exactly as ``ops.window.neighbor_table`` numbers them), plus the relative positional bias if given;
  slots past a causal query are ``-inf``.  No scale is applied: pre-scale the query.
* ``na_av(rank, attn, value, kernel_size, ...)`` -> ``[B, *spatial, H, Dv]``: weights times the values
  of the same slots (empty causal slots are ignored whatever ``attn`` holds there).

Both are differentiable and run on the ``gemm`` backend's PN / NN kernels (backward: PN / NN / IN); second
derivatives, forward mode and ``torch.func`` transforms go through their plain-op forms (``ops.autodiff``).
``softmax(na_qk(q * scale, k)) -> na_av`` equals ``ops.na2d(q, k, v)`` up to rounding.

Example: look at the weights of one query (``examples/attention_weights.py`` draws them as a PNG)::

    import torch, ops
    from ops.window import neighbor_table
    from ops.functional import make_params

    q = k = v = torch.randn(1, 32, 32, 2, 16)                      # [B, H, W, heads, dim]
    logits = ops.na2d_qk(q * 16 ** -0.5, k, kernel_size=7, dilation=2)   # [1, 32, 32, 2, 49]
    attn = logits.softmax(dim=-1)
    out = ops.na2d_av(attn, v, kernel_size=7, dilation=2)            # == ops.na2d(q, k, v, 7, dilation=2)

    # Where the 49 weights of query (5, 20), head 0, sit in the image:
    params = make_params((32, 32), 7, 1, 2, False)
    keys, valid, _ = neighbor_table(params, queries=torch.tensor([5 * 32 + 20]))
    heat = torch.zeros(32 * 32)
    heat[keys[0][valid[0]]] = attn[0, 5, 20, 0][valid[0]]
    heat = heat.reshape(32, 32)                                   # plot with matplotlib's imshow
"""
from __future__ import annotations

import math

import torch

from .autodiff import reference_reason
from .backends import log
from .functional import check_rpb, check_tensor_pair, window_params
from .gemm.autograd import AV, QK
from .naive import plain_av, plain_qk

__all__ = ["na_qk", "na_av", "na1d_qk", "na2d_qk", "na3d_qk", "na1d_av", "na2d_av", "na3d_av"]


def _check_pair(rank: int, first, second, names):
    """Shared checks of the (query, key) / (attn, value) pair, plus: no empty tensors."""
    check_tensor_pair(rank, first, second, names)
    if any(n == 0 for n in first.shape) or any(n == 0 for n in second.shape):
        raise ValueError(f"{names[0]}: empty tensors of shapes {tuple(first.shape)}, {tuple(second.shape)}")
    if first.shape[-2] % second.shape[-2] != 0:
        raise ValueError(
            f"heads: {names[1]} heads ({second.shape[-2]}) must divide {names[0]} heads ({first.shape[-2]}) (GQA/MQA)"
        )


@torch.compiler.disable  # Python-level tiling: torch.compile runs it eagerly (a graph break)
def _apply(function, *args):
    return function.apply(*args)


def _run(function, plain, *args):
    """``function`` (the gemm kernels), or under forward mode and ``torch.func`` transforms its plain-op form
    (``ops.autodiff``), which those differentiate exactly."""
    reason = reference_reason([a for a in args if isinstance(a, torch.Tensor)])
    if reason is not None:
        log.debug("na_qk / na_av run their plain-op form: %s", reason)
        return plain(*args)
    return _apply(function, *args)


def _flat(t: torch.Tensor, rank: int) -> torch.Tensor:
    """[B, *spatial, H, X] -> contiguous [B, N, H, X]."""
    return t.reshape(t.shape[0], math.prod(t.shape[1: rank + 1]), t.shape[-2], t.shape[-1]).contiguous()


def na_qk(rank: int, query, key, kernel_size, stride=1, dilation=1, is_causal=False, rpb=None):
    """Neighborhood logits ``[B, *spatial, H, prod(K)]`` of ``query`` against ``key`` (see module doc).

    ``query [B, *spatial, H, D]`` (pre-scaled), ``key [B, *spatial, H_kv, D]`` with ``H_kv`` dividing
    ``H``; ``rpb [H, 2K-1 per axis]`` (non-causal only) is added at each slot's relative position.
    """
    _check_pair(rank, query, key, ("query", "key"))
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"head dim: key head dim {key.shape[-1]} differs from query head dim {query.shape[-1]}")
    params = window_params(query, rank, kernel_size, stride, dilation, is_causal)
    check_rpb(rpb, query, params)
    logits = _run(QK, plain_qk, _flat(query, rank), _flat(key, rank), rpb, params)
    return logits.reshape(*query.shape[:-1], params.window_size)


def na_av(rank: int, attn, value, kernel_size, stride=1, dilation=1, is_causal=False):
    """Weights ``attn [B, *spatial, H, prod(K)]`` applied to ``value [B, *spatial, H_kv, Dv]``.

    Returns ``[B, *spatial, H, Dv]``; slot order as in ``na_qk``.
    """
    _check_pair(rank, attn, value, ("attn", "value"))
    params = window_params(attn, rank, kernel_size, stride, dilation, is_causal, name="attn")
    if attn.shape[-1] != params.window_size:
        raise ValueError(
            f"attn: last dim must be prod(kernel_size) = {params.window_size} (one weight per window slot), "
            f"got {attn.shape[-1]}"
        )
    out = _run(AV, plain_av, _flat(attn, rank), _flat(value, rank), params)
    return out.reshape(*attn.shape[:-1], value.shape[-1])


def _qk_doc(rank):
    return f"""{rank}-D neighborhood logits: ``na_qk({rank}, query, key, ...)`` (see ``ops.unfused``)."""


def _av_doc(rank):
    return f"""{rank}-D neighborhood weights times values: ``na_av({rank}, attn, value, ...)`` (see ``ops.unfused``)."""


def na1d_qk(query, key, kernel_size, stride=1, dilation=1, is_causal=False, rpb=None):
    return na_qk(1, query, key, kernel_size, stride, dilation, is_causal, rpb)


def na2d_qk(query, key, kernel_size, stride=1, dilation=1, is_causal=False, rpb=None):
    return na_qk(2, query, key, kernel_size, stride, dilation, is_causal, rpb)


def na3d_qk(query, key, kernel_size, stride=1, dilation=1, is_causal=False, rpb=None):
    return na_qk(3, query, key, kernel_size, stride, dilation, is_causal, rpb)


def na1d_av(attn, value, kernel_size, stride=1, dilation=1, is_causal=False):
    return na_av(1, attn, value, kernel_size, stride, dilation, is_causal)


def na2d_av(attn, value, kernel_size, stride=1, dilation=1, is_causal=False):
    return na_av(2, attn, value, kernel_size, stride, dilation, is_causal)


def na3d_av(attn, value, kernel_size, stride=1, dilation=1, is_causal=False):
    return na_av(3, attn, value, kernel_size, stride, dilation, is_causal)


na1d_qk.__doc__, na2d_qk.__doc__, na3d_qk.__doc__ = _qk_doc(1), _qk_doc(2), _qk_doc(3)
na1d_av.__doc__, na2d_av.__doc__, na3d_av.__doc__ = _av_doc(1), _av_doc(2), _av_doc(3)
