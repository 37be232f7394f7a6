"""libpq connection strings: ``${VAR}`` values quoted into them, passwords masked.

libpq accepts two forms. Keyword/value (``host=db password='a b\\'c'``): a value
runs to the next whitespace unless it starts with ``'``; inside and outside
quotes ``\\`` escapes the next character. URI
(``postgresql://user:password@host/db?password=...``): components are
percent-encoded. Values are quoted by libpq's own rules (psycopg2's
``make_dsn``). libpq's ``parse_dsn`` gives values but not where they stand in
the text, which masking and ``${VAR}`` substitution need (they keep the rest
of what the operator wrote as written): ``parse_keyword_dsn`` follows libpq's
``conninfo_parse`` character by character for that, and the tests hold its
values to ``parse_dsn``'s, so what cdcd masks or rewrites is exactly what
libpq reads as the value.

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

import psycopg2.extensions

__all__ = [
    "DsnSyntaxError",
    "DsnValue",
    "is_uri",
    "parse_keyword_dsn",
    "quote_keyword_value",
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

#: Stands for the n-th placeholder while the template is split into values: a
#: control character no DSN holds, and no blank, so it stays inside its value.
_TOKEN = "\x01{}\x01"
_TOKENS = re.compile("\x01([0-9]+)\x01")


def quote_keyword_value(value: str) -> str:
    """``value`` written the way libpq reads it back exactly (``make_dsn``'s quoting)."""
    quoted: str = psycopg2.extensions.make_dsn(password=value)
    return quoted.removeprefix("password=")


def substitute_dsn(
    template: str, placeholder: re.Pattern[str], value_of: Callable[[re.Match[str]], str]
) -> str:
    """Replace each ``placeholder`` match in ``template`` so the DSN reads back its exact value.

    Keyword form: every value that holds a placeholder is rewritten whole, as
    libpq reads it with the placeholder's text in place, quoted by libpq's
    rules (``make_dsn``); the rest of the template stays as written. A
    template that is not keyword/value text with placeholders as values
    (``dsn: ${WHOLE_DSN}``, a placeholder in keyword position) gets the text
    inserted as it is. URI form: placeholders in the userinfo, the database
    path and query values are percent-encoded; in the host list and query
    keys they are inserted as they are.
    """
    matches = list(placeholder.finditer(template))
    if not matches:
        return template
    # The form is decided by the literal text before the first placeholder, so
    # ``dsn: ${DATABASE_URL}`` is inserted as it is.
    head = template[: matches[0].start()]
    if is_uri(head) and "://" in head:
        items: list[_Item] = []
        last = 0
        for match in matches:
            items.extend(template[last : match.start()])
            items.append(match)
            last = match.end()
        items.extend(template[last:])
        # Literal characters are one item each, so this index holds in ``items``.
        return _substitute_uri(items, head.index("://") + 3, value_of)
    return _substitute_keywords(template, matches, value_of)


def _substitute_keywords(
    template: str, matches: list[re.Match[str]], value_of: Callable[[re.Match[str]], str]
) -> str:
    values = [value_of(match) for match in matches]
    tokens: list[str] = []
    last = 0
    for i, match in enumerate(matches):
        tokens.append(template[last : match.start()])
        tokens.append(_TOKEN.format(i))
        last = match.end()
    tokens.append(template[last:])
    tokenized = "".join(tokens)
    try:
        parsed = parse_keyword_dsn(tokenized)
    except DsnSyntaxError:
        parsed = None
    if parsed is None or any(_TOKENS.search(entry.keyword) for entry in parsed):
        # Not values only (a piece of DSN, or malformed: libpq reports it).
        return _TOKENS.sub(lambda m: values[int(m.group(1))], tokenized)
    out: list[str] = []
    last = 0
    for entry in parsed:
        if not _TOKENS.search(entry.value):
            continue
        out.append(tokenized[last : entry.start])
        out.append(quote_keyword_value(_TOKENS.sub(lambda m: values[int(m.group(1))], entry.value)))
        last = entry.end
    out.append(tokenized[last:])
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
