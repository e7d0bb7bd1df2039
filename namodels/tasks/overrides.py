"""Command-line overrides checked before Hydra composes the config, where a misspelled key would only get
Hydra's "Key 'max_epoch' is not in struct" (or, added with ``+``, a TypeError from the Trainer later).

``trainer.<name>`` must be an argument of ``lightning.pytorch.Trainer``; an unknown one fails with the
closest argument names.  Deeper keys (``trainer.strategy.find_unused_parameters``) are checked by their
first part only.
"""
from __future__ import annotations

import difflib
import inspect

# Keys of configs/trainer/*.yaml that are not Trainer arguments.
CONFIG_KEYS = ("_target_", "defaults")


def trainer_arguments() -> set[str]:
    from lightning.pytorch import Trainer

    return {name for name in inspect.signature(Trainer.__init__).parameters if name != "self"} | set(CONFIG_KEYS)


def _override_keys(args) -> list[str]:
    """The config keys the command-line overrides address (flags and unparsable arguments are left to Hydra)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = []
    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith("-") or "=" not in arg and not arg.startswith("~"):
            continue
        try:
            (override,) = parser.parse_overrides([arg])
        except Exception:  # noqa: BLE001  Hydra reports its own syntax errors
            continue
        keys.append(override.key_or_group)
    return keys


def unknown_trainer_keys(args) -> list[str]:
    """One message per ``trainer.<name>`` override whose name is not a Trainer argument, with suggestions."""
    names = [key.split(".")[1] for key in _override_keys(args) if key.startswith("trainer.")]
    if not names:
        return []
    known = trainer_arguments()
    messages = []
    for name in names:
        if name in known:
            continue
        close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
        hint = ("did you mean " + " or ".join(f"trainer.{c}" for c in close) + "?") if close else \
            "see the arguments of lightning.pytorch.Trainer"
        messages.append(f"trainer.{name}: not an argument of lightning.pytorch.Trainer; {hint}")
    return messages


def check_overrides(args) -> None:
    """Exits with the messages of :func:`unknown_trainer_keys` (before Hydra runs), if there are any."""
    messages = unknown_trainer_keys(args)
    if messages:
        raise SystemExit("Error: " + "\n       ".join(messages))
