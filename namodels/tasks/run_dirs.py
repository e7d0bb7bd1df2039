"""Run folders: every run writes into a folder of its own, ``logs/<task>/<run_name>/version_N``.

* A fresh run takes the next ``version_N`` (created atomically, so concurrent runs and the jobs of a
  Hydra ``-m`` sweep never share one) and never touches earlier versions.
* ``ckpt_path=last`` (train.py) continues in the latest version that holds ``checkpoints/last.ckpt``.
* ``run_version=<name>`` pins the folder name; a pinned folder (or ``paths.output_dir=...``) that
  already holds a run's outputs is refused unless the run resumes it (``ckpt_path=last``).
* Several processes started by torchrun or SLURM agree on one folder without talking to each other:
  it is named after the launcher's job (``slurm-<job id>``, ``torchrun-<rdzv id>``).
* A run stopped by a config error before it wrote any output leaves no folder behind
  (:func:`discard_unused_folder`).

Under Hydra, :class:`RunFolderCallback` picks the folder before Hydra creates its run directory, so
``.hydra/`` and the log file land in the run's folder too; ``fit`` / ``evaluate`` pick it themselves
when called without Hydra (and for each job of a multirun, whose Hydra files stay in the sweep folder).
"""
from __future__ import annotations

import logging
import os
import re
import shutil

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

log = logging.getLogger(__name__)

VERSION = re.compile(r"^version_(\d+)$")
# The version_N folders this process created (new_version): the only ones discard_unused_folder may remove.
_CREATED: set[str] = set()
# What a folder holds once a run has used it: such a folder is never handed to a fresh run.
RUN_OUTPUTS = ("checkpoints", "summary.json", "export", "results.json", "images", "fid.json")


def versions(run_dir: str) -> list[int]:
    """The ``N`` of every ``version_N`` folder in ``run_dir``, ascending."""
    if not os.path.isdir(run_dir):
        return []
    found = (VERSION.match(name) for name in os.listdir(run_dir))
    return sorted(int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(run_dir, m.group(0))))


def new_version(run_dir: str) -> str:
    """Creates and returns the next free ``version_N`` in ``run_dir`` (``mkdir`` is atomic, so two runs
    starting at once get different folders)."""
    os.makedirs(run_dir, exist_ok=True)
    number = (versions(run_dir) or [-1])[-1] + 1
    while True:
        name = f"version_{number}"
        try:
            os.mkdir(os.path.join(run_dir, name))
            _CREATED.add(os.path.normpath(os.path.abspath(os.path.join(run_dir, name))))
            return name
        except FileExistsError:
            number += 1


def latest_resumable(run_dir: str) -> str:
    """The newest ``version_N`` holding ``checkpoints/last.ckpt``, for ``ckpt_path=last``."""
    for number in reversed(versions(run_dir)):
        name = f"version_{number}"
        if os.path.isfile(os.path.join(run_dir, name, "checkpoints", "last.ckpt")):
            return name
    raise ValueError(f"ckpt_path=last: no last.ckpt in any version_N/checkpoints/ of {run_dir!r}; run without "
                     "ckpt_path first (same run_name), or give a checkpoint file (ckpt_path=<path>)")


def launcher_version() -> str | None:
    """A folder name shared by every process of a torchrun / SLURM launch, or None for one process."""
    env = os.environ
    if int(env.get("SLURM_NTASKS", "1") or 1) > 1 and env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    if int(env.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    raise ValueError("run_version: the processes of this launch (WORLD_SIZE="
                     f"{env.get('WORLD_SIZE')}) must share one output folder but the launcher gives no job id; "
                     "set run_version=<name> (the same on every process), or torchrun --rdzv-id=<id>")


def check_unused(folder: str) -> None:
    """Refuses a folder that already holds a run's outputs (a fresh run must not overwrite them)."""
    used = [name for name in RUN_OUTPUTS if os.path.exists(os.path.join(folder, name))]
    if used:
        raise ValueError(f"run_version: {folder!r} already holds an earlier run ({', '.join(used)}); resume it "
                         "with ckpt_path=last, or leave run_version / paths.output_dir unset for a new version_N")


def _resumes(cfg: DictConfig) -> bool:
    return cfg.task.get("stage") == "fit" and cfg.get("ckpt_path") == "last"


def _set(cfg: DictConfig, folder: str, version: str) -> str:
    with read_write(cfg), open_dict(cfg):
        cfg.run_version = version
        cfg.paths.output_dir = folder
    return folder


def assign_run_folder(cfg: DictConfig, pinned_folder: str | None = None) -> str:
    """Chooses this run's folder (see the module docstring), writes it into ``cfg.paths.output_dir`` and
    ``cfg.run_version``, and returns it.  Idempotent: a config that already has its folder keeps it.

    ``pinned_folder``: a folder fixed from outside (Hydra's ``hydra.run.dir`` given on the command line,
    as Lightning does for the DDP processes it starts), used as it is.
    """
    output_is_given = not OmegaConf.is_interpolation(cfg.paths, "output_dir")
    if cfg.get("run_version") is not None and output_is_given:
        return cfg.paths.output_dir  # chosen already (by the Hydra callback, in this process)
    resumes = _resumes(cfg)
    if pinned_folder is not None or output_is_given:
        folder = os.path.normpath(pinned_folder or cfg.paths.output_dir)
    else:
        run_dir = cfg.paths.run_dir
        version = cfg.get("run_version") or (latest_resumable(run_dir) if resumes else launcher_version())
        folder = os.path.normpath(os.path.join(run_dir, version or new_version(run_dir)))
    if not resumes:
        check_unused(folder)
    os.makedirs(folder, exist_ok=True)
    return _set(cfg, folder, os.path.basename(folder))


def discard_unused_folder(cfg: DictConfig) -> bool:
    """Removes this run's folder after a config error stopped the run: only a ``version_N`` this process created
    for a fresh run, and only while it holds none of ``RUN_OUTPUTS`` (Hydra's ``.hydra/`` and log file, and the
    loggers' first files, are all a failed start leaves); the ``run_name`` folder goes too if that leaves it
    empty.  Returns whether the folder was removed."""
    folder = OmegaConf.select(cfg, "paths.output_dir", default=None, throw_on_missing=False)
    if not folder or _resumes(cfg) or OmegaConf.is_interpolation(cfg.paths, "output_dir"):
        return False
    folder = os.path.normpath(os.path.abspath(folder))
    if folder not in _CREATED or not os.path.isdir(folder):
        return False
    if any(os.path.exists(os.path.join(folder, name)) for name in RUN_OUTPUTS):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    _CREATED.discard(folder)
    try:
        os.rmdir(os.path.dirname(folder))  # only if empty
    except OSError:
        pass
    return not os.path.exists(folder)


def _pinned_run_dir(cfg: DictConfig) -> str | None:
    """``hydra.run.dir`` when given on the command line (e.g. by Lightning for its DDP processes)."""
    for override in cfg.hydra.overrides.hydra or []:
        key, _, value = str(override).partition("=")
        if key.lstrip("+~") == "hydra.run.dir":
            return value.strip("\"'")
    return None


class RunFolderCallback(Callback):
    """Hydra callback (``configs/hydra/default.yaml``): picks the run folder before Hydra creates its
    run directory, which is ``${paths.output_dir}``, so Hydra's files land in the run's own folder."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        try:
            assign_run_folder(config, pinned_folder=_pinned_run_dir(config))
        except ValueError as err:
            # Hydra reports a callback's exception as a warning and goes on (into a folder named "None"):
            # stop here instead, with the message.
            raise SystemExit(f"Error: {err}") from None
