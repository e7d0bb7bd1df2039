"""Backend registry and selection.

A backend is a module-level object with

* ``name``: its registry name;
* ``unsupported(problem) -> str | None``: why it cannot serve a problem (``None`` = it can);
* optionally ``debug_only(problem) -> bool``: it can serve the problem but only for debugging
  (e.g. Triton's interpreter on CPU), so automatic selection passes it over;
* ``attention(q, k, v, params, rpb, scale, need_lse=True) -> (out, lse)``: neighborhood attention on
  validated heads-last inputs, ``out [B, *spatial, H, Dv]`` in the input dtype, ``lse
  [B, *spatial, H]`` in float32 (float64 for float64 inputs), both differentiable.  ``need_lse=False``
  says the caller will not use lse (a call without ``return_lse`` or extra keys): a backend may skip
  computing it and return ``None`` (the fused forward then skips its store, a sizeable part of a dilated forward);
* optionally ``functorch_transforms``: the ``torch.func`` transforms its kernels serve (``"vmap"``); calls under any
  other, and forward-mode AD, run ``ops.autodiff.reference_attention`` instead, and its backward is wrapped in
  ``ops.autodiff.second_order`` (a backward with ``create_graph=True`` recomputes through that reference);
* optionally ``attention_qkvpacked(qkv, params, rpb, scale, need_lse=True)``: the same on packed
  ``qkv [B, *spatial, 3, H, D]`` (``ops.neighborhood_attention_qkvpacked``), for backends whose backward writes the
  packed gradient directly; the others get ``qkv.unbind(-3)``;
* optionally ``traced_attention(q, k, v, params, rpb, scale) -> (out, lse)``: the forward as plain tensor ops, what
  a call runs while it is recorded into a graph (``tracing()``: ``torch.export``, ``torch.onnx.export``,
  ``torch.jit.trace``): no autograd.Function (the TorchScript-based ONNX exporter drops in-place writes inside
  one), no Python decision on tensor values, index tables as constants, chunks sized without the example's batch
  size (so that the graph serves any batch).  Only backends with it are chosen automatically while tracing.

Every registered backend is imported once when ``ops`` is imported (``load_all``), so that code
traced by ``torch.compile`` never meets an import (dynamo cannot trace one: each would split the
graph); a missing optional dependency (e.g. Triton) only disables the backend that needs it.
``backend=None`` takes the first backend in ``PREFERENCE`` that serves the problem (while tracing, the first that
also has ``traced_attention``); the reasons others were rejected go to the ``ops.backends`` debug log.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .window import NAParams

log = logging.getLogger(__name__)

# name -> module path holding a `BACKEND` object
_REGISTRY: dict[str, str] = {
    "naive": "ops.naive",
    "gemm": "ops.gemm",
    "fused": "ops.fused",
    "flex": "ops.flex",
}
# Fastest first.  `naive` is last: it serves every problem.
PREFERENCE: tuple[str, ...] = ("fused", "gemm", "flex", "naive")

_state = threading.local()


def run_on_token_rows(apply, q, k, v, rpb, params: NAParams, scale: float):
    """Runs ``apply(q, k, v, rpb, params, scale) -> (out, lse)`` on ``[B, N, H, D]`` views of
    heads-last ``[B, *spatial, H, D]`` inputs and gives (out, lse) their spatial shape back: the
    layout glue of the backends whose kernels index flat token rows."""
    b, hq, n = q.shape[0], q.shape[-2], params.num_tokens
    flat = lambda t: t.reshape(b, n, t.shape[-2], t.shape[-1])  # noqa: E731
    out, lse = apply(flat(q), flat(k), flat(v), rpb, params, scale)
    spatial = q.shape[1:-2]
    return out.reshape(b, *spatial, hq, v.shape[-1]), lse.reshape(b, *spatial, hq)


def tracing() -> bool:
    """Whether NA calls are being recorded into a graph that later runs without this Python code: ``torch.export``
    (also under ``torch.onnx.export(dynamo=True)``) or ``torch.jit.trace`` (also under the TorchScript-based
    ``torch.onnx.export(dynamo=False)``).  ``torch.compile`` is not tracing here: it keeps the eager backends.

    Under dynamo the export flag is read directly: some torch releases (2.11 among them) fold
    ``torch.compiler.is_exporting()`` to True in every dynamo trace, which would send plain ``torch.compile`` runs
    down the traced routes (no fused kernels, a graph break per call).  The flag is what ``torch.export`` sets, and
    dynamo guards on the module global it reads."""
    if torch.compiler.is_dynamo_compiling():
        return bool(getattr(torch.compiler, "_is_exporting_flag", False))
    return torch.jit.is_tracing() or torch.compiler.is_exporting()


@contextlib.contextmanager
def constant_tensors():
    """Tensors made in the block are real and unrecorded, whatever traces the call (fake tensors and proxies of
    ``torch.export``, the recorder of ``torch.jit.trace``): index tables built here enter a traced graph as
    constants, instead of as the ops that built them, and can be cached for later eager calls."""
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)
    try:
        with _disable_current_modes():
            yield
    finally:
        torch._C._set_tracing_state(state)


@dataclass(frozen=True)
class Problem:
    """What a backend needs to decide whether it can run."""

    params: NAParams
    dtype: torch.dtype
    device: torch.device
    head_dim: int
    value_dim: int
    heads_q: int
    heads_kv: int
    has_rpb: bool
    requires_grad: bool


def available_backends() -> tuple[str, ...]:
    return tuple(_REGISTRY)


# name -> loaded backend object.  Besides saving the import per call, the cache lets
# torch.compile(fullgraph=True) trace NA calls (dynamo cannot trace importlib.import_module, but it
# can trace this dict lookup).
_LOADED: dict[str, object] = {}


def register_backend(name: str, module_path: str) -> None:
    """Adds a backend (a module exposing ``BACKEND``) to the registry and imports it."""
    _REGISTRY[name] = module_path
    _LOADED.pop(name, None)
    load_backend(name)


def load_all() -> None:
    """Imports every registered backend (``import ops`` does this once)."""
    for name in _REGISTRY:
        load_backend(name)


def load_backend(name: str):
    if name not in _REGISTRY:
        raise ValueError(f"backend: unknown backend {name!r}; choose one of {sorted(_REGISTRY)} or None")
    backend = _LOADED.get(name)
    if backend is None:
        backend = _LOADED[name] = _import_backend(name)
    return backend


def _import_backend(name: str):
    try:
        module = importlib.import_module(_REGISTRY[name])
    except ImportError as err:  # e.g. triton missing: the backend is unavailable, not broken
        return _Unavailable(name, f"cannot import {_REGISTRY[name]}: {err}")
    backend = getattr(module, "BACKEND", None)
    if backend is None:
        return _Unavailable(name, f"{_REGISTRY[name]} defines no BACKEND")
    return backend


class _Unavailable:
    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason

    def unsupported(self, problem: Problem) -> str | None:
        return self.reason


@contextlib.contextmanager
def use_backend(name: str | None):
    """Selects the backend for every NA call in the block (``None`` = automatic).

    >>> with ops.use_backend("naive"):
    ...     y = model(x)
    """
    if name is not None and name not in _REGISTRY:
        raise ValueError(f"backend: unknown backend {name!r}; choose one of {sorted(_REGISTRY)} or None")
    previous = getattr(_state, "backend", None)
    _state.backend = name
    try:
        yield
    finally:
        _state.backend = previous


def current_backend() -> str | None:
    """The backend selected by the innermost ``use_backend`` block, or ``None``."""
    return getattr(_state, "backend", None)


def select_backend(problem: Problem, requested: str | None):
    """Returns the backend object for a call; raises ``ValueError`` if the request cannot be met."""
    name = requested if requested is not None else current_backend()
    if name is not None:
        backend = load_backend(name)
        reason = backend.unsupported(problem)
        if reason is not None:
            if tracing() and not hasattr(backend, "traced_attention"):
                # the model may run eagerly where it is exported from (e.g. flex on a CPU without autograd),
                # so the reason alone does not say what to change for export
                reason += ("; to export, let NA layers record a traced form: backend=None or 'naive' "
                           "(a whole model's: namodels.set_backend(model, None))")
            raise ValueError(f"backend: {name!r} cannot serve this problem: {reason}")
        return backend
    rejected = []
    traced = tracing()
    for candidate in PREFERENCE:
        backend = load_backend(candidate)
        if traced and not hasattr(backend, "traced_attention"):
            rejected.append(f"{candidate}: has no traced forward (torch.export / ONNX / jit.trace)")
            continue
        reason = backend.unsupported(problem)
        if reason is None and getattr(backend, "debug_only", lambda p: False)(problem):
            reason = "debug-only on these inputs (e.g. Triton interpreter on CPU); request it explicitly"
        if reason is None:
            if rejected and not torch.compiler.is_compiling():  # (dynamo cannot trace a logger: logged eagerly)
                log.debug("NA backend %r chosen; rejected: %s", candidate, "; ".join(rejected))
            return backend
        rejected.append(f"{candidate}: {reason}")
    raise ValueError("backend: no backend can serve this problem: " + "; ".join(rejected))
