"""Building any timm model from a ``model`` config, and moving weights in and out of it.

``model`` config keys: ``name`` (any timm name; ``import namodels`` registers the NA models),
``backend`` (NA kernel backend for the project's models, ``None`` = fastest available),
``pretrained`` (timm hub weights), ``pretrained_file`` (a local weights file: one of our exports, a
timm/official state dict), ``drop_path_rate``, ``drop_rate`` and ``kwargs`` (passed to the model).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os

import timm
from torch import nn

log = logging.getLogger(__name__)

# Keys of safetensors metadata written by :func:`export_weights`.
META_MODEL, META_CLASSES, META_SOURCE = "namodels.model", "namodels.num_classes", "namodels.source"


def is_project_model(name: str) -> bool:
    """True for models registered by namodels (they take a ``backend`` argument)."""
    import namodels  # noqa: F401  registers the project's models with timm

    entry = timm.models.model_entrypoint(timm.models.split_model_name_tag(name)[0])
    return entry.__module__.startswith("namodels.")


def check_model_name(name) -> str:
    import namodels  # noqa: F401

    if not isinstance(name, str) or not timm.is_model(timm.models.split_model_name_tag(name)[0]):
        close = timm.list_models(f"*{str(name).split('.')[0][:6]}*")[:8] if isinstance(name, str) else []
        raise ValueError(f"model.name: {name!r} is not a timm model name" + (f" (close: {close})" if close else ""))
    return name


def create_model(cfg: dict, num_classes: int) -> nn.Module:
    """A timm model for ``cfg`` (a ``model`` config as a plain dict)."""
    name = check_model_name(cfg.get("name"))
    kwargs = dict(cfg.get("kwargs") or {})
    for key in ("drop_path_rate", "drop_rate"):
        if cfg.get(key) is not None:
            if not 0.0 <= float(cfg[key]) < 1.0:
                raise ValueError(f"model.{key}: must be in [0, 1), got {cfg[key]}")
            kwargs[key] = float(cfg[key])
    if cfg.get("backend") is not None:
        if is_project_model(name):
            kwargs["backend"] = cfg["backend"]
        else:
            log.info("model.backend=%s ignored for %s (not a neighborhood-attention model)", cfg["backend"], name)
    file = cfg.get("pretrained_file")
    pretrained = bool(cfg.get("pretrained")) or bool(file)
    overlay = None
    if file:
        file = os.path.expanduser(str(file))
        if not os.path.isfile(file):
            raise ValueError(f"model.pretrained_file: {file!r} does not exist")
        check_file_matches(file, name)
        overlay = dict(file=file)
        saved_classes = file_num_classes(file)
        if saved_classes:  # timm keeps the file's classifier only when its class count is the one asked for
            overlay["num_classes"] = saved_classes
    return timm.create_model(name, pretrained=pretrained, num_classes=num_classes,
                             pretrained_cfg_overlay=overlay, **kwargs)


def check_input_size(model: nn.Module | None, img_size, model_name: str | None = None) -> None:
    """A model with a smallest input (``min_input_size``: nat_digits, whose windows must fit its token maps)
    against ``data.img_size``, before any data is loaded, instead of a window error from the first batch."""
    need = getattr(model, "min_input_size", None)
    if not need or img_size is None or int(img_size) >= need:
        return
    name = model_name or type(model).__name__
    raise ValueError(f"data.img_size: {img_size} px is below {need} px, the smallest input {name} takes (below it a "
                     f"level's attention window is wider than its token map); set data.img_size={need} or more")


@contextlib.contextmanager
def open_safetensors(path: str, key: str):
    """``safetensors.safe_open(path, framework="pt")``, which checks the header and that the file holds every
    byte it declares; a file it cannot read (truncated, not safetensors) raises ``ValueError`` naming ``key``
    (the setting that gave the path) and the file, where safetensors' own error names neither."""
    from safetensors import SafetensorError, safe_open

    try:
        handle = safe_open(path, framework="pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{key}: {path!r} is not a readable safetensors file ({err}); it may be truncated or "
                         "damaged: copy or export it again") from err
    with handle as f:
        yield f


def file_metadata(path: str, key: str = "model.pretrained_file") -> dict:
    """The metadata of a ``.safetensors`` weights file (``{}`` for other files); reading it checks the file
    (:func:`open_safetensors`) before timm loads it."""
    if not path.endswith(".safetensors"):
        return {}
    with open_safetensors(path, key) as f:
        return dict(f.metadata() or {})


def file_num_classes(path: str) -> int | None:
    value = file_metadata(path).get(META_CLASSES)
    return int(value) if value else None


def check_file_matches(path: str, name: str) -> None:
    """A weights file exported for another architecture fails here, naming both."""
    saved = file_metadata(path).get(META_MODEL)
    if saved and timm.models.split_model_name_tag(saved)[0] != timm.models.split_model_name_tag(name)[0]:
        raise ValueError(f"model.pretrained_file: {path!r} holds weights of {saved!r}, not of model.name={name!r}")


def load_weights(model: nn.Module, state_dict: dict, *, model_name: str, source: str) -> None:
    """Strictly loads ``state_dict`` into ``model``; on mismatch says which model the weights belong to."""
    result = model.load_state_dict(state_dict, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{source}: weights do not fit model {model_name!r}: {len(result.missing_keys)} missing keys "
            f"(e.g. {result.missing_keys[:3]}), {len(result.unexpected_keys)} unexpected keys "
            f"(e.g. {result.unexpected_keys[:3]})"
        )


def export_weights(state_dict: dict, path: str, *, model_name: str, num_classes: int, source: str) -> str:
    """Writes a safetensors file that ``timm.create_model(name, pretrained=True,
    pretrained_cfg_overlay=dict(file=path))`` loads; metadata records model name and class count."""
    from safetensors.torch import save_file

    from .checkpoints import atomic_write

    tensors = {k: v.detach().cpu().clone().contiguous() for k, v in state_dict.items()}  # no shared storage
    meta = {META_MODEL: model_name, META_CLASSES: str(num_classes), META_SOURCE: json.dumps(source)}
    with atomic_write(path) as partial:  # a reader never sees a half-written file; the umask's file mode
        save_file(tensors, partial, metadata=meta)
    return path
