"""Checkpoint files: loaded as plain data only, written atomically beside their target.

Loading: every checkpoint or weights file goes through :func:`load_checkpoint_file`, which is
``torch.load(weights_only=True)``: tensors, containers and plain Python values, never code.  The
allowlist adds exactly what released StyleNAT files hold beside their weights: ``args`` as an
``argparse.Namespace`` and numeric numpy scalars (FID values in ``eval_info``).  A file holding
anything else is refused with a ``ValueError`` naming the file and the pickled type.

Saving: :func:`atomic_write` (used by :class:`AtomicCheckpointIO`, the Lightning plugin train.py installs, and
by the weight exports) writes to a temporary file in the target's own folder, fsyncs it, then renames it over
the target (``os.replace``) and fsyncs the folder.  A killed save leaves the previous file whole plus a
``.<name>.<random>.partial`` file, which :class:`ModelCheckpoint` removes when the next run starts.  Nothing
goes through ``$TMPDIR``, so its size and filesystem do not matter.  The file gets the mode any new file of
the process gets (``0o666`` less the umask, as ``open`` gives), not the ``0o600`` of ``tempfile.mkstemp`` or of
safetensors' ``save_file``: a checkpoint is as readable as the logs and metrics beside it.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import logging
import os
import pickle
import secrets
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".partial"


def _numeric_numpy_scalar(dtype, data=None):
    """``numpy.core.multiarray.scalar`` restricted to numbers: an object-dtype scalar built from raw bytes
    would be a pointer read from the file."""
    if not isinstance(dtype, np.dtype) or dtype.kind not in "biufc":
        raise pickle.UnpicklingError(f"numpy scalar of dtype {dtype!r} is not a plain number")
    core = np._core if hasattr(np, "_core") else np.core  # numpy 2 / numpy 1
    return core.multiarray.scalar(dtype, data)


# Non-tensor types that released StyleNAT checkpoints hold (our own Lightning checkpoints need none).
RELEASE_SAFE_GLOBALS = [
    argparse.Namespace,                                              # legacy ``args``
    (_numeric_numpy_scalar, "numpy.core.multiarray.scalar"),         # FID floats, numpy 1.x files
    (_numeric_numpy_scalar, "numpy._core.multiarray.scalar"),        # the same, numpy 2.x files
    np.dtype, type(np.dtype(np.float64)), type(np.dtype(np.float32)), type(np.dtype(np.int64)),
]


def _allowed_names() -> set[str]:
    names = set()
    for entry in RELEASE_SAFE_GLOBALS:
        names.add(entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}")
    return names


def _refused_globals(path) -> str:
    """The pickled globals of ``path`` outside the allowlist (read without unpickling anything)."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # e.g. a legacy (non-zip) file: the names cannot be listed without loading
        return "unknown"
    refused = sorted(set(found) - _allowed_names())
    return ", ".join(refused) or "unknown"


def load_checkpoint_file(path, map_location: Any = "cpu", name: str = "ckpt_path") -> dict:
    """``torch.load(path, weights_only=True)`` with the release allowlist; a file that holds other
    pickled objects (which could run code when unpickled) raises ``ValueError`` naming ``name`` and
    those objects' types."""
    with torch.serialization.safe_globals(RELEASE_SAFE_GLOBALS):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError:
            pass
    raise ValueError(
        f"{name}: {str(path)!r} holds pickled objects that are not plain data ({_refused_globals(path)}); it is "
        "not loaded, since unpickling them could run code. Re-save only its tensors (state dicts) from a "
        "trusted copy")


def fsync_directory(directory: str) -> None:
    """Makes a rename inside ``directory`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_partial(path: str) -> tuple[int, str]:
    """A new, empty temporary file beside ``path`` (``.<name>.<random>.partial``), opened for writing and
    created with mode ``0o666`` less the umask, as ``open`` creates files (``tempfile.mkstemp`` makes them
    ``0o600``)."""
    directory, name = os.path.split(path)
    for _ in range(100):
        partial = os.path.join(directory, f".{name}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
        try:
            return os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), partial
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary file name beside {path!r}")


@contextlib.contextmanager
def atomic_write(path) -> Iterator[str]:
    """Yields the path of a temporary file beside ``path`` for the block to write (the file exists, empty; a
    writer may also replace it).  When the block ends the file gets the mode a new file gets (a writer such as
    safetensors' ``save_file`` creates its own with ``0o600``), is fsynced and renamed over ``path``, and the
    folder is fsynced; if the block raises, the file is removed and ``path`` is left as it was."""
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, partial = _new_partial(path)
    try:
        mode = os.fstat(fd).st_mode & 0o777  # what the umask (and a default ACL) leave of 0o666
    finally:
        os.close(fd)
    try:
        yield partial
        os.chmod(partial, mode)
        fd = os.open(partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise
    fsync_directory(directory)


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save(obj, path)`` that never leaves ``path`` partly written (:func:`atomic_write`)."""
    with atomic_write(path) as partial, open(partial, "wb") as f:
        torch.save(obj, f)


def remove_partial_saves(directory: str) -> list[str]:
    """Deletes the temporary files of saves that were killed before their rename; returns them."""
    leftovers = glob.glob(os.path.join(glob.escape(directory), "." + "*" + PARTIAL_SUFFIX))
    for path in leftovers:
        os.remove(path)
        log.warning("removed %s, left by a checkpoint save that did not finish", path)
    return leftovers


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO: atomic saves in the target's folder, plain-data loads (see the module
    docstring).  Local paths only."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        atomic_save(checkpoint, path)

    def load_checkpoint(self, path, map_location: Optional[Callable] = "cpu",
                        weights_only: Optional[bool] = None) -> dict:
        # weights_only is always True here: a resumed run never unpickles code either.
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        return load_checkpoint_file(path, map_location=map_location)


class ModelCheckpoint(LightningModelCheckpoint):
    """Lightning's ModelCheckpoint that, when training starts, removes the leftovers of saves into its
    folder that were killed mid-way (a resumed run finds them beside its last.ckpt)."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if trainer.is_global_zero and self.dirpath and os.path.isdir(self.dirpath):
            remove_partial_saves(self.dirpath)
