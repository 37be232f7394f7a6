"""Column codecs: one pgoutput column value straight to its Avro binary encoding.

This is the hot path. For every column of a captured table a
:class:`ColumnCodec` is built once (from the type OID and type modifier of the
Relation message) and then called for every row: it turns the raw bytes
pgoutput sent -- text format (``'t'``) or binary ``typsend`` format (``'b'``,
subscription option ``binary = true``) -- into the Avro binary encoding of the
*non-null* value. Union branch bytes, record framing and error context
(table, column, LSN) are the caller's job. A codec raises ``ValueError`` (or
``OverflowError``) for a value it cannot represent; nothing is silently
dropped or approximated.

Type mapping (SPEC §5)
----------------------
bool -> boolean; int2/int4 -> int; int8/oid -> long; float4/float8 ->
float/double; numeric(p,s) -> bytes decimal(p,s); numeric without typmod ->
string (exact text, ``NaN``/``Infinity`` kept); uuid -> string uuid; bytea ->
bytes; date -> int date; time -> long time-micros; timestamp -> long
local-timestamp-micros; timestamptz -> long timestamp-micros (UTC); domains ->
their base type (the domain's typmod applies when the column has none);
arrays -> Avro arrays of ``["null", element]``, nested per dimension;
everything else (text-like types, json/jsonb, enums, composites, ranges,
interval, timetz, money, network, geometric, bit strings, tsvector, xml,
extension types such as citext ...) -> string holding PostgreSQL's text form.

PostgreSQL quirks handled, and interpretations of the SPEC
-----------------------------------------------------------
* The walsender session is assumed to run with ``DateStyle=ISO,
  IntervalStyle=postgres, TimeZone=UTC, extra_float_digits>=1,
  bytea_output=hex`` (the source sets them). Text timestamptz values are
  still parsed with any offset: ``+05:30``, ``-03`` and LMT offsets with
  seconds such as ``+00:53:28``.
* Dates and timestamps print years with at least four digits, years beyond
  9999 with more (``10000-01-01``) and BC dates with a `` BC`` suffix
  (``0044-03-15 BC``, astronomical year -43). ``infinity``/``-infinity`` and
  every instant outside 0001-01-01 .. 9999-12-31 23:59:59.999999 clamp to
  those bounds (SPEC §5); timestamptz clamps after conversion to UTC, so
  ``10000-01-01 00:00:00+05`` is still exact.
* ``time`` accepts ``24:00:00`` (PostgreSQL allows it, Avro time-micros does
  not): it clamps to 23:59:59.999999.
* numeric typmod: precision ``((typmod-4) >> 16) & 0xffff``, scale the low 11
  bits of ``typmod-4`` *sign-extended* (PostgreSQL 15 allows scales from -1000
  to 1000, independent of the precision). Avro requires 0 <= scale <=
  precision, so numeric(p, s<0) (values rounded to 10^-s, at most p-s integer
  digits) maps to decimal(p-s, 0) and numeric(p, s>p) (pure fractions) to
  decimal(s, s); both hold every value of the column exactly. NaN and
  +-Infinity in a numeric(p,s) column are not representable: ValueError.
* Array text forms: quoting, backslash escapes, ``NULL`` vs ``"NULL"``,
  whitespace, dimension decorations ``[0:2]={...}`` (the lower bounds are not
  kept: Avro arrays have none), the ``;`` delimiter of box arrays, nested
  braces. A value whose number of dimensions differs from the column's
  declared ``attndims`` raises ValueError; the empty array ``{}`` (zero
  dimensions in PostgreSQL) becomes an empty Avro array for any declared
  dimension count.
* ``int2vector``/``oidvector`` are category 'A' but not arrays: strings.
* ``"char"`` bytes with the high bit set print as ``\\ooo`` octal (PG 15).
* bytea text is hex (``\\x...``); the old escape format is accepted too.
* Text-like values are copied, not validated: pgoutput sends them in the
  database encoding, which cdcd requires to be UTF8 (``cdcd check``).
* In binary mode a float NaN keeps its payload bits (any NaN decodes as NaN).

Speed
-----
Codecs are closures built once per column; the per-row work is slicing and
``int()`` on the bytes PostgreSQL sent (text values are not even decoded). Varints use the table-driven ``encode_long``.
Timestamps in years 1..9999 take ``datetime.fromisoformat`` (C) and fall
back to the general parser for infinity, BC and five-digit years; the last
timestamp text seen is memoized, because rows of one transaction often share
``DEFAULT now()``. ``tests/bench/bench_values.py`` measures the SPEC §9 row.

Binary (typsend) format
-----------------------
Exact for: bool, int2, int4, int8, oid, float4, float8, numeric (with and
without typmod), text, varchar, bpchar, name, "char", citext, enums, json,
jsonb, jsonpath, xml, bytea, uuid, date, time, timetz, timestamp,
timestamptz, interval, money, inet, cidr, macaddr, macaddr8, bit, varbit,
point, line, lseg, box, path, polygon, circle, tsvector, pg_lsn, xid, xid8,
cid, tid, pg_snapshot, txid_snapshot, int2vector, oidvector, the built-in
range and multirange types, domains over any of these, composites whose
fields are all of these, and arrays of all of them.

Renderings that depend on session settings assume the settings above:
timestamptz inside ranges/composites prints with ``+00`` (TimeZone=UTC),
money prints as the C/en_US locales do (``$1,234.56``, ``-$1.00``; the
default ``initdb`` locale here is C), floats inside geometric types print
shortest-exact as PostgreSQL 12+ does with extra_float_digits >= 1. A float4
inside a composite is printed with the shortest digits that round-trip,
which matches PostgreSQL except possibly in rare ties.

``from_binary`` raises ValueError, asking for ``binary = false``, for types
whose text form cannot be rebuilt from the binary value alone: tsquery,
reg* types (regclass, regtype ... send an OID but print a name), user-defined
range and multirange types (their subtype is not in the catalog facts we
keep), extension types other than citext (hstore, ltree, PostGIS ...),
pg_node_tree, pg_brin_*/pg_ndistinct/pg_dependencies/pg_mcv_list, and
composites/arrays containing any of those.
"""

from __future__ import annotations

import binascii
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from struct import Struct
from struct import error as StructError
from typing import Any

from cdcd.avro.binary import (
    EMPTY_ARRAY,
    FALSE,
    NULL_BRANCH,
    TRUE,
    VALUE_BRANCH,
    VARINT_LAST,
    encode_array,
    encode_long,
)
from cdcd.decode.types import PgType, TypeCatalog

__all__ = [
    "DATE_MAX",
    "DATE_MIN",
    "TIMESTAMP_MAX",
    "TIMESTAMP_MIN",
    "TIME_MAX",
    "ColumnCodec",
    "bool_from_text",
    "column_codec",
    "encode_text_value",
    "int_from_text",
    "numeric_typmod",
]

#: A pgoutput value (text or binary) to Avro binary bytes.
Encoder = Callable[[bytes], bytes]
#: A binary (typsend) value to PostgreSQL's text form of it.
Renderer = Callable[[bytes], bytes]


@dataclass(frozen=True, slots=True)
class ColumnCodec:
    """Everything needed to encode one column; built once per column, called per row."""

    avro_type: Any  # JSON-able non-null Avro type
    from_text: Callable[[bytes], bytes]  # pgoutput text value -> Avro binary of the value
    from_binary: Callable[[bytes], bytes]  # pgoutput binary (typsend) value -> Avro binary
    to_python: Callable[[bytes], Any]  # text value -> what fastavro returns after decoding


# --------------------------------------------------------------------------- constants

#: Clamp bounds (SPEC §5): days / microseconds since 1970-01-01 of 0001-01-01 and
#: 9999-12-31 (23:59:59.999999), the range Python and Spark can hold.
DATE_MIN = -719_162
DATE_MAX = 2_932_896
TIMESTAMP_MIN = -62_135_596_800_000_000
TIMESTAMP_MAX = 253_402_300_799_999_999
#: 23:59:59.999999; PostgreSQL's 24:00:00 clamps to it.
TIME_MAX = 86_399_999_999

_US_PER_DAY = 86_400_000_000
_PG_EPOCH_DAYS = 10_957  # 2000-01-01 (PostgreSQL epoch) in days since 1970-01-01
_PG_EPOCH_US = _PG_EPOCH_DAYS * _US_PER_DAY
_INT32_MIN, _INT32_MAX = -(1 << 31), (1 << 31) - 1
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

# Built-in type OIDs (stable across PostgreSQL versions).
BOOL, BYTEA, CHAR, NAME, INT8, INT2, INT2VECTOR, INT4, REGPROC, TEXT, OID = (
    16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26,
)  # fmt: skip
TID, XID, CID, OIDVECTOR, JSON, XML = 27, 28, 29, 30, 114, 142
POINT, LSEG, PATH, BOX, POLYGON, LINE, CIDR = 600, 601, 602, 603, 604, 628, 650
FLOAT4, FLOAT8, CIRCLE, MACADDR8, MONEY, MACADDR, INET = 700, 701, 718, 774, 790, 829, 869
BPCHAR, VARCHAR, DATE, TIME, TIMESTAMP, TIMESTAMPTZ = 1042, 1043, 1082, 1083, 1114, 1184
INTERVAL, TIMETZ, BIT, VARBIT, NUMERIC, REFCURSOR = 1186, 1266, 1560, 1562, 1700, 1790
UUID, TXID_SNAPSHOT, PG_LSN, TSVECTOR, JSONB, JSONPATH = 2950, 2970, 3220, 3614, 3802, 4072
XID8, PG_SNAPSHOT = 5069, 5038

#: Subtype of each built-in range type, and range type of each built-in multirange.
_RANGE_SUBTYPE = {
    3904: INT4,
    3906: NUMERIC,
    3908: TIMESTAMP,
    3910: TIMESTAMPTZ,
    3912: DATE,
    3926: INT8,
}
_MULTIRANGE_RANGE = {4451: 3904, 4532: 3906, 4533: 3908, 4534: 3910, 4535: 3912, 4536: 3926}

_I16 = Struct("!h")
_U16 = Struct("!H")
_I32 = Struct("!i")
_U32 = Struct("!I")
_I64 = Struct("!q")
_U64 = Struct("!Q")
_F64 = Struct("!d")
_FLOAT_LE = Struct("<f")
_NUMERIC_HEAD = Struct("!hhHh")  # ndigits, weight, sign, dscale
_TIMETZ = Struct("!qi")  # time µs, zone seconds west of UTC
_INTERVAL = Struct("!qii")  # time µs, days, months
_ARRAY_HEAD = Struct("!iiI")  # ndim, has-nulls flag, element type OID
_RANGE_BOUND = _I32

_NUMERIC_POS, _NUMERIC_NEG = 0x0000, 0x4000
_NUMERIC_NAN, _NUMERIC_PINF, _NUMERIC_NINF = 0xC000, 0xD000, 0xF000

#: Multiplier that turns n fractional-second digits into microseconds (n = 1..6).
_FRAC_SCALE = (0, 100_000, 10_000, 1_000, 100, 10, 1)

_BACKSLASH, _QUOTE, _LBRACE, _RBRACE, _LBRACKET = 0x5C, 0x22, 0x7B, 0x7D, 0x5B
#: array_isspace / C-locale isspace.
_SPACE = frozenset(b" \t\n\r\v\f")

_UNIX_EPOCH = datetime(1970, 1, 1)
_UNIX_EPOCH_UTC = datetime(1970, 1, 1, tzinfo=UTC)
_ORDINAL_1970 = 719_163  # date(1970, 1, 1).toordinal()


def _binary_error(what: str, exc: Exception | None = None) -> ValueError:
    detail = f": {exc}" if exc is not None else ""
    return ValueError(f"malformed binary {what} value{detail}")


# --------------------------------------------------------------------------- calendar


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (astronomical year numbering).

    Integer arithmetic (H. Hinnant's algorithm): no datetime objects, any year.
    """
    if month <= 2:
        year -= 1
        month += 9
    else:
        month -= 3
    era = year // 400
    yoe = year - era * 400
    doe = yoe * 365 + yoe // 4 - yoe // 100 + (153 * month + 2) // 5 + day - 1
    return era * 146_097 + doe - 719_468


def _civil_from_days(days: int) -> tuple[int, int, int]:
    """Inverse of :func:`_days_from_civil`: (astronomical year, month, day)."""
    days += 719_468
    era = days // 146_097
    doe = days - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (month <= 2), month, day


# --------------------------------------------------------------------------- text parsers


def _date_text_days(value: bytes) -> int:
    """ISO date text ("2024-05-06", "0044-03-15 BC", "infinity") to clamped days since 1970."""
    if not value:
        raise ValueError("empty date")
    if value[0] > 0x39 or value[0] == 0x2D:  # 'i' or '-': only the infinities
        if value == b"infinity":
            return DATE_MAX
        if value == b"-infinity":
            return DATE_MIN
        raise ValueError(f"invalid date {value!r}")
    if value.endswith(b" BC"):
        # Year N BC is astronomical year 1-N <= 0: always before 0001-01-01.
        return DATE_MIN
    dash = value.index(b"-", 4)  # years have at least 4 digits, maybe more
    year = int(value[:dash])
    if year > 9999:
        return DATE_MAX
    return _days_from_civil(year, int(value[dash + 1 : dash + 3]), int(value[dash + 4 : dash + 6]))


def _fraction_us(frac: bytes) -> int:
    """ "123" (digits after the decimal point) to microseconds."""
    if not 1 <= len(frac) <= 6:
        raise ValueError(f"invalid fractional seconds {frac!r}")
    return int(frac) * _FRAC_SCALE[len(frac)]


def _timestamp_text_us(value: bytes, with_zone: bool) -> int:
    """ISO timestamp[tz] text to clamped microseconds since 1970-01-01 (UTC for timestamptz).

    Forms: ``YYYY-MM-DD HH:MM:SS[.f{1,6}][+-HH[:MM[:SS]]][ BC]``, years of four or
    more digits, and ``infinity``/``-infinity``.
    """
    try:
        return _parse_timestamp(value, with_zone)
    except IndexError as exc:  # truncated text: slicing past the end
        raise ValueError(f"invalid timestamp {value!r}") from exc


def _parse_timestamp(value: bytes, with_zone: bool) -> int:
    first = value[0]
    if first > 0x39 or first == 0x2D:  # 'i' or '-': only the infinities
        if value == b"infinity":
            return TIMESTAMP_MAX
        if value == b"-infinity":
            return TIMESTAMP_MIN
        raise ValueError(f"invalid timestamp {value!r}")
    end = len(value)
    dash = value.index(b"-", 4)
    t = dash + 7  # start of HH
    year = int(value[:dash])
    if value.endswith(b" BC"):
        end -= 3
        year = 1 - year  # astronomical numbering: 1 BC is year 0
    days = _days_from_civil(year, int(value[dash + 1 : dash + 3]), int(value[dash + 4 : dash + 6]))
    if value[t + 2] != 0x3A or value[t + 5] != 0x3A:  # ':'
        raise ValueError(f"invalid timestamp {value!r}")
    secs = int(value[t : t + 2]) * 3600 + int(value[t + 3 : t + 5]) * 60 + int(value[t + 6 : t + 8])
    pos = t + 8
    micros = 0
    if with_zone:
        zone = value.find(b"+", pos)
        if zone < 0:
            zone = value.find(b"-", pos)
            if zone < 0:
                raise ValueError(f"timestamptz without a UTC offset: {value!r}")
        if zone > pos:
            if value[pos] != 0x2E:  # '.'
                raise ValueError(f"invalid timestamp {value!r}")
            micros = _fraction_us(value[pos + 1 : zone])
        offset_len = end - zone - 1
        offset = int(value[zone + 1 : zone + 3]) * 3600
        if offset_len > 2:
            offset += int(value[zone + 4 : zone + 6]) * 60
            if offset_len > 5:
                offset += int(value[zone + 7 : zone + 9])
        # The text is local time at that offset: UTC = local - offset.
        secs = secs - offset if value[zone] == 0x2B else secs + offset
    elif end > pos:
        if value[pos] != 0x2E:
            raise ValueError(f"invalid timestamp {value!r}")
        micros = _fraction_us(value[pos + 1 : end])
    result = (days * 86_400 + secs) * 1_000_000 + micros
    if result > TIMESTAMP_MAX:
        return TIMESTAMP_MAX
    if result < TIMESTAMP_MIN:
        return TIMESTAMP_MIN
    return result


def _time_text_us(value: bytes) -> int:
    """ "HH:MM:SS[.ffffff]" to microseconds since midnight; 24:00:00 clamps to TIME_MAX."""
    if len(value) < 8 or value[2] != 0x3A or value[5] != 0x3A:
        raise ValueError(f"invalid time {value!r}")
    micros = (int(value[0:2]) * 3600 + int(value[3:5]) * 60 + int(value[6:8])) * 1_000_000
    if len(value) > 8:
        if value[8] != 0x2E:
            raise ValueError(f"invalid time {value!r}")
        micros += _fraction_us(value[9:])
    return TIME_MAX if micros > TIME_MAX else micros


def _bytea_text(value: bytes) -> bytes:
    """bytea text (hex ``\\x0a0b``, or the pre-9.0 escape format) to the raw bytes."""
    if value[:2] == b"\\x":
        try:
            return binascii.unhexlify(value[2:])
        except binascii.Error as exc:
            raise ValueError(f"invalid bytea hex text: {exc}") from exc
    if _BACKSLASH not in value:
        return value
    out = bytearray()
    pos = 0
    n = len(value)
    while pos < n:
        c = value[pos]
        if c != _BACKSLASH:
            out.append(c)
            pos += 1
        elif value[pos + 1 : pos + 2] == b"\\":
            out.append(_BACKSLASH)
            pos += 2
        else:
            octal = value[pos + 1 : pos + 4]
            if len(octal) != 3 or not all(0x30 <= d <= 0x37 for d in octal):
                raise ValueError(f"invalid bytea escape at byte {pos} of {value[:40]!r}")
            out.append(int(octal, 8))
            pos += 4
    return bytes(out)


# --------------------------------------------------------------------------- numeric


def numeric_typmod(typmod: int) -> tuple[int, int] | None:
    """(precision, scale) of a numeric type modifier, or None without one.

    PostgreSQL 15 stores the scale in the low 11 bits as a signed number
    (numeric(3,-2) rounds to hundreds; numeric(2,5) holds only fractions).
    """
    if typmod < 4:  # -1: no typmod (VARHDRSZ is 4)
        return None
    bits = typmod - 4
    return (bits >> 16) & 0xFFFF, ((bits & 0x7FF) ^ 0x400) - 0x400


def _avro_decimal_shape(precision: int, scale: int) -> tuple[int, int]:
    """Avro (precision, scale) holding every numeric(precision, scale) value exactly."""
    avro_scale = max(scale, 0)
    return max(precision - min(scale, 0), avro_scale), avro_scale


#: Small powers of ten, precomputed for the hot path.
_POW10: tuple[int, ...] = tuple(10**n for n in range(64))


def _pow10(n: int) -> int:
    """10**n for n >= 0 (typed: ``10**n`` is Any to mypy since n could be negative)."""
    return _POW10[n] if n < 64 else int(10**n)


def _numeric_text_unscaled(value: bytes, scale: int) -> int:
    """Decimal text to its unscaled integer at ``scale`` (>= 0); never rounds."""
    dot = value.find(b".")
    if dot < 0:
        if value[-1] > 0x39:  # NaN, Infinity, -Infinity
            raise ValueError(f"numeric {value.decode()} is not representable as an Avro decimal")
        return int(value) * _pow10(scale)
    frac = len(value) - dot - 1
    digits = value[:dot] + value[dot + 1 :]
    if frac == scale:
        return int(digits)
    if frac < scale:
        return int(digits) * _pow10(scale - frac)
    # More fractional digits than the schema's scale: exact only if they are zeros.
    extra = value[len(value) - (frac - scale) :]
    if extra.strip(b"0"):
        raise ValueError(f"numeric {value.decode()} has more than {scale} fractional digits")
    return int(digits[: len(digits) - (frac - scale)])


#: Struct of n big-endian uint16 base-10000 digits, for the usual short numerics.
_DIGITS = tuple(Struct(f"!{n}H") for n in range(64))


def _numeric_binary(value: bytes) -> tuple[int, tuple[int, ...], int, int]:
    """numeric_send bytes to (sign, base-10000 digits, weight, dscale).

    Layout: int16 ndigits, int16 weight (base-10000 exponent of the first digit),
    uint16 sign (0x4000 negative, 0xC000 NaN, 0xD000 +Inf, 0xF000 -Inf), int16
    dscale (display scale), then ndigits base-10000 digits.
    """
    try:
        ndigits, weight, sign, dscale = _NUMERIC_HEAD.unpack_from(value)
    except StructError as exc:
        raise _binary_error("numeric", exc) from exc
    if ndigits < 0 or len(value) != 8 + 2 * ndigits:
        raise _binary_error("numeric")
    if ndigits < 64:
        digits: tuple[int, ...] = _DIGITS[ndigits].unpack_from(value, 8)
    else:
        digits = tuple(digit for (digit,) in _U16.iter_unpack(value[8:]))
    return sign, digits, weight, dscale


def _numeric_binary_unscaled(value: bytes, scale: int) -> int:
    sign, digits, weight, _dscale = _numeric_binary(value)
    if sign not in (_NUMERIC_POS, _NUMERIC_NEG):
        special = _render_numeric(value).decode()
        raise ValueError(f"numeric {special} is not representable as an Avro decimal")
    acc = 0
    for digit in digits:
        acc = acc * 10_000 + digit
    shift = 4 * (weight - len(digits) + 1) + scale  # power of ten of acc's last digit, scaled
    if shift >= 0:
        unscaled = acc * _pow10(shift)
    else:
        unscaled, rest = divmod(acc, _pow10(-shift))
        if rest:
            raise ValueError(f"numeric value has more than {scale} fractional digits")
    return -unscaled if sign == _NUMERIC_NEG else unscaled


def _render_numeric(value: bytes) -> bytes:
    """numeric_out of a numeric_send value: exactly dscale fractional digits.

    Built from the digit strings, not through a Python int: an unconstrained
    numeric may have 147,000 digits, beyond Python's int/str conversion limit.
    """
    sign, digits, weight, dscale = _numeric_binary(value)
    if sign == _NUMERIC_NAN:
        return b"NaN"
    if sign == _NUMERIC_PINF:
        return b"Infinity"
    if sign == _NUMERIC_NINF:
        return b"-Infinity"
    if sign not in (_NUMERIC_POS, _NUMERIC_NEG):
        raise _binary_error("numeric")
    text = "".join(f"{digit:04d}" for digit in digits)
    point = 4 * (weight + 1)  # decimal digits of ``text`` before the decimal point
    if point >= len(text):
        whole, frac = text + "0" * (point - len(text)), ""
    elif point <= 0:
        whole, frac = "", "0" * -point + text
    else:
        whole, frac = text[:point], text[point:]
    whole = whole.lstrip("0") or "0"
    if dscale > 0:
        # get_str_from_var pads with zeros, or truncates digits beyond dscale (none in practice).
        whole = f"{whole}.{frac[:dscale].ljust(dscale, '0')}"
    return ("-" + whole if sign == _NUMERIC_NEG else whole).encode()


def _decimal_codec(precision: int, scale: int) -> ColumnCodec:
    avro_precision, avro_scale = _avro_decimal_shape(precision, scale)
    limit = 10**avro_precision
    avro_type = {
        "type": "bytes",
        "logicalType": "decimal",
        "precision": avro_precision,
        "scale": avro_scale,
    }

    def checked(unscaled: int) -> int:
        if not -limit < unscaled < limit:
            raise ValueError(f"numeric value exceeds decimal({avro_precision},{avro_scale})")
        return unscaled

    def from_text(value: bytes) -> bytes:
        dot = value.find(b".")
        if dot > 0 and len(value) - dot - 1 == avro_scale:
            # PostgreSQL prints exactly the column's scale: the common case.
            unscaled = int(value.replace(b".", b""))
        else:
            unscaled = _numeric_text_unscaled(value, avro_scale)
        if not -limit < unscaled < limit:
            raise ValueError(f"numeric value exceeds decimal({avro_precision},{avro_scale})")
        # Avro decimal: minimal two's-complement big-endian bytes, length-prefixed
        # (at most 420 bytes for 1000 digits: the length's varint is in the table).
        # Inline on purpose, here and in from_binary: a shared helper's call
        # measured ~28 ns (4%) more per numeric value.
        data = unscaled.to_bytes(
            (unscaled + (unscaled < 0)).bit_length() // 8 + 1, "big", signed=True
        )
        return VARINT_LAST[len(data) << 1] + data

    def from_binary(value: bytes) -> bytes:
        unscaled = checked(_numeric_binary_unscaled(value, avro_scale))
        data = unscaled.to_bytes(
            (unscaled + (unscaled < 0)).bit_length() // 8 + 1, "big", signed=True
        )
        return encode_long(len(data)) + data

    def to_python(value: bytes) -> Decimal:
        return Decimal(f"{checked(_numeric_text_unscaled(value, avro_scale))}E-{avro_scale}")

    return ColumnCodec(avro_type, from_text, from_binary, to_python)


# --------------------------------------------------------------------------- floats as text


def _float_layout(value: float, shortest: str, fixed_below: int) -> bytes:
    """PostgreSQL's shortest float output from Python's shortest digits.

    PostgreSQL (Ryu, extra_float_digits > 0) prints fixed notation when the
    decimal exponent X is in [-4, fixed_below) -- 15 for float8, 6 for float4 --
    and ``d.ddde+XX`` otherwise; Python's repr switches at 16 and appends ".0".
    """
    if value != value:
        return b"NaN"
    if value in (float("inf"), float("-inf")):
        return b"Infinity" if value > 0 else b"-Infinity"
    negative = shortest.startswith("-")
    if value == 0:
        return b"-0" if negative else b"0"
    sign, digit_tuple, exponent = Decimal(shortest).as_tuple()
    digits = "".join(map(str, digit_tuple)).rstrip("0")
    assert isinstance(exponent, int)
    exp10 = exponent + len(digit_tuple) - 1  # power of ten of the first digit
    if -4 <= exp10 < fixed_below:
        if exp10 >= 0:
            whole = digits[: exp10 + 1].ljust(exp10 + 1, "0")
            frac = digits[exp10 + 1 :]
            text = f"{whole}.{frac}" if frac else whole
        else:
            text = "0." + "0" * (-exp10 - 1) + digits
    else:
        mantissa = f"{digits[0]}.{digits[1:]}" if len(digits) > 1 else digits
        text = f"{mantissa}e{'-' if exp10 < 0 else '+'}{abs(exp10):02d}"
    return ("-" + text if sign else text).encode()


def _float8_text(value: float) -> bytes:
    return _float_layout(value, repr(value), 15)


def _float4_text(value: float) -> bytes:
    # Python has no float32 repr: find the fewest significant digits that round-trip.
    shortest = ""
    for digits in range(1, 10):
        shortest = f"{value:.{digits - 1}e}"
        if _FLOAT_LE.unpack(_FLOAT_LE.pack(float(shortest)))[0] == value:
            break
    return _float_layout(value, shortest, 6)


def _render_float8(value: bytes) -> bytes:
    if len(value) != 8:
        raise _binary_error("float8")
    return _float8_text(_F64.unpack(value)[0])


def _render_float4(value: bytes) -> bytes:
    if len(value) != 4:
        raise _binary_error("float4")
    return _float4_text(_FLOAT_LE.unpack(value[::-1])[0])


# --------------------------------------------------------------------------- date/time text


def _seconds_fraction(micros: int) -> str:
    """AppendSeconds: fractional digits without trailing zeros, or nothing."""
    return "." + f"{micros:06d}".rstrip("0") if micros else ""


def _date_text(days_since_1970: int) -> str:
    """EncodeDateOnly (ISO): years of at least 4 digits, BC suffix for years <= 0."""
    year, month, day = _civil_from_days(days_since_1970)
    if year > 0:
        return f"{year:04d}-{month:02d}-{day:02d}"
    return f"{1 - year:04d}-{month:02d}-{day:02d} BC"


def _render_date(value: bytes) -> bytes:
    if len(value) != 4:
        raise _binary_error("date")
    (days,) = _I32.unpack(value)
    if days == _INT32_MAX:
        return b"infinity"
    if days == _INT32_MIN:
        return b"-infinity"
    return _date_text(days + _PG_EPOCH_DAYS).encode()


def _time_text(micros: int) -> str:
    secs, frac = divmod(micros, 1_000_000)
    minutes, sec = divmod(secs, 60)
    hour, minute = divmod(minutes, 60)
    return f"{hour:02d}:{minute:02d}:{sec:02d}{_seconds_fraction(frac)}"


def _render_time(value: bytes) -> bytes:
    if len(value) != 8:
        raise _binary_error("time")
    return _time_text(_I64.unpack(value)[0]).encode()


def _zone_text(seconds_west: int) -> str:
    """EncodeTimezone: the offset is stored west-positive, printed east-positive."""
    sign = "+" if seconds_west <= 0 else "-"
    minutes, sec = divmod(abs(seconds_west), 60)
    hour, minute = divmod(minutes, 60)
    if sec:
        return f"{sign}{hour:02d}:{minute:02d}:{sec:02d}"
    if minute:
        return f"{sign}{hour:02d}:{minute:02d}"
    return f"{sign}{hour:02d}"


def _render_timetz(value: bytes) -> bytes:
    if len(value) != 12:
        raise _binary_error("timetz")
    micros, zone = _TIMETZ.unpack(value)
    return (_time_text(micros) + _zone_text(zone)).encode()


def _timestamp_text(pg_micros: int, zone: str) -> str:
    """EncodeDateTime (ISO) of µs since 2000-01-01; ``zone`` is "+00" or ""."""
    days, rest = divmod(pg_micros, _US_PER_DAY)
    year, month, day = _civil_from_days(days + _PG_EPOCH_DAYS)
    clock = _time_text(rest)
    if year > 0:
        return f"{year:04d}-{month:02d}-{day:02d} {clock}{zone}"
    return f"{1 - year:04d}-{month:02d}-{day:02d} {clock}{zone} BC"


def _render_timestamp(value: bytes) -> bytes:
    if len(value) != 8:
        raise _binary_error("timestamp")
    (micros,) = _I64.unpack(value)
    if micros == _INT64_MAX:
        return b"infinity"
    if micros == _INT64_MIN:
        return b"-infinity"
    return _timestamp_text(micros, "").encode()


def _render_timestamptz(value: bytes) -> bytes:
    # The session runs with TimeZone=UTC, so PostgreSQL prints every instant at +00.
    if len(value) != 8:
        raise _binary_error("timestamptz")
    (micros,) = _I64.unpack(value)
    if micros == _INT64_MAX:
        return b"infinity"
    if micros == _INT64_MIN:
        return b"-infinity"
    return _timestamp_text(micros, "+00").encode()


def _trunc_div(a: int, b: int) -> int:
    """C integer division (truncates toward zero), as PostgreSQL's interval2itm uses."""
    q = abs(a) // b
    return -q if a < 0 else q


def _render_interval(value: bytes) -> bytes:
    """EncodeInterval with IntervalStyle=postgres: ``1 year 2 mons -3 days +04:05:06.5``."""
    if len(value) != 16:
        raise _binary_error("interval")
    micros, days, months = _INTERVAL.unpack(value)
    year = _trunc_div(months, 12)
    month = months - year * 12
    hour = _trunc_div(micros, 3_600_000_000)
    micros -= hour * 3_600_000_000
    minute = _trunc_div(micros, 60_000_000)
    micros -= minute * 60_000_000
    sec = _trunc_div(micros, 1_000_000)
    fsec = micros - sec * 1_000_000
    parts: list[str] = []
    is_zero = True
    is_before = False
    for amount, unit in ((year, "year"), (month, "mon"), (days, "day")):
        if amount == 0:
            continue
        # Each nonzero field makes the next one print an explicit '+' (PostgreSQL quirk).
        plus = "+" if is_before and amount > 0 else ""
        plural = "s" if amount != 1 else ""
        parts.append(f"{'' if is_zero else ' '}{plus}{amount} {unit}{plural}")
        is_before = amount < 0
        is_zero = False
    if is_zero or hour or minute or sec or fsec:
        minus = hour < 0 or minute < 0 or sec < 0 or fsec < 0
        sign = "-" if minus else ("+" if is_before else "")
        parts.append(
            f"{'' if is_zero else ' '}{sign}{abs(hour):02d}:{abs(minute):02d}:{abs(sec):02d}"
            f"{_seconds_fraction(abs(fsec))}"
        )
    return "".join(parts).encode()


# --------------------------------------------------------------------------- other renderers


def _render_money(value: bytes) -> bytes:
    """cash_out in the C / en_US locales: ``$1,234.56``, ``-$1.00``."""
    if len(value) != 8:
        raise _binary_error("money")
    (cents,) = _I64.unpack(value)
    digits = f"{abs(cents):03d}"
    whole = f"{int(digits[:-2]):,}"
    return f"{'-' if cents < 0 else ''}${whole}.{digits[-2:]}".encode()


def _ipv6_text(addr: bytes) -> str:
    """inet_net_ntop_ipv6 as PostgreSQL has it (differs from Python's ipaddress).

    The first longest run (>= 2) of zero words becomes ``::``; ``::a.b.c.d``,
    ``::ffff:a.b.c.d`` and ``::0.0.x.y`` keep an embedded dotted IPv4 address.
    """
    words = [int.from_bytes(addr[i : i + 2], "big") for i in range(0, 16, 2)]
    best_base, best_len, cur_base, cur_len = -1, 0, -1, 0
    for i, word in enumerate(words):
        if word == 0:
            if cur_base == -1:
                cur_base, cur_len = i, 1
            else:
                cur_len += 1
        elif cur_base != -1:
            if best_base == -1 or cur_len > best_len:
                best_base, best_len = cur_base, cur_len
            cur_base = -1
    if cur_base != -1 and (best_base == -1 or cur_len > best_len):
        best_base, best_len = cur_base, cur_len
    if best_base != -1 and best_len < 2:
        best_base = -1
    out: list[str] = []
    for i, word in enumerate(words):
        if best_base != -1 and best_base <= i < best_base + best_len:
            if i == best_base:
                out.append(":")
            continue
        if i != 0:
            out.append(":")
        if (
            i == 6
            and best_base == 0
            and (
                best_len == 6
                or (best_len == 7 and words[7] != 0x0001)
                or (best_len == 5 and words[5] == 0xFFFF)
            )
        ):
            out.append(".".join(str(b) for b in addr[12:16]))
            break
        out.append(f"{word:x}")
    if best_base != -1 and best_base + best_len == 8:
        out.append(":")
    return "".join(out)


def _network_renderer(is_cidr_type: bool) -> Renderer:
    """inet_out / cidr_out of inet_send bytes: family, bits, is_cidr, length, address."""

    def render(value: bytes) -> bytes:
        if len(value) < 4 or len(value) != 4 + value[3]:
            raise _binary_error("inet")
        family, bits, addr = value[0], value[1], value[4:]
        if family == 2 and len(addr) == 4:  # PGSQL_AF_INET
            text = ".".join(str(b) for b in addr)
            has_mask = bits != 32
        elif family == 3 and len(addr) == 16:  # PGSQL_AF_INET6
            text = _ipv6_text(addr)
            has_mask = bits != 128
        else:
            raise _binary_error("inet")
        # inet omits a full-length mask; cidr always shows it.
        if has_mask or is_cidr_type:
            text = f"{text}/{bits}"
        return text.encode()

    return render


def _macaddr_renderer(size: int) -> Renderer:
    def render(value: bytes) -> bytes:
        if len(value) != size:
            raise _binary_error("macaddr")
        return value.hex(":").encode()

    return render


def _render_bits(value: bytes) -> bytes:
    """bit/varbit: int32 bit length, then the bits, most significant first."""
    try:
        (nbits,) = _I32.unpack_from(value)
    except StructError as exc:
        raise _binary_error("bit", exc) from exc
    data = value[4:]
    if nbits < 0 or len(data) != (nbits + 7) // 8:
        raise _binary_error("bit")
    if not nbits:
        return b""
    return f"{int.from_bytes(data, 'big'):0{len(data) * 8}b}"[:nbits].encode()


def _render_uuid(value: bytes) -> bytes:
    if len(value) != 16:
        raise _binary_error("uuid")
    h = value.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}".encode()


def _render_bytea(value: bytes) -> bytes:
    return b"\\x" + binascii.hexlify(value)


def _render_identity(value: bytes) -> bytes:
    return value


def _render_versioned_text(value: bytes) -> bytes:
    """jsonb and jsonpath: a version byte (1), then the text form."""
    if value[:1] != b"\x01":
        raise ValueError(f"unsupported jsonb/jsonpath binary version {value[:1]!r}")
    return value[1:]


def _render_char(value: bytes) -> bytes:
    """charout (PostgreSQL 15): bytes >= 0x80 print as \\ooo octal, NUL as empty."""
    if len(value) != 1:
        raise _binary_error('"char"')
    byte = value[0]
    if byte >= 0x80:
        return f"\\{byte:03o}".encode()
    return value if byte else b""


def _render_bool(value: bytes) -> bytes:
    if value == b"\x01":
        return b"t"
    if value == b"\x00":
        return b"f"
    raise _binary_error("bool")


def _int_renderer(size: int, signed: bool) -> Renderer:
    def render(value: bytes) -> bytes:
        if len(value) != size:
            raise _binary_error("integer")
        return str(int.from_bytes(value, "big", signed=signed)).encode()

    return render


def _render_tid(value: bytes) -> bytes:
    if len(value) != 6:
        raise _binary_error("tid")
    return f"({_U32.unpack_from(value)[0]},{_U16.unpack_from(value, 4)[0]})".encode()


def _render_pg_lsn(value: bytes) -> bytes:
    if len(value) != 8:
        raise _binary_error("pg_lsn")
    (lsn,) = _U64.unpack(value)
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}".encode()


def _render_snapshot(value: bytes) -> bytes:
    """pg_snapshot / txid_snapshot: int32 nxip, int64 xmin, int64 xmax, nxip int64 xids."""
    try:
        (nxip,) = _I32.unpack_from(value)
        xmin, xmax = _U64.unpack_from(value, 4)[0], _U64.unpack_from(value, 12)[0]
        if len(value) != 20 + 8 * nxip:
            raise _binary_error("pg_snapshot")
        xips = ",".join(str(x) for (x,) in _U64.iter_unpack(value[20:]))
    except StructError as exc:
        raise _binary_error("pg_snapshot", exc) from exc
    return f"{xmin}:{xmax}:{xips}".encode()


def _floats(value: bytes, count: int, what: str) -> list[str]:
    if len(value) != 8 * count:
        raise _binary_error(what)
    return [_float8_text(x).decode() for (x,) in _F64.iter_unpack(value)]


def _points_text(coords: list[str]) -> str:
    return ",".join(f"({coords[i]},{coords[i + 1]})" for i in range(0, len(coords), 2))


def _render_point(value: bytes) -> bytes:
    return f"({','.join(_floats(value, 2, 'point'))})".encode()


def _render_lseg(value: bytes) -> bytes:
    return f"[{_points_text(_floats(value, 4, 'lseg'))}]".encode()


def _render_box(value: bytes) -> bytes:
    return _points_text(_floats(value, 4, "box")).encode()


def _render_line(value: bytes) -> bytes:
    return f"{{{','.join(_floats(value, 3, 'line'))}}}".encode()


def _render_circle(value: bytes) -> bytes:
    x, y, r = _floats(value, 3, "circle")
    return f"<({x},{y}),{r}>".encode()


def _render_path(value: bytes) -> bytes:
    """path_send: closed flag byte, int32 npts, points; closed prints (...), open [...]."""
    if len(value) < 5:
        raise _binary_error("path")
    (npts,) = _I32.unpack_from(value, 1)
    text = _points_text(_floats(value[5:], 2 * npts, "path"))
    return (f"({text})" if value[0] else f"[{text}]").encode()


def _render_polygon(value: bytes) -> bytes:
    if len(value) < 4:
        raise _binary_error("polygon")
    (npts,) = _I32.unpack_from(value)
    return f"({_points_text(_floats(value[4:], 2 * npts, 'polygon'))})".encode()


def _render_tsvector(value: bytes) -> bytes:
    """tsvectorout of tsvectorsend: ``'lexeme':1A,2 'other'``; ' and \\ are doubled."""
    try:
        (count,) = _I32.unpack_from(value)
        pos = 4
        out: list[bytes] = []
        for _ in range(count):
            end = value.index(b"\x00", pos)
            lexeme = value[pos:end].replace(b"\\", b"\\\\").replace(b"'", b"''")
            (npos,) = _U16.unpack_from(value, end + 1)
            pos = end + 3
            item = b"'" + lexeme + b"'"
            if npos:
                positions = []
                for (word,) in _U16.iter_unpack(value[pos : pos + 2 * npos]):
                    weight = ("", "C", "B", "A")[word >> 14]
                    positions.append(f"{word & 0x3FFF}{weight}")
                pos += 2 * npos
                item += b":" + ",".join(positions).encode()
            out.append(item)
    except (StructError, ValueError) as exc:
        raise _binary_error("tsvector", exc) from exc
    if pos != len(value):
        raise _binary_error("tsvector")
    return b" ".join(out)


#: Built-in types whose text form is rebuilt from the binary value by a fixed function.
_RENDERERS: dict[int, Renderer] = {
    BOOL: _render_bool,
    BYTEA: _render_bytea,
    CHAR: _render_char,
    NAME: _render_identity,
    INT8: _int_renderer(8, True),
    INT2: _int_renderer(2, True),
    INT4: _int_renderer(4, True),
    TEXT: _render_identity,
    OID: _int_renderer(4, False),
    TID: _render_tid,
    XID: _int_renderer(4, False),
    CID: _int_renderer(4, False),
    JSON: _render_identity,
    XML: _render_identity,
    POINT: _render_point,
    LSEG: _render_lseg,
    PATH: _render_path,
    BOX: _render_box,
    POLYGON: _render_polygon,
    LINE: _render_line,
    CIDR: _network_renderer(True),
    FLOAT4: _render_float4,
    FLOAT8: _render_float8,
    CIRCLE: _render_circle,
    MACADDR8: _macaddr_renderer(8),
    MONEY: _render_money,
    MACADDR: _macaddr_renderer(6),
    INET: _network_renderer(False),
    BPCHAR: _render_identity,
    VARCHAR: _render_identity,
    DATE: _render_date,
    TIME: _render_time,
    TIMESTAMP: _render_timestamp,
    TIMESTAMPTZ: _render_timestamptz,
    INTERVAL: _render_interval,
    TIMETZ: _render_timetz,
    BIT: _render_bits,
    VARBIT: _render_bits,
    NUMERIC: _render_numeric,
    REFCURSOR: _render_identity,
    UUID: _render_uuid,
    TXID_SNAPSHOT: _render_snapshot,
    PG_LSN: _render_pg_lsn,
    TSVECTOR: _render_tsvector,
    JSONB: _render_versioned_text,
    JSONPATH: _render_versioned_text,
    XID8: _int_renderer(8, False),
    PG_SNAPSHOT: _render_snapshot,
}

#: Extension types (no fixed OID) whose send function emits the text form as is.
_TEXT_SEND_EXTENSION_TYPES = frozenset({"citext"})


def _quote_element(text: bytes, specials: bytes, quote_null: bool) -> bytes:
    """array_out quoting: quotes when needed, a backslash before each \" and \\ inside."""
    needs = not text or (quote_null and text.upper() == b"NULL")
    if not needs:
        for c in text:
            if c in specials:
                needs = True
                break
    if not needs:
        return text
    return b'"' + text.replace(b"\\", b"\\\\").replace(b'"', b'\\"') + b'"'


_ARRAY_SPECIALS_BASE = b'"\\{} \t\n\r\v\f'
_RANGE_SPECIALS = b'"\\()[], \t\n\r\v\f'
_RECORD_SPECIALS = b'"\\(), \t\n\r\v\f'


def _record_quote(text: bytes) -> bytes:
    """record_out and range_bound_escape double quotes and backslashes ("" and \\\\)."""
    return b'"' + text.replace(b"\\", b"\\\\").replace(b'"', b'""') + b'"'


def _needs_quotes(text: bytes, specials: bytes) -> bool:
    return not text or any(c in specials for c in text)


def _parse_binary_array(value: bytes) -> tuple[list[int], list[int], list[bytes | None]]:
    """array_send bytes to (dimension lengths, lower bounds, flat elements in row-major order)."""
    try:
        ndim, _has_nulls, _element_oid = _ARRAY_HEAD.unpack_from(value)
        if not 0 <= ndim <= 6:
            raise _binary_error("array")
        lengths: list[int] = []
        bounds: list[int] = []
        for i in range(ndim):
            length, lower = (
                _I32.unpack_from(value, 12 + 8 * i)[0],
                _I32.unpack_from(value, 16 + 8 * i)[0],
            )
            lengths.append(length)
            bounds.append(lower)
        pos = 12 + 8 * ndim
        total = 1 if ndim else 0
        for length in lengths:
            total *= length
        # Each element takes at least 4 bytes. A zero length only comes with
        # int2vector/oidvector ("" is sent as one dimension of length 0).
        if any(length < 0 for length in lengths) or total * 4 > len(value) - pos:
            raise _binary_error("array")
        items: list[bytes | None] = []
        append = items.append
        unpack_from = _I32.unpack_from
        for _ in range(total):
            (size,) = unpack_from(value, pos)
            pos += 4
            if size < 0:
                append(None)
            else:
                append(value[pos : pos + size])
                pos += size
    except StructError as exc:
        raise _binary_error("array", exc) from exc
    if pos != len(value):
        raise _binary_error("array")
    return lengths, bounds, items


def _array_renderer(element: Renderer, delimiter: bytes) -> Renderer:
    """array_out of array_send bytes: quoting, NULL, nesting, ``[lo:hi]=`` decoration."""
    specials = _ARRAY_SPECIALS_BASE + delimiter

    def render(value: bytes) -> bytes:
        lengths, bounds, items = _parse_binary_array(value)
        if not items:
            return b"{}"
        texts = [
            b"NULL" if item is None else _quote_element(element(item), specials, True)
            for item in items
        ]
        for length in reversed(lengths):
            texts = [
                b"{" + delimiter.join(texts[i : i + length]) + b"}"
                for i in range(0, len(texts), length)
            ]
        text = texts[0]
        if any(lower != 1 for lower in bounds):
            decoration = "".join(
                f"[{lower}:{lower + length - 1}]"
                for lower, length in zip(bounds, lengths, strict=True)
            )
            text = decoration.encode() + b"=" + text
        return text

    return render


def _vector_renderer(value: bytes) -> bytes:
    """int2vector / oidvector: sent as a 1-D array, printed space-separated."""
    _lengths, _bounds, items = _parse_binary_array(value)
    return b" ".join(
        str(int.from_bytes(item, "big", signed=len(item) == 2)).encode()
        for item in items
        if item is not None
    )


def _range_renderer(subtype: Renderer) -> Renderer:
    """range_out of range_send bytes: flags byte, then the present bounds (int32 length + value)."""

    def render(value: bytes) -> bytes:
        if not value:
            raise _binary_error("range")
        flags = value[0]
        if flags & 0x01:  # RANGE_EMPTY
            return b"empty"
        pos = 1
        bounds: list[bytes] = []
        try:
            for infinite in (flags & 0x28, flags & 0x50):  # LB_INF|LB_NULL, UB_INF|UB_NULL
                if infinite:
                    bounds.append(b"")
                    continue
                (size,) = _RANGE_BOUND.unpack_from(value, pos)
                text = subtype(value[pos + 4 : pos + 4 + size])
                pos += 4 + size
                bounds.append(_record_quote(text) if _needs_quotes(text, _RANGE_SPECIALS) else text)
        except StructError as exc:
            raise _binary_error("range", exc) from exc
        if pos != len(value):
            raise _binary_error("range")
        return (
            (b"[" if flags & 0x02 else b"(")
            + bounds[0]
            + b","
            + bounds[1]
            + (b"]" if flags & 0x04 else b")")
        )

    return render


def _multirange_renderer(range_render: Renderer) -> Renderer:
    """multirange_out: ``{[1,3),[5,7)}`` of int32 count, then (int32 length, range) pairs."""

    def render(value: bytes) -> bytes:
        try:
            (count,) = _I32.unpack_from(value)
            pos = 4
            parts = []
            for _ in range(count):
                (size,) = _I32.unpack_from(value, pos)
                parts.append(range_render(value[pos + 4 : pos + 4 + size]))
                pos += 4 + size
        except StructError as exc:
            raise _binary_error("multirange", exc) from exc
        if pos != len(value):
            raise _binary_error("multirange")
        return b"{" + b",".join(parts) + b"}"

    return render


class _RecordRenderer:
    """record_out of record_send bytes; field types are named by OID in the value itself.

    Renderers for field types are resolved through the catalog on first sight
    and cached; a field type without an exact renderer raises ValueError.
    """

    def __init__(self, catalog: TypeCatalog, type_name: str) -> None:
        self._catalog = catalog
        self._type_name = type_name
        self._fields: dict[int, Renderer | None] = {}

    def _field_renderer(self, oid: int) -> Renderer:
        if oid not in self._fields:
            try:
                field_type = self._catalog.lookup(oid)
            except KeyError as exc:
                raise ValueError(
                    f"{self._type_name} value has a field of unknown type: {exc}"
                ) from exc
            self._fields[oid] = _binary_renderer(field_type, self._catalog)
        renderer = self._fields[oid]
        if renderer is None:
            name = self._catalog.lookup(oid).name
            raise ValueError(
                _unsupported_binary_message(f"{self._type_name} (field of type {name})")
            )
        return renderer

    def __call__(self, value: bytes) -> bytes:
        parts: list[bytes] = []
        try:
            (count,) = _I32.unpack_from(value)
            pos = 4
            for _ in range(count):
                oid, size = _U32.unpack_from(value, pos)[0], _I32.unpack_from(value, pos + 4)[0]
                pos += 8
                if size < 0:
                    parts.append(b"")
                    continue
                text = self._field_renderer(oid)(value[pos : pos + size])
                pos += size
                parts.append(_record_quote(text) if _needs_quotes(text, _RECORD_SPECIALS) else text)
        except StructError as exc:
            raise _binary_error("record", exc) from exc
        if pos != len(value):
            raise _binary_error("record")
        return b"(" + b",".join(parts) + b")"


def _resolve_domain(pg_type: PgType, catalog: TypeCatalog, typmod: int) -> tuple[PgType, int]:
    """Follow domains to their base type; the innermost domain typmod applies if the column has none."""
    seen = 0
    while pg_type.kind == "d":
        if typmod == -1:
            typmod = pg_type.base_modifier
        pg_type = catalog.lookup(pg_type.base_oid)
        seen += 1
        if seen > 100:
            raise ValueError(f"domain chain of {pg_type.name} does not end")
    return pg_type, typmod


def _binary_renderer(pg_type: PgType, catalog: TypeCatalog) -> Renderer | None:
    """A function from the binary value to PostgreSQL's exact text form, or None if impossible."""
    pg_type, _typmod = _resolve_domain(pg_type, catalog, -1)
    renderer = _RENDERERS.get(pg_type.oid)
    if renderer is not None:
        return renderer
    if pg_type.oid in (INT2VECTOR, OIDVECTOR):
        return _vector_renderer
    if pg_type.kind == "e":  # enum_send sends the label
        return _render_identity
    if pg_type.is_array:
        element_type, _ = _resolve_domain(catalog.lookup(pg_type.element_oid), catalog, -1)
        element = _binary_renderer(element_type, catalog)
        if element is None:
            return None
        return _array_renderer(element, element_type.delimiter.encode())
    if pg_type.kind == "r" and pg_type.oid in _RANGE_SUBTYPE:
        return _range_renderer(_RENDERERS[_RANGE_SUBTYPE[pg_type.oid]])
    if pg_type.kind == "m" and pg_type.oid in _MULTIRANGE_RANGE:
        subtype = _RENDERERS[_RANGE_SUBTYPE[_MULTIRANGE_RANGE[pg_type.oid]]]
        return _multirange_renderer(_range_renderer(subtype))
    if pg_type.kind == "c":
        return _RecordRenderer(catalog, f"{pg_type.namespace}.{pg_type.name}")
    if pg_type.kind == "b" and pg_type.name in _TEXT_SEND_EXTENSION_TYPES:
        return _render_identity
    return None


def _unsupported_binary_message(type_name: str) -> str:
    return (
        f"the binary format of PostgreSQL type {type_name} cannot be converted to its exact "
        "text form; capture this table with binary=false (text format)"
    )


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


# --------------------------------------------------------------------------- codecs


def encode_text_value(value: bytes) -> bytes:
    """Avro string/bytes of the value as sent: length prefix, then the same bytes."""
    n = len(value)
    return (VARINT_LAST[n << 1] if n < 8192 else encode_long(n)) + value


def _to_str(value: bytes) -> str:
    return value.decode("utf-8")


def _string_codec(pg_type: PgType, catalog: TypeCatalog, avro_type: Any = "string") -> ColumnCodec:
    renderer = _binary_renderer(pg_type, catalog)
    from_binary: Encoder
    if renderer is _render_identity:
        from_binary = encode_text_value  # text-like: the binary form is the text itself
    elif renderer is not None:
        render = renderer

        def from_binary(value: bytes) -> bytes:
            return encode_text_value(render(value))

    else:
        message = _unsupported_binary_message(f"{pg_type.namespace}.{pg_type.name}")

        def from_binary(value: bytes) -> bytes:
            raise ValueError(message)

    return ColumnCodec(avro_type, encode_text_value, from_binary, _to_str)


def int_from_text(value: bytes) -> bytes:
    return encode_long(int(value))


def _fixed_int_codec(avro_type: str, size: int, signed: bool) -> ColumnCodec:
    def from_binary(value: bytes) -> bytes:
        if len(value) != size:
            raise _binary_error(f"{size}-byte integer")
        return encode_long(int.from_bytes(value, "big", signed=signed))

    return ColumnCodec(avro_type, int_from_text, from_binary, int)


_BOOL_TEXT = {b"t": TRUE, b"f": FALSE}


def bool_from_text(value: bytes) -> bytes:
    encoded = _BOOL_TEXT.get(value)
    if encoded is None:
        raise ValueError(f"invalid boolean {value!r}")
    return encoded


def _bool_from_binary(value: bytes) -> bytes:
    # boolsend sends one byte 0/1: already Avro's boolean encoding.
    if value != TRUE and value != FALSE:
        raise _binary_error("bool")
    return value


def _bool_to_python(value: bytes) -> bool:
    if value not in _BOOL_TEXT:
        raise ValueError(f"invalid boolean {value!r}")
    return value == b"t"


_FLOAT4_PACK = _FLOAT_LE.pack
_DOUBLE_LE = Struct("<d")
_DOUBLE_PACK = _DOUBLE_LE.pack


def _float4_from_text(value: bytes) -> bytes:
    # float() accepts PostgreSQL's "NaN", "Infinity" and "-Infinity".
    return _FLOAT4_PACK(float(value))


def _float8_from_text(value: bytes) -> bytes:
    return _DOUBLE_PACK(float(value))


def _float4_from_binary(value: bytes) -> bytes:
    # Big-endian IEEE 754 on the wire, little-endian in Avro.
    if len(value) != 4:
        raise _binary_error("float4")
    return value[::-1]


def _float8_from_binary(value: bytes) -> bytes:
    if len(value) != 8:
        raise _binary_error("float8")
    return value[::-1]


def _float4_to_python(value: bytes) -> float:
    result: float = _FLOAT_LE.unpack(_FLOAT4_PACK(float(value)))[0]
    return result


_BOOL_CODEC = ColumnCodec("boolean", bool_from_text, _bool_from_binary, _bool_to_python)
_FLOAT4_CODEC = ColumnCodec("float", _float4_from_text, _float4_from_binary, _float4_to_python)
_FLOAT8_CODEC = ColumnCodec("double", _float8_from_text, _float8_from_binary, float)


def _bytea_from_text(value: bytes) -> bytes:
    return encode_text_value(_bytea_text(value))


_BYTEA_CODEC = ColumnCodec("bytes", _bytea_from_text, encode_text_value, _bytea_text)


def _uuid_from_binary(value: bytes) -> bytes:
    return encode_text_value(_render_uuid(value))


def _uuid_to_python(value: bytes) -> uuid.UUID:
    return uuid.UUID(value.decode("ascii"))


_UUID_CODEC = ColumnCodec(
    {"type": "string", "logicalType": "uuid"}, encode_text_value, _uuid_from_binary, _uuid_to_python
)


def _date_from_text(value: bytes) -> bytes:
    return encode_long(_date_text_days(value))


def _date_from_binary(value: bytes) -> bytes:
    if len(value) != 4:
        raise _binary_error("date")
    (days,) = _I32.unpack(value)
    days += _PG_EPOCH_DAYS  # infinity (INT32 max/min) lands far outside and clamps
    return encode_long(DATE_MAX if days > DATE_MAX else DATE_MIN if days < DATE_MIN else days)


def _date_to_python(value: bytes) -> date:
    return date.fromordinal(_date_text_days(value) + _ORDINAL_1970)


_DATE_CODEC = ColumnCodec(
    {"type": "int", "logicalType": "date"}, _date_from_text, _date_from_binary, _date_to_python
)


def _time_from_text(value: bytes) -> bytes:
    return encode_long(_time_text_us(value))


def _time_from_binary(value: bytes) -> bytes:
    if len(value) != 8:
        raise _binary_error("time")
    (micros,) = _I64.unpack(value)
    return encode_long(TIME_MAX if micros > TIME_MAX else micros)


def _time_to_python(value: bytes) -> time:
    secs, micro = divmod(_time_text_us(value), 1_000_000)
    minutes, sec = divmod(secs, 60)
    hour, minute = divmod(minutes, 60)
    return time(hour, minute, sec, micro)


_TIME_CODEC = ColumnCodec(
    {"type": "long", "logicalType": "time-micros"},
    _time_from_text,
    _time_from_binary,
    _time_to_python,
)


#: The last timestamp text converted and its encoding: rows of one transaction often
#: share a value (``DEFAULT now()`` is the transaction's start time). One tuple, so
#: that a reader never pairs a value with another value's encoding.
_LAST_TIMESTAMP: list[tuple[bytes, bytes]] = [(b"", b"")]
_LAST_TIMESTAMPTZ: list[tuple[bytes, bytes]] = [(b"", b"")]
_ONE_MICROSECOND = timedelta(microseconds=1)
_fromisoformat = datetime.fromisoformat


def _timestamp_from_text(value: bytes) -> bytes:
    last = _LAST_TIMESTAMP[0]
    if value == last[0]:
        return last[1]
    try:
        # C fast path for years 1..9999 AD, always in range; infinity, BC and
        # five-digit years raise and take the general parser.
        parsed = _fromisoformat(value.decode("ascii"))
    except ValueError:
        parsed = None
    if parsed is not None and parsed.tzinfo is None and len(value) >= 19:
        micros = (parsed - _UNIX_EPOCH) // _ONE_MICROSECOND
    else:
        micros = _timestamp_text_us(value, False)
    encoded = encode_long(micros)
    _LAST_TIMESTAMP[0] = (value, encoded)
    return encoded


def _timestamptz_from_text(value: bytes) -> bytes:
    last = _LAST_TIMESTAMPTZ[0]
    if value == last[0]:
        return last[1]
    try:
        # C fast path for years 1..9999 AD with any offset (+00, -03, +05:30,
        # +00:53:28); infinity, BC and five-digit years take the general parser.
        parsed = _fromisoformat(value.decode("ascii"))
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        micros = _timestamp_text_us(value, True)
    else:
        micros = (parsed - _UNIX_EPOCH_UTC) // _ONE_MICROSECOND
        # The offset can carry 0001-01-01 or 9999-12-31 past the clamp bounds.
        if micros > TIMESTAMP_MAX:
            micros = TIMESTAMP_MAX
        elif micros < TIMESTAMP_MIN:
            micros = TIMESTAMP_MIN
    encoded = encode_long(micros)
    _LAST_TIMESTAMPTZ[0] = (value, encoded)
    return encoded


def _timestamp_from_binary(value: bytes) -> bytes:
    # Same wire format for both: int64 µs since 2000-01-01 (UTC for timestamptz);
    # infinity is INT64 max/min and clamps like every out-of-range instant.
    if len(value) != 8:
        raise _binary_error("timestamp")
    micros = _I64.unpack(value)[0] + _PG_EPOCH_US
    if micros > TIMESTAMP_MAX:
        micros = TIMESTAMP_MAX
    elif micros < TIMESTAMP_MIN:
        micros = TIMESTAMP_MIN
    return encode_long(micros)


def _timestamp_to_python(value: bytes) -> datetime:
    return _UNIX_EPOCH + timedelta(microseconds=_timestamp_text_us(value, False))


def _timestamptz_to_python(value: bytes) -> datetime:
    return _UNIX_EPOCH_UTC + timedelta(microseconds=_timestamp_text_us(value, True))


_TIMESTAMP_CODEC = ColumnCodec(
    {"type": "long", "logicalType": "local-timestamp-micros"},
    _timestamp_from_text,
    _timestamp_from_binary,
    _timestamp_to_python,
)
_TIMESTAMPTZ_CODEC = ColumnCodec(
    {"type": "long", "logicalType": "timestamp-micros"},
    _timestamptz_from_text,
    _timestamp_from_binary,
    _timestamptz_to_python,
)

_INT2_CODEC = _fixed_int_codec("int", 2, True)
_INT4_CODEC = _fixed_int_codec("int", 4, True)
_INT8_CODEC = _fixed_int_codec("long", 8, True)
_OID_CODEC = _fixed_int_codec("long", 4, False)

#: Codecs that depend on nothing but the type OID.
_FIXED_CODECS: dict[int, ColumnCodec] = {
    BOOL: _BOOL_CODEC,
    INT2: _INT2_CODEC,
    INT4: _INT4_CODEC,
    INT8: _INT8_CODEC,
    OID: _OID_CODEC,
    FLOAT4: _FLOAT4_CODEC,
    FLOAT8: _FLOAT8_CODEC,
    BYTEA: _BYTEA_CODEC,
    UUID: _UUID_CODEC,
    DATE: _DATE_CODEC,
    TIME: _TIME_CODEC,
    TIMESTAMP: _TIMESTAMP_CODEC,
    TIMESTAMPTZ: _TIMESTAMPTZ_CODEC,
}


def _scalar_codec(pg_type: PgType, typmod: int, catalog: TypeCatalog) -> ColumnCodec:
    fixed = _FIXED_CODECS.get(pg_type.oid)
    if fixed is not None:
        return fixed
    if pg_type.oid == NUMERIC:
        shape = numeric_typmod(typmod)
        if shape is not None:
            return _decimal_codec(*shape)
        # Unconstrained numeric: any scale, NaN and infinities; keep the exact text.
    return _string_codec(pg_type, catalog)


def _array_codec(element: ColumnCodec, delimiter: bytes, dims: int) -> ColumnCodec:
    avro_type = element.avro_type
    for _ in range(dims):
        avro_type = {"type": "array", "items": ["null", avro_type]}
    element_text = element.from_text
    element_binary = element.from_binary
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

    def from_binary(value: bytes) -> bytes:
        lengths, _bounds, items = _parse_binary_array(value)
        if not items:
            return EMPTY_ARRAY
        if len(lengths) != dims:
            raise _dimension_error(len(lengths), dims)
        encoded = [
            NULL_BRANCH if item is None else VALUE_BRANCH + element_binary(item) for item in items
        ]
        for length in reversed(lengths[1:]):
            encoded = [
                VALUE_BRANCH + encode_array(encoded[i : i + length])
                for i in range(0, len(encoded), length)
            ]
        return encode_array(encoded)

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

    return ColumnCodec(avro_type, from_text, from_binary, to_python)


def column_codec(
    type_oid: int, type_modifier: int, catalog: TypeCatalog, dimensions: int = 1
) -> ColumnCodec:
    """The codec of one column, from its Relation message facts.

    ``type_modifier`` is the column's atttypmod (-1 for none); ``dimensions``
    its declared array dimensions (pg_attribute.attndims; 0 or 1 mean one
    dimension, and it is ignored for non-array types). Raises KeyError for a
    type OID the catalog does not know.
    """
    pg_type, typmod = _resolve_domain(catalog.lookup(type_oid), catalog, type_modifier)
    if pg_type.is_array:
        element_type, element_typmod = _resolve_domain(
            catalog.lookup(pg_type.element_oid), catalog, typmod
        )
        element = _scalar_codec(element_type, element_typmod, catalog)
        return _array_codec(element, element_type.delimiter.encode(), max(dimensions, 1))
    return _scalar_codec(pg_type, typmod, catalog)
