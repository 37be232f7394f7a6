"""Array codecs: PostgreSQL arrays to Avro arrays of ``["null", element]``.

An array column maps to Avro arrays nested once per declared dimension, whose
items are the element codec's type or null (SPEC §5).

* Text forms (array_in's grammar): quoting, backslash escapes, ``NULL`` vs
  ``"NULL"``, whitespace, dimension decorations ``[0:2]={...}`` (the lower
  bounds are not kept: Avro arrays have none), the ``;`` delimiter of box
  arrays, nested braces.
* A value whose number of dimensions differs from the column's declared
  ``attndims`` raises ValueError; the empty array ``{}`` (zero dimensions in
  PostgreSQL) becomes an empty Avro array for any declared dimension count.
* ``int2vector``/``oidvector`` are category 'A' but not arrays: strings.
"""

from __future__ import annotations

from typing import Any

from cdcd.avro.binary import EMPTY_ARRAY, NULL_BRANCH, VALUE_BRANCH, encode_array
from cdcd.decode.codec import ColumnCodec

__all__ = ["array_codec"]

_BACKSLASH, _QUOTE, _LBRACE, _RBRACE, _LBRACKET = 0x5C, 0x22, 0x7B, 0x7D, 0x5B
#: array_isspace / C-locale isspace.
_SPACE = frozenset(b" \t\n\r\v\f")


# --------------------------------------------------------------------------- array text


def _parse_array_text(value: bytes, delimiter: int) -> list[Any]:
    """array_in's grammar to nested lists of element text (bytes) or None for NULL.

    Handles an optional ``[lo:hi]...=`` decoration, whitespace around elements,
    double-quoted elements with backslash escapes, backslash escapes in
    unquoted elements, and NULL (unquoted, any case) versus "NULL".
    """
    n = len(value)
    pos = 0
    while pos < n and value[pos] in _SPACE:
        pos += 1
    if pos < n and value[pos] == _LBRACKET:
        equals = value.find(b"=", pos)
        if equals < 0:
            raise ValueError(f"invalid array dimension decoration in {value[:60]!r}")
        pos = equals + 1
        while pos < n and value[pos] in _SPACE:
            pos += 1
    if pos >= n or value[pos] != _LBRACE:
        raise ValueError(f"array text must start with '{{': {value[:60]!r}")
    tree, pos = _parse_array_level(value, pos, delimiter)
    while pos < n and value[pos] in _SPACE:
        pos += 1
    if pos != n:
        raise ValueError(f"junk after array text: {value[:60]!r}")
    return tree


def _parse_array_level(value: bytes, pos: int, delimiter: int) -> tuple[list[Any], int]:
    """Parse one ``{...}`` starting at ``value[pos] == '{'``; returns (items, position after '}')."""
    items: list[Any] = []
    n = len(value)
    pos += 1
    while pos < n and value[pos] in _SPACE:
        pos += 1
    if pos < n and value[pos] == _RBRACE:
        return items, pos + 1
    try:
        while True:
            while value[pos] in _SPACE:
                pos += 1
            c = value[pos]
            if c == _LBRACE:
                sub, pos = _parse_array_level(value, pos, delimiter)
                items.append(sub)
            elif c == _QUOTE:
                out = bytearray()
                pos += 1
                while True:
                    stop = value.find(b'"', pos)
                    escape = value.find(b"\\", pos, stop)
                    if stop < 0:
                        raise ValueError(f"unterminated quoted array element in {value[:60]!r}")
                    if escape < 0:
                        out += value[pos:stop]
                        pos = stop + 1
                        break
                    out += value[pos:escape]
                    out.append(value[escape + 1])
                    pos = escape + 2
                items.append(bytes(out))
            else:
                out = bytearray()
                significant = 0  # length without trailing unescaped whitespace
                escaped = False
                while True:
                    c = value[pos]
                    if c == _BACKSLASH:
                        out.append(value[pos + 1])
                        pos += 2
                        significant = len(out)
                        escaped = True
                    elif c == delimiter or c == _RBRACE:
                        break
                    elif c == _LBRACE or c == _QUOTE:
                        raise ValueError(f"unexpected {chr(c)!r} in array text {value[:60]!r}")
                    else:
                        out.append(c)
                        pos += 1
                        if c not in _SPACE:
                            significant = len(out)
                del out[significant:]
                if not out and not escaped:
                    raise ValueError(f"empty unquoted array element in {value[:60]!r}")
                if not escaped and len(out) == 4 and out.upper() == b"NULL":
                    items.append(None)
                else:
                    items.append(bytes(out))
            while value[pos] in _SPACE:
                pos += 1
            c = value[pos]
            pos += 1
            if c == delimiter:
                continue
            if c == _RBRACE:
                return items, pos
            raise ValueError(f"unexpected {chr(c)!r} in array text {value[:60]!r}")
    except IndexError as exc:
        raise ValueError(f"truncated array text {value[:60]!r}") from exc


def _tree_depth(tree: list[Any]) -> int:
    depth = 1
    node = tree
    while node and isinstance(node[0], list):
        depth += 1
        node = node[0]
    return depth


def _dimension_error(found: int, expected: int) -> ValueError:
    return ValueError(
        f"array value has {found} dimension(s) but the column is declared with {expected}"
    )


# --------------------------------------------------------------------------- codec


def array_codec(element: ColumnCodec, delimiter: bytes, dims: int) -> ColumnCodec:
    avro_type = element.avro_type
    for _ in range(dims):
        avro_type = {"type": "array", "items": ["null", avro_type]}
    element_text = element.from_text
    element_python = element.to_python
    delim = delimiter[0]

    def encode_tree(node: list[Any], level: int) -> bytes:
        if level == dims:
            out = []
            for item in node:
                if item is None:
                    out.append(NULL_BRANCH)
                elif isinstance(item, list):
                    raise ValueError("array sub-arrays do not have matching dimensions")
                else:
                    out.append(VALUE_BRANCH + element_text(item))
            return encode_array(out)
        subs = []
        for item in node:
            if not isinstance(item, list):
                raise ValueError("array sub-arrays do not have matching dimensions")
            subs.append(VALUE_BRANCH + encode_tree(item, level + 1))
        return encode_array(subs)

    def from_text(value: bytes) -> bytes:
        # Fast path: one dimension, nothing quoted or escaped ("{1,2,NULL}").
        if (
            dims == 1
            and _QUOTE not in value
            and _BACKSLASH not in value
            and value.count(b"{") == 1
            and value.count(b"}") == 1
        ):
            start = value.index(b"{")
            end = value.index(b"}")
            prefix = value[:start].strip()
            if value[end + 1 :].strip() or (prefix and prefix[0] != _LBRACKET):
                raise ValueError(f"invalid array text {value[:60]!r}")
            inner = value[start + 1 : end]
            if not inner.strip():
                return EMPTY_ARRAY
            out = []
            for item in inner.split(delimiter):
                item = item.strip()
                if len(item) == 4 and item.upper() == b"NULL":
                    out.append(NULL_BRANCH)
                elif not item:
                    raise ValueError(f"empty unquoted array element in {value[:60]!r}")
                else:
                    out.append(VALUE_BRANCH + element_text(item))
            return encode_array(out)
        tree = _parse_array_text(value, delim)
        if not tree:
            return EMPTY_ARRAY
        depth = _tree_depth(tree)
        if depth != dims:
            raise _dimension_error(depth, dims)
        return encode_tree(tree, 1)

    def python_tree(node: list[Any], level: int) -> list[Any]:
        if level == dims:
            if any(isinstance(item, list) for item in node):
                raise ValueError("array sub-arrays do not have matching dimensions")
            return [None if item is None else element_python(item) for item in node]
        if not all(isinstance(item, list) for item in node):
            raise ValueError("array sub-arrays do not have matching dimensions")
        return [python_tree(item, level + 1) for item in node]

    def to_python(value: bytes) -> list[Any]:
        tree = _parse_array_text(value, delim)
        if not tree:
            return []
        depth = _tree_depth(tree)
        if depth != dims:
            raise _dimension_error(depth, dims)
        return python_tree(tree, 1)

    return ColumnCodec(avro_type, from_text, to_python)
