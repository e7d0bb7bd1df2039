"""The neighborhood-attention backend of a whole model.

Every NA module keeps its kernel backend in a public ``backend`` attribute: ``None`` follows
``ops.use_backend`` (else the automatic choice), a name forces that backend for the module's calls
whatever the context says.  The NA modules are the ``ops.NeighborhoodAttention1D/2D/3D`` layers and their
subclasses (NAT / DiNAT / DiNAT_s layers, the video attention), plus the classes registered with
:func:`register_na_module` (StyleNAT's Hydra attention).

>>> import timm, namodels
>>> model = timm.create_model("nat_mini")
>>> namodels.set_backend(model, "gemm")          # every NA layer, from now on
>>> with namodels.set_backend(model, "naive"):   # inside the block only; restored on exit
...     y = model(x)
"""
from __future__ import annotations

from torch import nn

import ops

__all__ = ["NA_MODULE_TYPES", "na_modules", "register_na_module", "set_backend"]

NA_MODULE_TYPES: tuple[type, ...] = (ops.NeighborhoodAttention1D, ops.NeighborhoodAttention2D,
                                     ops.NeighborhoodAttention3D)


def register_na_module(cls: type) -> type:
    """Class decorator: instances of ``cls`` (an ``nn.Module`` whose ``backend`` attribute is passed to
    its NA calls) are NA modules for :func:`na_modules` and :func:`set_backend`."""
    global NA_MODULE_TYPES
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"cls: expected an nn.Module subclass, got {cls!r}")
    if cls not in NA_MODULE_TYPES:
        NA_MODULE_TYPES = NA_MODULE_TYPES + (cls,)
    return cls


def na_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for every NA module of ``model`` (``model`` itself included, name ``""``)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, NA_MODULE_TYPES)]


def _check_name(name) -> None:
    known = ops.available_backends()
    if name is not None and name not in known:
        raise ValueError(f"backend: unknown backend {name!r}; choose one of {sorted(known)} or None")


class set_backend:
    """Sets ``backend = name`` on every NA module of ``model`` (``None``: ``ops.use_backend`` or automatic).

    Called plainly, the setting stays.  Used as a context manager, the block also runs inside
    ``ops.use_backend(name)`` (for NA calls outside the modules) and every module gets its own backend
    back on exit, like ``torch.set_grad_enabled``.  ``len()`` is the number of modules set (0 for a model
    without neighborhood attention, which is left as it is).
    """

    def __init__(self, model: nn.Module, name: str | None):
        _check_name(name)
        self.name = name
        self._modules = [m for _, m in na_modules(model)]
        self._saved = [m.backend for m in self._modules]
        self._context = None
        for m in self._modules:
            m.backend = name

    def __len__(self) -> int:
        return len(self._modules)

    def __enter__(self) -> "set_backend":
        self._context = ops.use_backend(self.name)
        self._context.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._context.__exit__(*exc)
        finally:
            self._context = None
            for m, saved in zip(self._modules, self._saved):
                m.backend = saved
