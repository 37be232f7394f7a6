"""Generate the configuration reference (docs/configuration.md) from the models.

Why generated: the pydantic models in ``cdcd.config.model`` are what actually
validates a file, so the reference is rendered from them (types, defaults,
constraints, descriptions) instead of being kept in sync by hand; a test fails
when the committed Markdown is stale. Regenerate with::

    python -m cdcd.config.reference > docs/configuration.md

``--check FILE`` exits 1 if FILE differs from what would be generated.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from cdcd.config.model import CdcdConfig

__all__ = ["main", "render"]

_SCALARS: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    # Held as a secret (never shown in a log or repr); written as a plain string.
    SecretStr: "string",
    type(None): "null",
    Any: "any",
}


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def type_name(annotation: Any) -> str:
    """A YAML-oriented name for a field's type: ``integer``, ``list of string``, ``string or null``."""
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Annotated:  # a tagged union member: the type under its metadata
        return type_name(args[0])
    if origin is Literal:
        return "one of " + ", ".join(f"`{_literal(a)}`" for a in args)
    if origin in (Union, types.UnionType):
        names = list(dict.fromkeys(type_name(a) for a in args if a is not type(None)))
        if type(None) in args:
            names.append("null")
        return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    if origin in (list, tuple, set, frozenset, Sequence):
        return "list of " + (type_name(args[0]) if args else "any")
    if origin is dict:
        value = type_name(args[1]) if len(args) == 2 else "any"
        return f"mapping of {type_name(args[0]) if args else 'string'} to {value}"
    if _is_model(annotation):
        return "mapping (section below)"
    return getattr(annotation, "__name__", str(annotation))


def _literal(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def constraints(field: FieldInfo) -> str:
    """Validation bounds of ``field`` in words (``≥ 1``, ``≤ 4``, ``length 1–63``, pattern)."""
    parts: list[str] = []
    min_len: int | None = None
    max_len: int | None = None
    for item in field.metadata:
        if isinstance(item, annotated_types.Gt):
            parts.append(f"> {item.gt}")
        elif isinstance(item, annotated_types.Ge):
            parts.append(f"≥ {item.ge}")
        elif isinstance(item, annotated_types.Lt):
            parts.append(f"< {item.lt}")
        elif isinstance(item, annotated_types.Le):
            parts.append(f"≤ {item.le}")
        elif isinstance(item, annotated_types.MinLen):
            min_len = item.min_length
        elif isinstance(item, annotated_types.MaxLen):
            max_len = item.max_length
        else:
            pattern = getattr(item, "pattern", None)
            if pattern is not None:
                parts.append(f"matches `{pattern}`")
    if min_len is not None or max_len is not None:
        if min_len is not None and max_len is not None:
            parts.append(f"length {min_len}–{max_len}")
        elif min_len is not None:
            parts.append(f"length ≥ {min_len}")
        else:
            parts.append(f"length ≤ {max_len}")
    return ", ".join(parts)


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it, or **required**."""
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _cell(text: str) -> str:
    # A literal pipe would end the table cell, a newline the row, and outside
    # code spans ``<prefix>`` would be swallowed as an HTML tag.
    pieces = " ".join(text.split()).replace("|", "\\|").split("`")
    for i in range(0, len(pieces), 2):
        pieces[i] = pieces[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(pieces)


def _nested_models(annotation: Any) -> Iterator[type[BaseModel]]:
    """Models inside a list or union annotation (``list[str | TableConfig]``)."""
    for arg in get_args(annotation):
        if _is_model(arg):
            yield arg
        else:
            yield from _nested_models(arg)


def _sections(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, type[BaseModel], bool]]:
    for name, field in model.model_fields.items():
        if _is_model(field.annotation):
            path = f"{prefix}{name}"
            sub: type[BaseModel] = field.annotation  # type: ignore[assignment]
            yield path, sub, field.is_required()
            yield from _sections(sub, path + ".")
            continue
        for entry in _nested_models(field.annotation):
            # An entry of a list written as a mapping: `postgres.tables[]`.
            path = f"{prefix}{name}[]"
            yield path, entry, False
            yield from _sections(entry, path + ".")


def render(root: type[BaseModel] = CdcdConfig) -> str:
    """The whole reference as Markdown, deterministic so the committed file can be compared."""
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated from cdcd/config/model.py by"
        " `python -m cdcd.config.reference > docs/configuration.md`; do not edit. -->",
        "",
        "cdcd reads one YAML file (`cdcd run -c FILE`). Unknown keys are rejected, so a typo",
        "is an error (exit code 2) rather than a silently ignored setting. `${VAR}` is",
        "replaced from the environment in string values after the YAML is parsed (never in",
        "comments; inside `postgres.dsn` the value is quoted the libpq way, or",
        "percent-encoded in a URI, so it may contain any character) and `${VAR:-default}`",
        "supplies a default; a variable that is unset and has no default is an error. Keep secrets",
        "(the PostgreSQL password, SASL and registry credentials) in the environment.",
        "An annotated example is in `config/cdcd.example.yaml`.",
        "",
    ]
    top_level = [
        (name, field)
        for name, field in root.model_fields.items()
        if not _is_model(field.annotation)
    ]
    if top_level:
        lines += ["## Top level", "", *_table_rows(top_level), ""]
    for path, model, required in _sections(root, ""):
        lines.append(f"## `{path}`")
        lines.append("")
        if path.endswith("[]"):
            lines.append("A list entry written as a mapping; a plain string entry is its `name`.")
        else:
            lines.append(
                "Required section." if required else "Optional section; every key has a default."
            )
        doc = (model.__doc__ or "").strip()
        if doc:
            lines += ["", doc.split("\n\n")[0].replace("\n", " ")]
        lines += ["", *_table_rows(list(model.model_fields.items())), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _table_rows(fields: list[tuple[str, FieldInfo]]) -> list[str]:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    for name, field in fields:
        kind = type_name(field.annotation)
        bounds = constraints(field)
        if bounds:
            kind += f"; {bounds}"
        rows.append(
            f"| `{name}` | {_cell(kind)} | {_cell(default_text(field))} | "
            f"{_cell(field.description or '')} |"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Print the reference, or with ``--check FILE`` report whether FILE is current."""
    parser = argparse.ArgumentParser(
        prog="python -m cdcd.config.reference",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--check", metavar="FILE", help="exit 1 if FILE is not up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        path = Path(args.check)
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            print(
                f"{path} is out of date; run: python -m cdcd.config.reference > {path}",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
