"""Command-line overrides checked before Hydra composes the config, where a misspelled key would only get
Hydra's "Key 'max_epoch' is not in struct" (or, added with ``+``, a TypeError from the Trainer later).

``trainer.<name>`` must be an argument of ``lightning.pytorch.Trainer``; an unknown one fails with the
closest argument names.  Deeper keys (``trainer.strategy.find_unused_parameters``) are checked by their
first part only.  configs/trainer/default.yaml lists every Trainer argument, so each one is set without ``+``
(``trainer.max_steps=50``); ``callbacks`` and ``logger`` come from their own config groups, and
``trainer.callbacks`` / ``trainer.logger`` fail naming the group.

A run's config errors (a ``ValueError`` whose message starts with the config key to change, such as
``data.batch_size: 128 exceeds the 24 training images ...``) end train.py / eval.py with that message alone on
one line, not a traceback through Lightning (:func:`reported_config_errors`).

Once composed, the trainer config's plain values (numbers, strings, booleans, null; interpolations such as
``${oc.env:HOME}`` resolved) are checked against the types the Trainer's signature declares
(:func:`check_trainer_values`): ``trainer.max_epochs=${oc.env:HOME}`` fails naming the key, where the Trainer
takes the string and the run fails later with a ``TypeError`` far from it.
"""
from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import re
import typing

# Keys of configs/trainer/*.yaml that are not Trainer arguments.
CONFIG_KEYS = ("_target_", "defaults")
# Trainer arguments that train.py / eval.py build from groups of their own (configs/trainer/default.yaml lists
# every other one): the override that sets them instead.
GROUP_ARGUMENTS = {"callbacks": "the callbacks group: callbacks.<name>=null or callbacks.<name>.<key>=<value>",
                   "logger": "the logger group: logger=csv | tensorboard | none"}


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
        if name in GROUP_ARGUMENTS:
            messages.append(f"trainer.{name}: set by {GROUP_ARGUMENTS[name]}")
            continue
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


_PLAIN = (bool, int, float, str, type(None))  # (the order the messages list them in)
_KIND_NAMES = {type(None): "null", bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _plain_choices(annotation) -> tuple[set[type], list]:
    """The plain types and literal values an annotation admits (``Optional[int]``: ``{NoneType, int}``);
    other members (classes, lists, dicts) admit no plain value."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or (origin is None and type(annotation).__name__ == "UnionType"):
        types, literals = set(), []
        for arg in typing.get_args(annotation):
            t, lit = _plain_choices(arg)
            types |= t
            literals += lit
        return types, literals
    if origin is typing.Literal:
        return set(), list(typing.get_args(annotation))
    return ({annotation} if annotation in _PLAIN else set()), []


def _admits(value, types: set[type], literals: list) -> bool:
    if any(value == lit and type(value) is type(lit) for lit in literals):
        return True
    if isinstance(value, bool) or value is None:  # bool is an int to Python, not to a Trainer argument
        return type(value) in types
    if isinstance(value, int) and (int in types or float in types):
        return True
    return type(value) in types


def trainer_value_errors(trainer_cfg) -> list[str]:
    """One message per Trainer argument of ``trainer_cfg`` (a mapping, interpolations resolved on access) whose
    plain value is of a type the argument's annotation does not admit; values that are configs or lists
    (instantiated objects, device lists) are left to the Trainer."""
    from lightning.pytorch import Trainer

    try:
        hints = typing.get_type_hints(Trainer.__init__)
    except Exception:  # noqa: BLE001  annotations this Lightning cannot evaluate: the Trainer checks its own
        return []
    messages = []
    for name in trainer_cfg:
        if name not in hints:
            continue
        value = trainer_cfg[name]
        if not isinstance(value, _PLAIN):
            continue
        types, literals = _plain_choices(hints[name])
        if not (types or literals) or _admits(value, types, literals):
            continue
        kinds = [_KIND_NAMES[t] for t in _PLAIN if t in types and not (t is int and float in types)]
        kinds += [repr(lit) for lit in literals]
        messages.append(f"trainer.{name}: expected {' or '.join(kinds)}, got {value!r} "
                        f"({_KIND_NAMES.get(type(value), type(value).__name__)})")
    return messages


def check_trainer_values(trainer_cfg) -> None:
    """Raises ``ValueError`` with the messages of :func:`trainer_value_errors`, if there are any."""
    messages = trainer_value_errors(trainer_cfg)
    if messages:
        raise ValueError("\n".join(messages))


# "data.batch_size: ...", "ckpt_path=last: ...", "task: ...": the message starts with the key to change.
_KEY_PREFIX = re.compile(r"^([A-Za-z_]\w*)(?:\.\w+)*(?:=[^\s:]*)?: ")


def config_error_key(err: BaseException, cfg) -> str | None:
    """The config key a ``ValueError`` names at the start of its message, when its first part is a key of ``cfg``
    (what the project's checks raise); None for any other error (a bug, a library's own ``ValueError``)."""
    if not isinstance(err, ValueError):
        return None
    match = _KEY_PREFIX.match(str(err))
    if match is None or match.group(1) not in cfg:
        return None
    return match.group(0)[:-2]


@contextlib.contextmanager
def reported_config_errors(cfg):
    """Around a run: a config error (:func:`config_error_key`) exits with ``Error: <message>`` (exit status 1),
    its traceback left out (``HYDRA_FULL_ERROR=1`` keeps it), and the run's fresh folder, which holds no output,
    is removed (:func:`namodels.tasks.run_dirs.discard_unused_folder`).  Other errors pass unchanged."""
    try:
        yield
    except ValueError as err:
        if config_error_key(err, cfg) is None:
            raise
        from .run_dirs import discard_unused_folder

        discard_unused_folder(cfg)
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        raise SystemExit("Error: " + str(err).replace("\n", "\n       ")) from None
