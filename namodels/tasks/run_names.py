"""Run names that come from a checkpoint, for evaluations of one trained model (``eval.py task=generate``).

An evaluation's folder is ``logs/<task>/<run_name>/version_N``.  For images sampled from a generator, the data set
of ``eval.py``'s config (``digits`` by default) says nothing about them; the checkpoint's training run does.  The
resolver ``${ckpt_run_name:<path>,<fallback>}`` (registered by ``namodels.tasks``) gives:

* a file inside a ``train.py`` run folder, ``.../<run_name>/<version>/checkpoints/<file>`` or ``.../export/<file>``:
  that ``<run_name>`` (e.g. ``stylenat_tiny-skimage``: the model and the data it was trained on);
* any other file (a released ``FFHQ256_940k_flip.pt``): the file's name without its extension;
* no path: ``fallback``.

Only the path is read (the checkpoint is not opened): the name is needed before the run folder is made.
"""
from __future__ import annotations

import os
import re

__all__ = ["checkpoint_run_name", "register_resolver"]

RESOLVER = "ckpt_run_name"
# folders of a train.py run that hold weight files (configs/callbacks, the runner's export)
WEIGHT_FOLDERS = ("checkpoints", "export")
# run_version folders: version_N, or a launcher's shared folder (namodels.tasks.run_dirs)
VERSION_FOLDER = re.compile(r"^(version_\d+|torchrun-.+|slurm-.+)$")


def _safe(name: str) -> str:
    """A folder name: path separators and spaces replaced."""
    return re.sub(r"[^\w.+=-]+", "_", name).strip("._")


def checkpoint_run_name(path, fallback: str = "run") -> str:
    """The run name of the checkpoint at ``path`` (see the module docstring); ``fallback`` without a path."""
    if path in (None, "", "null"):
        return str(fallback)
    full = os.path.normpath(os.path.abspath(os.path.expanduser(str(path))))
    folder = os.path.dirname(full)
    if os.path.basename(folder) in WEIGHT_FOLDERS:
        run_folder = os.path.dirname(folder)
        name = os.path.basename(run_folder)
        if VERSION_FOLDER.match(name):  # logs/<task>/<run_name>/version_N
            name = os.path.basename(os.path.dirname(run_folder))
        if _safe(name):
            return _safe(name)
    stem = os.path.splitext(os.path.basename(full))[0]
    return _safe(stem) or str(fallback)


def register_resolver() -> None:
    """Makes ``${ckpt_run_name:...}`` available to OmegaConf (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, checkpoint_run_name)
