"""Run code written for NATTEN on our operators: ``ops.natten_compat.install()`` makes ``import natten`` give this
package's NATTEN-compatible modules.

What ``import natten`` then offers (:mod:`ops.natten_compat.package`):

* ``natten.functional``: NATTEN 0.14-0.17's functions: the unfused ``na{1,2,3}d_qk`` / ``na{1,2,3}d_av``
  (heads-first, relative positional bias, dilation, causal, additional keys and values), the fused
  ``na{1,2,3}d`` of 0.17 (heads-last, with ``rpb``), and the older ``natten{1,2,3}dqkrpb`` / ``natten{1,2,3}dqk`` /
  ``natten{1,2,3}dav`` (:mod:`ops.natten_compat.functional`);
* ``natten.NeighborhoodAttention1D/2D/3D``: the 0.17 modules with their constructor arguments and parameter names, so
  their state dicts load (:mod:`ops.natten_compat.modules`);
* ``natten.na1d/na2d/na3d``: the current API (>= 0.20: heads-last, stride, additional keys and values,
  ``return_lse``);
* the 0.17 switches (``use_fused_na``, ``use_kv_parallelism_in_fused_na``, ``use_autotuner``, ...) and queries
  (``has_cuda``, ``has_fused_na``, ...): they choose nothing here (our automatic backend selection does), so they
  are accepted and logged at debug level; the queries answer for this machine.

The modules run on every backend of ``ops`` (CPU included), with autograd and under ``torch.compile``.
``importlib.metadata.version("natten")`` reports :data:`VERSION` while installed, so availability checks such as
Hugging Face transformers' accept it (transformers reads it when it is first imported: install first).

``install()`` refuses to shadow a real NATTEN installation (one found on ``sys.path`` or by ``importlib.metadata``)
unless asked to (``replace=True``, with a warning); ``uninstall()`` removes what it added.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import logging
import sys
import warnings

log = logging.getLogger(__name__)

VERSION = "0.17.4"  # the last release with both the 0.17 API and the older names (0.17.5 dropped them)
MODULES = {"natten": "ops.natten_compat.package", "natten.functional": "ops.natten_compat.functional",
           "natten.context": "ops.natten_compat.package"}

__all__ = ["VERSION", "install", "uninstall", "installed"]


class _Distribution(importlib.metadata.Distribution):
    """The metadata ``importlib.metadata`` reports for ``natten`` while the layer is installed."""

    def read_text(self, filename):
        if filename in ("METADATA", "PKG-INFO"):
            return (f"Metadata-Version: 2.1\nName: natten\nVersion: {VERSION}\n"
                    "Summary: NATTEN-compatible layer of namodels' ops (ops.natten_compat)\n")
        return None

    def locate_file(self, path):
        return path


class _MetadataFinder(importlib.abc.MetaPathFinder):
    """Finds no modules (they are placed in ``sys.modules``); answers ``importlib.metadata`` for ``natten``."""

    def find_spec(self, fullname, path=None, target=None):
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if context.name is None or context.name.lower().replace("-", "_") == "natten":
            yield _Distribution()


_FINDER: _MetadataFinder | None = None


def installed() -> bool:
    return _FINDER is not None


def _real_natten() -> str | None:
    """Where a real NATTEN is installed (its package folder or distribution), else None."""
    spec = importlib.machinery.PathFinder.find_spec("natten")
    if spec is not None:
        return spec.origin or str(list(spec.submodule_search_locations or []))
    try:
        dist = importlib.metadata.distribution("natten")
    except importlib.metadata.PackageNotFoundError:
        return None
    return None if isinstance(dist, _Distribution) else f"distribution natten {dist.version}"


def install(replace: bool = False) -> None:
    """Make ``import natten`` (and ``natten.functional``, ``natten.context``) give this layer, and report
    ``natten`` :data:`VERSION` to ``importlib.metadata``.  A real NATTEN found on the path is an error, or with
    ``replace=True`` a warning, and is shadowed in this process only.  Calling it again does nothing."""
    global _FINDER
    if _FINDER is not None:
        return
    real = _real_natten()
    loaded = sys.modules.get("natten")
    if loaded is not None and not getattr(loaded, "_IS_NAMODELS_COMPAT", False):
        real = real or getattr(loaded, "__file__", "an imported natten module")
    if real is not None:
        message = (f"ops.natten_compat.install(): NATTEN is installed ({real}); the compatibility layer would "
                   "shadow it. Uninstall it, or pass replace=True to use the layer in this process anyway")
        if not replace:
            raise RuntimeError(message)
        warnings.warn(message.replace("would shadow", "shadows"), RuntimeWarning, stacklevel=2)
    for name, target in MODULES.items():
        sys.modules[name] = importlib.import_module(target)
    _FINDER = _MetadataFinder()
    sys.meta_path.insert(0, _FINDER)
    log.debug("natten %s served by ops.natten_compat", VERSION)


def uninstall() -> None:
    """Undo :func:`install`: ``import natten`` finds whatever is on the path again."""
    global _FINDER
    if _FINDER is None:
        return
    for name in MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "_IS_NAMODELS_COMPAT", False):
            del sys.modules[name]
    sys.meta_path.remove(_FINDER)
    _FINDER = None
