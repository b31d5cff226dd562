"""The ``--memo-*`` flags generated from memo_ext.config's dataclasses: one definition per flag,
for the trainer (megatron.training.arguments) and the tools (megatron.memo_tools.cli.trace and
.estimate) alike.

Each dataclass field carries its flag name and help text in its ``metadata`` (see
:func:`memo_field`). :func:`add_config_arguments` turns a dataclass into an argparse group,
:func:`config_from_args` turns the parsed namespace back into the dataclass. A tool that takes a
trainer flag with a narrower meaning (no ``auto``, another default) adds it with
:func:`add_config_flags` and a :class:`ToolVariant` naming the difference, never a second
``add_argument``.

Naming rule (checked when the group is generated, so a typo fails at startup, not in a run):
a field ``<name>`` is stored on the argparse namespace as ``memo_<name>`` and its flag is
``--memo-<name with '_' replaced by '-'>``. Example: ``OffloadConfig.host_memory_gb`` <->
``args.memo_host_memory_gb`` <-> ``--memo-host-memory-gb``. Field names must therefore be unique
across all config dataclasses that share one parser (argparse rejects a duplicate flag).

Nothing here imports megatron.training (the trainer imports memo_ext, never the reverse).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Callable, Iterable, Mapping, Optional, TypeVar, Union

#: Prefix of every generated namespace attribute (``args.memo_<field>``).
ARG_PREFIX = "memo_"

ConfigT = TypeVar("ConfigT")


def memo_field(default: Any, *, flag: str, help: str, **argparse_kwargs: Any) -> Any:
    """A dataclass field carrying its command-line flag.

    Args:
        default: the field's default (also the flag's default).
        flag: the flag, ``--memo-<field-name-with-hyphens>`` (checked by
            :func:`add_config_arguments`).
        help: the flag's help text (the field's documentation; state units).
        **argparse_kwargs: extra ``add_argument`` keywords (``choices``, ``metavar``, ...).
    """
    metadata = {"flag": flag, "help": help, "argparse": dict(argparse_kwargs)}
    return dataclasses.field(default=default, metadata=metadata)


def arg_dest(field_name: str) -> str:
    """Namespace attribute of a config field: ``memo_<field_name>``."""
    return ARG_PREFIX + field_name


def arg_flag(field_name: str) -> str:
    """Command-line flag of a config field: ``--memo-<field-name-with-hyphens>``."""
    return "--" + arg_dest(field_name).replace("_", "-")


def _scalar_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation such as ``float | None``."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) != 1:
            raise TypeError(f"unsupported config field type {annotation!r}: one type or Optional")
        return members[0], True
    return annotation, False


def _config_fields(config_cls: type) -> list[tuple[dataclasses.Field, Any]]:
    if not dataclasses.is_dataclass(config_cls):
        raise TypeError(f"{config_cls!r} is not a dataclass")
    hints = typing.get_type_hints(config_cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(config_cls) if f.init]


def add_config_arguments(
    parser: argparse.ArgumentParser, config_cls: type, title: str
) -> argparse._ArgumentGroup:
    """Add one argument group to ``parser`` generated from ``config_cls``'s fields.

    Each field must be declared with :func:`memo_field`. ``bool`` fields (default False)
    become ``store_true`` flags; ``int``/``float``/``str`` fields (optionally ``| None``) take
    one value of that type; ``typing.Literal[...]`` fields become ``choices``. The flag's
    default is the field's default, so an unset flag round-trips to the dataclass default.

    Returns the group. Raises TypeError if a field has no flag metadata, its flag breaks the
    naming rule (module docstring), or its type is unsupported.
    """
    summary = (config_cls.__doc__ or "").strip().split("\n\n")[0]
    group = parser.add_argument_group(title=title, description=summary or None)
    add_config_flags(group, config_cls)
    return group


#: ToolVariant.default: keep the trainer's default.
KEEP = object()


@dataclasses.dataclass(frozen=True)
class ToolVariant:
    """How a tool (tools/trace.py, tools/estimate.py) takes a trainer flag: the field's flag,
    dest, type, choices and help, with only the differences named here, so each flag has one
    definition. ``note`` (one sentence: what the tool does differently and why) is appended to
    the trainer's help.

    default: the tool's default where it differs from the trainer's (``KEEP``: the same).
    type: the tool's value parser where it takes fewer values than the trainer (``int`` where
        the trainer also takes ``auto``); ``None``: the trainer's.
    refuse: ``{value: why}`` trainer values the tool cannot take; :func:`refused_value` turns
        one into the one-line error ``<flag> <value> <why>``.
    argparse: extra ``add_argument`` keywords for the tool (``metavar``, ...).
    """

    note: str = ""
    default: Any = KEEP
    type: Optional[Callable[[str], Any]] = None
    refuse: dict = dataclasses.field(default_factory=dict)
    argparse: dict = dataclasses.field(default_factory=dict)


def add_config_flags(container, config_cls: type, fields: Optional[Iterable[str]] = None,
                     variants: Optional[dict[str, ToolVariant]] = None) -> None:
    """Add ``config_cls``'s flags (all, or the named ``fields`` in that order) to ``container``
    (a parser or an argument group). ``variants`` maps a field name to the
    :class:`ToolVariant` a tool takes it as; the trainer passes none."""
    variants = variants or {}
    by_name = dict((field.name, (field, annotation))
                   for field, annotation in _config_fields(config_cls))
    names = list(by_name) if fields is None else list(fields)
    for name in names:
        field, annotation = by_name[name]
        flag, kwargs = _flag_kwargs(config_cls, field, annotation)
        variant = variants.get(name)
        if variant is not None:
            if variant.note:
                kwargs["help"] += " " + variant.note.replace("%", "%%")
            if variant.default is not KEEP:
                kwargs["default"] = variant.default
            if variant.type is not None:
                kwargs["type"] = variant.type
            kwargs.update(variant.argparse)
        container.add_argument(flag, **kwargs)


def refused_value(opts: argparse.Namespace, variants: dict[str, ToolVariant]) -> Optional[str]:
    """The one-line error for the first flag in ``opts`` holding a value its variant refuses
    (``<flag> <value> <why>``), or None."""
    for name, variant in variants.items():
        value = getattr(opts, arg_dest(name), None)
        if isinstance(value, str) and value.strip().lower() in variant.refuse:
            return f"{arg_flag(name)} {value} {variant.refuse[value.strip().lower()]}"
    return None


def _flag_kwargs(config_cls: type, field: dataclasses.Field, annotation: Any
                 ) -> tuple[str, dict[str, Any]]:
    """(flag, ``add_argument`` keywords) of one :func:`memo_field` field (the trainer's)."""
    meta = field.metadata
    if "flag" not in meta or "help" not in meta:
        raise TypeError(f"{config_cls.__name__}.{field.name} has no flag/help metadata; "
                        "declare it with memo_field(...)")
    flag = meta["flag"]
    if flag != arg_flag(field.name):
        raise TypeError(f"{config_cls.__name__}.{field.name}: flag {flag!r} breaks the naming "
                        f"rule; use {arg_flag(field.name)!r}")
    # argparse %-formats help strings: escape a literal '%'.
    kwargs: dict[str, Any] = {"dest": arg_dest(field.name), "default": field.default,
                              "help": meta["help"].replace("%", "%%")}
    scalar, _optional = _scalar_type(annotation)
    if scalar is bool:
        if field.default is not False:
            raise TypeError(f"{config_cls.__name__}.{field.name}: bool flags must default "
                            "to False (store_true)")
        kwargs["action"] = "store_true"
    elif typing.get_origin(scalar) is typing.Literal:
        choices = typing.get_args(scalar)
        kwargs["type"] = type(choices[0])
        kwargs["choices"] = choices
    elif scalar in (int, float, str):
        kwargs["type"] = scalar
    else:
        raise TypeError(f"{config_cls.__name__}.{field.name}: unsupported type {annotation!r}")
    kwargs.update(meta.get("argparse", {}))
    return flag, kwargs


def config_from_args(config_cls: type[ConfigT], args: argparse.Namespace) -> ConfigT:
    """Build ``config_cls`` from a parsed namespace (attribute ``memo_<field>`` per field).

    An attribute missing from the namespace (its group was never added, e.g. a namespace built
    by hand in a test) takes the field's default. Does not validate: call ``.validate()``.
    """
    values = {}
    for field, _annotation in _config_fields(config_cls):
        values[field.name] = getattr(args, arg_dest(field.name), field.default)
    return config_cls(**values)



def _value_text(value: Any) -> str:
    """A flag value as the command line carries it: ``repr`` of a float (the shortest text that
    reads back as the same number), ``str`` of anything else."""
    return repr(value) if isinstance(value, float) else str(value)


def render_flags(*items: Union[Mapping[str, Any], Any]) -> list[str]:
    """The command line of ``items``, in order: the one renderer of flags, for every tool that
    writes a trainer command line (the tracer, the recommender's launch lines, gpu-check,
    checkpoint conversion).

    An item is a config dataclass of memo_ext.config, whose fields differing from their
    defaults are rendered by their :func:`memo_field` flags (the inverse of
    :func:`config_from_args`), or a mapping of Megatron-LM flag names with ``_`` for ``-``
    (``{"tensor_model_parallel_size": 4}`` -> ``--tensor-model-parallel-size 4``). A value
    True is a switch, False or None leaves the flag out, a list or tuple gives several values.
    """
    argv: list[str] = []
    for item in items:
        if dataclasses.is_dataclass(item) and not isinstance(item, type):
            pairs = [(field.metadata["flag"], getattr(item, field.name))
                     for field, _annotation in _config_fields(type(item))
                     if getattr(item, field.name) != field.default]
        else:
            pairs = [("--" + name.replace("_", "-"), value) for name, value in item.items()]
        for flag, value in pairs:
            if value is None or value is False:
                continue
            argv.append(flag)
            if value is True:
                continue
            values = value if isinstance(value, (list, tuple)) else [value]
            argv += [_value_text(one) for one in values]
    return argv
