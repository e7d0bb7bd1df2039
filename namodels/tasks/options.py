"""Task options from Hydra configs: plain containers, and defaults merged with what the config gives."""
from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf


def plain(value):
    """Hydra/OmegaConf containers -> dict/list, so checkpoints hold no pickled OmegaConf objects."""
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def merged_options(name: str, defaults: dict, given) -> dict:
    """``defaults`` updated by ``given``; a key ``defaults`` lacks raises ``ValueError`` naming ``name``."""
    given = dict(plain(given) or {})
    unknown = set(given) - set(defaults)
    if unknown:
        raise ValueError(f"{name}: unknown keys {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **given}
