"""libpq connection strings: ``${VAR}`` values quoted into them, passwords masked.

libpq accepts two forms. Keyword/value (``host=db password='a b\\'c'``): a value
runs to the next whitespace unless it starts with ``'``; inside and outside
quotes ``\\`` escapes the next character. URI
(``postgresql://user:password@host/db?password=...``): components are
percent-encoded. ``parse_keyword_dsn`` follows libpq's ``conninfo_parse``
character by character, so what cdcd masks or quotes is exactly what libpq
reads as the value.

Why not a regex: a password may contain spaces, quotes, ``=`` and
backslashes; a pattern that stops at the first space masked only the first word
of ``password='my secret'`` (issue 12). Whatever cannot be parsed is masked from
the first ``password`` keyword to the end, so malformed input never leaks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, unquote

__all__ = [
    "DsnSyntaxError",
    "DsnValue",
    "is_uri",
    "parse_keyword_dsn",
    "redact_dsn",
    "redact_dsn_message",
    "substitute_dsn",
]

#: libpq uses isspace() in the C locale.
_SPACE = frozenset(" \t\n\r\v\f")
_MASK = "***"
_URI_PREFIXES = ("postgresql://", "postgres://")


class DsnSyntaxError(ValueError):
    """The keyword/value string is malformed where libpq would reject it too."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position


@dataclass(frozen=True, slots=True)
class DsnValue:
    """One ``keyword=value`` of a keyword/value DSN; ``start:end`` spans the raw value text."""

    keyword: str
    value: str
    start: int
    end: int


def is_uri(dsn: str) -> bool:
    """Whether ``dsn`` is in URI form (leading blanks and case tolerated, to mask more, not less)."""
    return dsn.lstrip().lower().startswith(_URI_PREFIXES)


def _is_secret_keyword(keyword: str) -> bool:
    # password and sslpassword (the client key's passphrase)
    return "password" in keyword.lower()


def parse_keyword_dsn(dsn: str) -> list[DsnValue]:
    """Split a keyword/value DSN as libpq does; raises ``DsnSyntaxError`` where libpq fails.

    Keyword names are not checked against libpq's list (libpq reports unknown ones).
    """
    values: list[DsnValue] = []
    n = len(dsn)
    i = 0
    while i < n:
        if dsn[i] in _SPACE:
            i += 1
            continue
        keyword_start = i
        while i < n and dsn[i] != "=" and dsn[i] not in _SPACE:
            i += 1
        keyword = dsn[keyword_start:i]
        while i < n and dsn[i] in _SPACE:
            i += 1
        if i >= n or dsn[i] != "=":
            raise DsnSyntaxError(f'missing "=" after "{keyword}"', keyword_start)
        i += 1
        while i < n and dsn[i] in _SPACE:
            i += 1
        start = i
        chars: list[str] = []
        if i < n and dsn[i] == "'":
            i += 1
            while True:
                if i >= n:
                    raise DsnSyntaxError("unterminated quoted string", keyword_start)
                if dsn[i] == "\\":
                    i += 1
                    if i < n:
                        chars.append(dsn[i])
                        i += 1
                    continue
                if dsn[i] == "'":
                    i += 1
                    break
                chars.append(dsn[i])
                i += 1
        else:
            while i < n and dsn[i] not in _SPACE:
                if dsn[i] == "\\":
                    i += 1
                    if i < n:
                        chars.append(dsn[i])
                        i += 1
                else:
                    chars.append(dsn[i])
                    i += 1
        values.append(DsnValue(keyword, "".join(chars), start, i))
    return values


def _keyword_secret_spans(dsn: str) -> list[tuple[int, int]]:
    try:
        return [(v.start, v.end) for v in parse_keyword_dsn(dsn) if _is_secret_keyword(v.keyword)]
    except DsnSyntaxError:
        pass
    # Unparsable: where the password ends is unknown, so everything after the
    # first "password" keyword is masked.
    found = dsn.lower().find("password")
    if found < 0:
        return []
    start = found + len("password")
    match = re.compile(r"[ \t\n\r\v\f]*=[ \t\n\r\v\f]*").match(dsn, start)
    if match is not None:
        start = match.end()
    return [(start, len(dsn))]


def _uri_secret_spans(dsn: str) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    begin = dsn.index("://") + 3
    # userinfo: user[:password]@. The last "@" is taken (a raw "@" in a password
    # then stays masked); the first ":" before it separates user and password.
    at = dsn.rfind("@", begin)
    if at >= 0:
        colon = dsn.find(":", begin, at)
        if colon >= 0:
            spans.append((colon + 1, at))
    # Query parameters whose (percent-decoded) key names a password. A segment
    # without "=" after a password belongs to it (a raw "&" in the value).
    query = dsn.find("?", begin)
    if query >= 0:
        masking = False
        position = query + 1
        for segment in dsn[query + 1 :].split("&"):
            key, sep, _ = segment.partition("=")
            if sep:
                masking = _is_secret_keyword(unquote(key))
                if masking:
                    spans.append((position + len(key) + 1, position + len(segment)))
            elif masking:
                spans.append((position - 1, position + len(segment)))
            position += len(segment) + 1
    return spans


def _secret_spans(dsn: str) -> list[tuple[int, int]]:
    """Sorted, merged ``(start, end)`` spans of ``dsn`` that hold secrets."""
    spans = sorted(_uri_secret_spans(dsn) if is_uri(dsn) else _keyword_secret_spans(dsn))
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def redact_dsn(dsn: str) -> str:
    """``dsn`` with every password value (keyword, URI userinfo or query) replaced by ``***``."""
    out: list[str] = []
    last = 0
    keywords = not is_uri(dsn)
    for start, end in _secret_spans(dsn):
        out.append(dsn[last:start])
        out.append(_MASK)
        if keywords and end < len(dsn) and dsn[end] not in _SPACE:
            out.append(" ")  # after a closing quote libpq needs no blank; the mask does
        last = end
    out.append(dsn[last:])
    return "".join(out)


def redact_dsn_message(message: str, dsn: str) -> str:
    """Mask the ``"..."`` fragments of a libpq error about ``dsn`` that overlap a password.

    libpq quotes the piece it could not parse (``missing "=" after "tail-secret"``),
    which for a malformed DSN may be part of the password.
    """
    secrets = [dsn[start:end] for start, end in _secret_spans(dsn) if end > start]
    if not secrets:
        return message

    def mask(match: re.Match[str]) -> str:
        fragment = match.group(1)
        if fragment and any(fragment in secret or secret in fragment for secret in secrets):
            return f'"{_MASK}"'
        return match.group(0)

    return re.sub(r'"([^"]*)"', mask, message)


# ------------------------------------------------------------------ ${VAR} substitution

_Item = str | re.Match[str]


def _quote_keyword_value(value: str) -> str:
    """``value`` as libpq reads it back: as it is when that is unambiguous, else single-quoted."""
    if value and not any(c in _SPACE or c in "'\\" for c in value):
        return value
    return "'" + _escape_in_quotes(value) + "'"


def _escape_in_quotes(value: str) -> str:
    return value.replace("\\", "\\\\").replace("'", "\\'")


def substitute_dsn(
    template: str, placeholder: re.Pattern[str], value_of: Callable[[re.Match[str]], str]
) -> str:
    """Replace each ``placeholder`` match in ``template`` so the DSN reads back its exact value.

    Keyword form: a placeholder in an unquoted value makes that value one
    single-quoted value (``\\`` and ``'`` escaped) when it is empty or holds a
    blank, quote or backslash; inside a quoted value only ``\\`` and ``'`` are
    escaped; in keyword position (``dsn: ${WHOLE_DSN}``) the text is inserted
    as it is. URI form: placeholders in the userinfo, the
    database path and query values are percent-encoded; in the host list and
    query keys they are inserted as they are.
    """
    items: list[_Item] = []
    last = 0
    for match in placeholder.finditer(template):
        items.extend(template[last : match.start()])
        items.append(match)
        last = match.end()
    items.extend(template[last:])
    # The form is decided by the literal text before the first placeholder, so
    # ``dsn: ${DATABASE_URL}`` is inserted as it is.
    first = placeholder.search(template)
    head = template if first is None else template[: first.start()]
    if is_uri(head) and "://" in head:
        # Literal characters are one item each, so this index holds in ``items``.
        return _substitute_uri(items, head.index("://") + 3, value_of)
    return _substitute_keywords(items, value_of)


def _is_space(item: _Item) -> bool:
    return isinstance(item, str) and item in _SPACE


def _substitute_keywords(items: list[_Item], value_of: Callable[[re.Match[str]], str]) -> str:
    def plain(item: _Item) -> str:
        return item if isinstance(item, str) else value_of(item)

    out: list[str] = []
    n = len(items)
    i = 0
    while i < n:
        if _is_space(items[i]):
            out.append(plain(items[i]))
            i += 1
            continue
        # A placeholder in keyword position is a piece of DSN, not a value.
        while i < n and items[i] != "=" and not _is_space(items[i]):
            out.append(plain(items[i]))
            i += 1
        while i < n and _is_space(items[i]):
            out.append(plain(items[i]))
            i += 1
        if i >= n or items[i] != "=":
            continue  # malformed (libpq reports it) or completed by a placeholder
        out.append("=")
        i += 1
        while i < n and _is_space(items[i]):
            out.append(plain(items[i]))
            i += 1
        if i < n and items[i] == "'":
            out.append("'")
            i += 1
            while i < n:
                item = items[i]
                i += 1
                if isinstance(item, re.Match):
                    out.append(_escape_in_quotes(value_of(item)))
                elif item == "\\" and i < n:
                    nxt = items[i]
                    i += 1
                    out.append("\\" + (nxt if isinstance(nxt, str) else _escape_in_quotes(value_of(nxt))))
                else:
                    out.append(item)
                    if item == "'":
                        break
            continue
        start = i
        while i < n and not _is_space(items[i]):
            i += 2 if items[i] == "\\" else 1  # an escaped blank does not end the value
        i = min(i, n)
        value_items = items[start:i]
        if all(isinstance(item, str) for item in value_items):
            out.extend(plain(item) for item in value_items)
            continue
        # libpq unescapes unquoted values too: decode, then quote the whole value.
        chars: list[str] = []
        j = 0
        while j < len(value_items):
            item = value_items[j]
            j += 1
            if item == "\\" and j < len(value_items):
                item = value_items[j]
                j += 1
            chars.append(plain(item))
        out.append(_quote_keyword_value("".join(chars)))
    return "".join(out)


def _substitute_uri(
    items: list[_Item], prefix: int, value_of: Callable[[re.Match[str]], str]
) -> str:
    def encoded(item: _Item) -> str:
        return item if isinstance(item, str) else quote(value_of(item), safe="")

    def plain(item: _Item) -> str:
        return item if isinstance(item, str) else value_of(item)

    n = len(items)
    authority_end = next(
        (k for k in range(prefix, n) if items[k] == "/" or items[k] == "?"), n
    )
    at = max((k for k in range(prefix, authority_end) if items[k] == "@"), default=-1)
    out = [plain(item) for item in items[:prefix]]
    section = "userinfo" if at >= 0 else "host"
    for k in range(prefix, n):
        item = items[k]
        if isinstance(item, str):
            if k == at:
                section = "host"
            elif section == "host" and item in "/?" and k >= authority_end:
                section = "path" if item == "/" else "key"
            elif section == "path" and item == "?":
                section = "key"
            elif section in ("key", "value") and item == "&":
                section = "key"
            elif section == "key" and item == "=":
                section = "value"
            out.append(item)
        elif section in ("host", "key"):
            out.append(plain(item))
        else:
            out.append(encoded(item))
    return "".join(out)
