"""Date and time codecs: date, time, timestamp, timestamptz to Avro's logical types.

date -> int date; time -> long time-micros; timestamp -> long
local-timestamp-micros; timestamptz -> long timestamp-micros (UTC) (SPEC §5).

* The walsender session runs with ``DateStyle=ISO, TimeZone=UTC`` (the source
  sets them). Text timestamptz values are still parsed with any offset:
  ``+05:30``, ``-03`` and LMT offsets with seconds such as ``+00:53:28``.
* Dates and timestamps print years with at least four digits, years beyond
  9999 with more (``10000-01-01``) and BC dates with a `` BC`` suffix
  (``0044-03-15 BC``, astronomical year -43). ``infinity``/``-infinity`` and
  every instant outside 0001-01-01 .. 9999-12-31 23:59:59.999999 clamp to
  those bounds (SPEC §5); timestamptz clamps after conversion to UTC, so
  ``10000-01-01 00:00:00+05`` is still exact.
* ``time`` accepts ``24:00:00`` (PostgreSQL allows it, Avro time-micros does
  not): it clamps to 23:59:59.999999.

Speed: timestamps in years 1..9999 take ``datetime.fromisoformat`` (C) and
fall back to the general parser for infinity, BC and five-digit years; the
last timestamp text seen is memoized, because rows of one transaction often
share ``DEFAULT now()``.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

from cdcd.avro.binary import encode_long
from cdcd.decode.codec import ColumnCodec

__all__ = [
    "DATE_CODEC",
    "DATE_MAX",
    "DATE_MIN",
    "TIMESTAMPTZ_CODEC",
    "TIMESTAMP_CODEC",
    "TIMESTAMP_MAX",
    "TIMESTAMP_MIN",
    "TIME_CODEC",
    "TIME_MAX",
]

#: Clamp bounds (SPEC §5): days / microseconds since 1970-01-01 of 0001-01-01 and
#: 9999-12-31 (23:59:59.999999), the range Python and Spark can hold.
DATE_MIN = -719_162
DATE_MAX = 2_932_896
TIMESTAMP_MIN = -62_135_596_800_000_000
TIMESTAMP_MAX = 253_402_300_799_999_999
#: 23:59:59.999999; PostgreSQL's 24:00:00 clamps to it.
TIME_MAX = 86_399_999_999

#: Multiplier that turns n fractional-second digits into microseconds (n = 1..6).
_FRAC_SCALE = (0, 100_000, 10_000, 1_000, 100, 10, 1)

_UNIX_EPOCH = datetime(1970, 1, 1)
_UNIX_EPOCH_UTC = datetime(1970, 1, 1, tzinfo=UTC)
_ORDINAL_1970 = 719_163  # date(1970, 1, 1).toordinal()


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


# --------------------------------------------------------------------------- codecs


def _date_from_text(value: bytes) -> bytes:
    return encode_long(_date_text_days(value))


def _date_to_python(value: bytes) -> date:
    return date.fromordinal(_date_text_days(value) + _ORDINAL_1970)


DATE_CODEC = ColumnCodec({"type": "int", "logicalType": "date"}, _date_from_text, _date_to_python)


def _time_from_text(value: bytes) -> bytes:
    return encode_long(_time_text_us(value))


def _time_to_python(value: bytes) -> time:
    secs, micro = divmod(_time_text_us(value), 1_000_000)
    minutes, sec = divmod(secs, 60)
    hour, minute = divmod(minutes, 60)
    return time(hour, minute, sec, micro)


TIME_CODEC = ColumnCodec(
    {"type": "long", "logicalType": "time-micros"},
    _time_from_text,
    _time_to_python,
)


#: The last timestamp text converted and its encoding: rows of one transaction often
#: share a value (``DEFAULT now()`` is the transaction's start time). One tuple, so
#: that a reader never pairs a value with another value's encoding.
_LAST_TIMESTAMP: list[tuple[bytes, bytes]] = [(b"", b"")]
_LAST_TIMESTAMPTZ: list[tuple[bytes, bytes]] = [(b"", b"")]
_ONE_MICROSECOND = timedelta(microseconds=1)
_fromisoformat = datetime.fromisoformat


def _iso(value: bytes) -> datetime | None:
    """The C fast path: years 1..9999 AD, with any offset (+00, -03, +05:30, +00:53:28);
    None for infinity, BC and five-digit years, which take the general parser."""
    try:
        return _fromisoformat(value.decode("ascii"))
    except ValueError:
        return None


def _timestamp_from_text(value: bytes) -> bytes:
    last = _LAST_TIMESTAMP[0]
    if value == last[0]:
        return last[1]
    parsed = _iso(value)
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
    parsed = _iso(value)
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


def _timestamp_to_python(value: bytes) -> datetime:
    return _UNIX_EPOCH + timedelta(microseconds=_timestamp_text_us(value, False))


def _timestamptz_to_python(value: bytes) -> datetime:
    return _UNIX_EPOCH_UTC + timedelta(microseconds=_timestamp_text_us(value, True))


TIMESTAMP_CODEC = ColumnCodec(
    {"type": "long", "logicalType": "local-timestamp-micros"},
    _timestamp_from_text,
    _timestamp_to_python,
)
TIMESTAMPTZ_CODEC = ColumnCodec(
    {"type": "long", "logicalType": "timestamp-micros"},
    _timestamptz_from_text,
    _timestamptz_to_python,
)
