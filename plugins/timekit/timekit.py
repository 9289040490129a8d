"""timekit: time zone conversion, DST-aware arithmetic, differences, parsing and formatting.

Uses the system IANA database (``/usr/share/zoneinfo``, granted read access in the manifest)
through ``zoneinfo``. When the database is unavailable, UTC and fixed offsets such as ``+05:30``
still work and named zones fail with a clear message.
"""

from __future__ import annotations

import calendar
import difflib
import functools
import math
import re
import zoneinfo
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from typing import Annotated, Literal

import msgspec

from sandbox import ToolError, tool

READ_ONLY = {"readOnlyHint": True, "idempotentHint": True, "openWorldHint": False}
MAX_FORMAT_CHARS = 500
MAX_INPUT_CHARS = 200
_UTC_NAMES = {"utc", "z", "gmt", "zulu", "etc/utc", "etc/gmt", "universal", "etc/universal", "etc/zulu"}
_OFFSET = re.compile(r"^(?:UTC|GMT)?\s*([+-])(\d{1,2})(?::?(\d{2}))?$", re.IGNORECASE)


# -- zones ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _available_zones() -> frozenset[str]:
    try:
        return frozenset(zoneinfo.available_timezones())
    except OSError:
        return frozenset()


def _no_database() -> ToolError:
    return ToolError(
        "the IANA time zone database is not available in this sandbox (/usr/share/zoneinfo cannot be "
        "read), so named zones cannot be used; UTC and fixed offsets like +05:30 still work"
    )


def _zone(name: str) -> tzinfo:
    key = name.strip()
    if not key:
        raise ToolError("time zone name is empty")
    if key.lower() in _UTC_NAMES:
        return UTC
    m = _OFFSET.match(key)
    if m:
        sign, hours, minutes = m.group(1), int(m.group(2)), int(m.group(3) or 0)
        if hours > 23 or minutes > 59:
            raise ToolError(f"offset {key!r} is out of range")
        delta = timedelta(hours=hours, minutes=minutes)
        return timezone(-delta if sign == "-" else delta)
    if len(key) > 100:
        raise ToolError("time zone name is too long")
    try:
        return zoneinfo.ZoneInfo(key)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        pass
    zones = _available_zones()
    if not zones:
        raise _no_database()
    # Be forgiving about case and spaces ("america/new york").
    folded = {z.lower(): z for z in zones}
    candidate = folded.get(key.lower().replace(" ", "_"))
    if candidate:
        return zoneinfo.ZoneInfo(candidate)
    close = difflib.get_close_matches(key.replace(" ", "_"), sorted(zones), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else "; use time_list_zones to find zone names"
    raise ToolError(f"unknown time zone {name!r}{hint}")


def _zone_name(tz: tzinfo, dt: datetime) -> str:
    key = getattr(tz, "key", None)
    if key:
        return str(key)
    if tz is UTC:
        return "UTC"
    return _offset_text(dt.utcoffset())


def _offset_text(offset: timedelta | None) -> str:
    if offset is None:
        return "+00:00"
    total = int(offset.total_seconds())
    sign = "-" if total < 0 else "+"
    total = abs(total)
    hours, rest = divmod(total, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{sign}{hours:02d}:{minutes:02d}" + (f":{seconds:02d}" if seconds else "")


# -- parsing -----------------------------------------------------------------------------------


def _parse(text: str, zone: tzinfo, what: str = "datetime") -> datetime:
    """An aware datetime from ISO 8601 text, "now", or Unix seconds; naive input is in ``zone``."""
    value = text.strip()
    if len(value) > MAX_INPUT_CHARS:
        raise ToolError(f"{what} is too long")
    if value.lower() == "now":
        return datetime.now(UTC).astimezone(zone)
    unix = value.removeprefix("@")
    if re.fullmatch(r"[+-]?\d+(\.\d+)?", unix) and (value.startswith("@") or len(unix.lstrip("+-").split(".")[0]) >= 9):
        try:
            return datetime.fromtimestamp(float(unix), UTC).astimezone(zone)
        except (OverflowError, OSError, ValueError):
            raise ToolError(f"{what} {text!r} is out of range as a Unix timestamp") from None
    iso = value
    if iso.endswith(("z", "Z")):
        iso = iso[:-1] + "+00:00"
    try:
        dt = datetime.fromisoformat(iso)
    except ValueError:
        raise ToolError(
            f"{what} {text!r} is not ISO 8601 (e.g. 2024-03-10T01:30:00, 2024-03-10 01:30+01:00, "
            "2024-03-10T01:30:00Z), 'now', or Unix seconds (@1700000000)"
        ) from None
    if dt.tzinfo is None:
        dt = _localize(dt, zone)
    return dt


def _localize(naive: datetime, zone: tzinfo, fold: int = 0) -> datetime:
    """Attach ``zone`` to a wall-clock time; a time that does not exist (DST gap) is refused."""
    dt = naive.replace(tzinfo=zone, fold=fold)
    roundtrip = dt.astimezone(UTC).astimezone(zone)
    if roundtrip.replace(tzinfo=None) != naive:
        raise ToolError(
            f"{naive.isoformat()} does not exist in {_zone_name(zone, dt)} (clocks skip it at a DST change); "
            f"the nearest valid time is {roundtrip.replace(fold=0).isoformat()}"
        )
    return dt


def _is_ambiguous(dt: datetime) -> bool:
    if dt.tzinfo is None:
        return False
    other = dt.replace(fold=1 - dt.fold)
    return other.utcoffset() != dt.utcoffset()


def _is_dst(dt: datetime) -> bool:
    return bool(dt.dst())  # fixed offsets and UTC report None: never DST


def _iso(dt: datetime) -> str:
    return dt.isoformat()


class ZonedTime(msgspec.Struct):
    iso: str
    zone: str
    utc_offset: str
    abbreviation: str | None
    is_dst: bool
    ambiguous: bool
    utc: str
    unix: float
    weekday: str


def _describe(dt: datetime) -> ZonedTime:
    utc = dt.astimezone(UTC)
    unix = utc.timestamp()
    return ZonedTime(
        iso=_iso(dt),
        zone=_zone_name(dt.tzinfo, dt),  # type: ignore[arg-type]
        utc_offset=_offset_text(dt.utcoffset()),
        abbreviation=dt.tzname(),
        is_dst=_is_dst(dt),
        ambiguous=_is_ambiguous(dt),
        utc=utc.isoformat().replace("+00:00", "Z"),
        unix=int(unix) if unix == int(unix) else unix,
        weekday=calendar.day_name[dt.weekday()],
    )


def _guard(fn):  # type: ignore[no-untyped-def]
    """Turn out-of-range date arithmetic into a ToolError."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return fn(*args, **kwargs)
        except (OverflowError, ValueError) as exc:
            raise ToolError(f"date out of range: {exc}") from None

    return wrapper


# -- tools -------------------------------------------------------------------------------------


class Conversion(msgspec.Struct):
    source: ZonedTime
    target: ZonedTime


@tool(annotations={"title": "Convert between time zones", **READ_ONLY})
@_guard
def convert(datetime: str, to_zone: str, from_zone: str = "UTC", fold: Literal[0, 1] = 0) -> Conversion:
    """Convert a date and time from one time zone to another (IANA names such as Europe/Paris, or offsets like +05:30).

    Returns both sides with their UTC offset, abbreviation and DST flag.

    Args:
        datetime: ISO 8601 date-time ("2024-07-01T09:00", "2024-07-01 09:00:00+02:00", "...Z"), "now", or Unix seconds (@1700000000). An explicit offset in the text wins over from_zone.
        to_zone: The target time zone: an IANA name (America/New_York), UTC, or a fixed offset (+05:30).
        from_zone: The zone a date-time without offset is in (default UTC).
        fold: For a wall-clock time that occurs twice (when clocks go back): 0 picks the first occurrence, 1 the second.
    """
    src_zone = _zone(from_zone)
    dst_zone = _zone(to_zone)
    src = _parse(datetime, src_zone)
    if fold and src.tzinfo is src_zone:
        src = src.replace(fold=fold)
    return Conversion(source=_describe(src), target=_describe(src.astimezone(dst_zone)))


_DURATION = re.compile(
    r"^(?P<sign>[+-])?P(?:(?P<years>\d+(?:[.,]\d+)?)Y)?(?:(?P<months>\d+(?:[.,]\d+)?)M)?(?:(?P<weeks>\d+(?:[.,]\d+)?)W)?"
    r"(?:(?P<days>\d+(?:[.,]\d+)?)D)?(?:T(?:(?P<hours>\d+(?:[.,]\d+)?)H)?(?:(?P<minutes>\d+(?:[.,]\d+)?)M)?"
    r"(?:(?P<seconds>\d+(?:[.,]\d+)?)S)?)?$",
    re.IGNORECASE,
)


def _parse_duration(text: str) -> dict[str, float]:
    value = text.strip()
    m = _DURATION.match(value)
    if not m or value.upper().rstrip("T") in ("P", "+P", "-P") or value.upper().endswith("T"):
        raise ToolError(f"duration {text!r} is not ISO 8601 (e.g. P1Y2M10DT2H30M, PT90M, -P1W)")
    sign = -1.0 if m.group("sign") == "-" else 1.0
    out = {}
    for key in ("years", "months", "weeks", "days", "hours", "minutes", "seconds"):
        raw = m.group(key)
        out[key] = sign * float(raw.replace(",", ".")) if raw else 0.0
    for key in ("years", "months"):
        if not out[key].is_integer():
            raise ToolError("years and months in a duration must be whole numbers")
    return out


def _add_months(dt: datetime, months: int) -> datetime:
    total = dt.year * 12 + (dt.month - 1) + months
    year, month = divmod(total, 12)
    if not 1 <= year <= 9999:
        raise ToolError("the result is outside years 1-9999")
    day = min(dt.day, calendar.monthrange(year, month + 1)[1])
    return dt.replace(year=year, month=month + 1, day=day)


def _resolve_wall(naive: datetime, zone: tzinfo) -> tuple[datetime, bool]:
    """Attach ``zone`` to a wall time; a time in a DST gap moves forward by the gap (like RFC 5545)."""
    dt = naive.replace(tzinfo=zone)
    back = dt.astimezone(UTC).astimezone(zone)
    if back.replace(tzinfo=None) == naive:
        return dt, False
    # In a gap: interpret with the offset before the transition, which lands after the gap.
    before = naive.replace(tzinfo=zone, fold=0).utcoffset()
    shifted = (naive - before).replace(tzinfo=UTC).astimezone(zone)  # type: ignore[operator]
    return shifted, True


class AddResult(msgspec.Struct):
    start: ZonedTime
    result: ZonedTime
    elapsed_seconds: float
    shifted_out_of_dst_gap: bool


@tool(annotations={"title": "Add or subtract a duration", **READ_ONLY})
@_guard
def add(
    datetime: str,
    zone: str = "UTC",
    duration: str | None = None,
    years: Annotated[
        int,
        msgspec.Meta(ge=-10000, le=10000, description="Years to add (negative subtracts)."),
    ] = 0,
    months: Annotated[
        int,
        msgspec.Meta(ge=-120000, le=120000, description="Months to add (negative subtracts)."),
    ] = 0,
    weeks: Annotated[
        float,
        msgspec.Meta(ge=-1_000_000, le=1_000_000, description="Weeks to add, as wall-clock days."),
    ] = 0,
    days: Annotated[
        float,
        msgspec.Meta(
            ge=-1_000_000,
            le=1_000_000,
            description="Days to add, as wall-clock days (fractions are added as elapsed time).",
        ),
    ] = 0,
    hours: Annotated[
        float,
        msgspec.Meta(ge=-1_000_000, le=1_000_000, description="Hours of elapsed time to add."),
    ] = 0,
    minutes: Annotated[
        float,
        msgspec.Meta(ge=-1_000_000, le=1_000_000, description="Minutes of elapsed time to add."),
    ] = 0,
    seconds: Annotated[
        float,
        msgspec.Meta(ge=-1_000_000, le=1_000_000, description="Seconds of elapsed time to add."),
    ] = 0,
) -> AddResult:
    """Add (or, with negative amounts, subtract) a duration to a date-time in a time zone, respecting DST.

    Calendar units (years, months, weeks, days) move the wall clock: 2024-03-09T12:00 + 1 day in
    America/New_York is 2024-03-10T12:00 although that day has 23 hours. Clock units (hours,
    minutes, seconds) are elapsed time: + 24 hours gives 13:00 across that change. Months keep the
    day of month, clamped to the month's end (Jan 31 + 1 month = Feb 29 in a leap year). A wall time
    that falls in a DST gap moves forward by the gap. Give `duration` (ISO 8601) or the separate
    amounts, or both (they add up).

    Args:
        datetime: ISO 8601 date-time, "now", or Unix seconds (@1700000000); one without an offset is in `zone`.
        zone: The time zone the arithmetic happens in (IANA name, UTC or +hh:mm); the result is expressed in it.
        duration: An ISO 8601 duration such as P1Y2M3DT4H5M6S, PT90M or -P2W (a leading - subtracts).
    """
    tz = _zone(zone)
    start = _parse(datetime, tz).astimezone(tz)
    parts = {
        "years": float(years),
        "months": float(months),
        "weeks": weeks,
        "days": days,
        "hours": hours,
        "minutes": minutes,
        "seconds": seconds,
    }
    if duration:
        for key, value in _parse_duration(duration).items():
            parts[key] += value
    if not all(math.isfinite(v) for v in parts.values()):
        raise ToolError("amounts must be finite numbers")
    total_days = parts["weeks"] * 7 + parts["days"]
    whole_days = math.trunc(total_days)
    extra_seconds = (total_days - whole_days) * 86400 + parts["hours"] * 3600 + parts["minutes"] * 60 + parts["seconds"]
    wall = start.replace(tzinfo=None)
    wall = _add_months(wall, int(parts["years"]) * 12 + int(parts["months"]))
    wall = wall + timedelta(days=whole_days)
    moved, shifted = _resolve_wall(wall, tz)
    if wall != start.replace(tzinfo=None):
        # Keep the original fold preference for an ambiguous result.
        moved = moved.replace(fold=start.fold) if not shifted else moved
    result = (moved.astimezone(UTC) + timedelta(seconds=extra_seconds)).astimezone(tz)
    elapsed = (result.astimezone(UTC) - start.astimezone(UTC)).total_seconds()
    return AddResult(_describe(start), _describe(result), elapsed, shifted)


class Difference(msgspec.Struct):
    start: str
    end: str
    total_seconds: float
    total_minutes: float
    total_hours: float
    total_days: float
    iso_duration: str
    calendar: str
    years: int
    months: int
    days: int
    hours: int
    minutes: int
    seconds: float
    negative: bool


def _calendar_diff(a: datetime, b: datetime) -> tuple[int, int, int, int, int, float]:
    """Whole years, months and days on the wall clock, then elapsed h/m/s, from a to b (a <= b)."""
    tz = a.tzinfo
    aw, bw = a.replace(tzinfo=None), b.replace(tzinfo=None)
    b_utc = b.astimezone(UTC)

    def at(months: int, days: int) -> datetime:
        wall = _add_months(aw, months) + timedelta(days=days)
        return _resolve_wall(wall, tz)[0].astimezone(UTC)  # type: ignore[arg-type]

    months = max((bw.year - aw.year) * 12 + (bw.month - aw.month), 0)
    while months > 0 and at(months, 0) > b_utc:
        months -= 1
    days = max((bw - _add_months(aw, months)).days, 0)
    while days > 0 and at(months, days) > b_utc:
        days -= 1
    rest = max((b_utc - at(months, days)).total_seconds(), 0.0)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    years, months = divmod(months, 12)
    return years, months, days, int(hours), int(minutes), round(seconds, 6)


def _iso_duration(y: int, mo: int, d: int, h: int, mi: int, s: float, negative: bool) -> str:
    date_part = "".join(f"{v}{u}" for v, u in ((y, "Y"), (mo, "M"), (d, "D")) if v)
    sec = (str(int(s)) if float(s).is_integer() else f"{s:.6f}".rstrip("0")) if s else ""
    time_part = "".join(f"{v}{u}" for v, u in ((h, "H"), (mi, "M")) if v) + (f"{sec}S" if sec else "")
    text = "P" + date_part + ("T" + time_part if time_part else "")
    if text == "P":
        text = "PT0S"
    return ("-" if negative else "") + text


def _plural(n: float, unit: str) -> str:
    shown = int(n) if float(n).is_integer() else n
    return f"{shown} {unit}" + ("" if n == 1 else "s")


@tool(annotations={"title": "Difference between two date-times", **READ_ONLY})
@_guard
def difference(start: str, end: str, zone: str = "UTC") -> Difference:
    """The time between two date-times: exact elapsed totals (seconds, minutes, hours, days) and a calendar breakdown in years, months, days, hours, minutes and seconds.

    The calendar breakdown counts months and days on the wall clock of `zone` (so a DST change does
    not turn a day into 23 hours); totals are exact elapsed time. If end is before start, the values
    are negative / marked negative.

    Args:
        start: ISO 8601 date-time, "now", or Unix seconds (@1700000000).
        end: ISO 8601 date-time, "now", or Unix seconds (@1700000000).
        zone: The zone for date-times without an offset and for the calendar breakdown (default UTC).
    """
    tz = _zone(zone)
    a = _parse(start, tz, "start").astimezone(tz)
    b = _parse(end, tz, "end").astimezone(tz)
    total = (b.astimezone(UTC) - a.astimezone(UTC)).total_seconds()
    negative = total < 0
    lo, hi = (b, a) if negative else (a, b)
    y, mo, d, h, mi, s = _calendar_diff(lo, hi)
    parts = [
        _plural(v, u)
        for v, u in ((y, "year"), (mo, "month"), (d, "day"), (h, "hour"), (mi, "minute"), (s, "second"))
        if v
    ]
    human = ", ".join(parts) if parts else "0 seconds"
    return Difference(
        start=_iso(a),
        end=_iso(b),
        total_seconds=total,
        total_minutes=total / 60,
        total_hours=total / 3600,
        total_days=total / 86400,
        iso_duration=_iso_duration(y, mo, d, h, mi, s, negative),
        calendar=("minus " if negative else "") + human,
        years=y,
        months=mo,
        days=d,
        hours=h,
        minutes=mi,
        seconds=s,
        negative=negative,
    )


class ZoneList(msgspec.Struct):
    total: int
    truncated: bool
    zones: list[str]


@tool(annotations={"title": "List time zones", **READ_ONLY})
def list_zones(
    query: str = "",
    limit: Annotated[
        int,
        msgspec.Meta(ge=1, le=1000, description="Return at most this many names (1-1000); `total` counts all matches."),
    ] = 100,
) -> ZoneList:
    """List IANA time zone names that contain a substring (case-insensitive; spaces match underscores), sorted alphabetically.

    Args:
        query: Text to look for, e.g. "york", "europe/", "kolkata"; empty lists every zone.
    """
    zones = _available_zones()
    if not zones:
        raise _no_database()
    needle = query.strip().lower().replace(" ", "_")
    if len(needle) > 100:
        raise ToolError("query is too long")
    found = sorted(z for z in zones if needle in z.lower())
    return ZoneList(total=len(found), truncated=len(found) > limit, zones=found[:limit])


class Parsed(msgspec.Struct):
    time: ZonedTime
    date: str
    clock: str
    year: int
    month: int
    day: int
    iso_week: str
    day_of_year: int
    is_leap_year: bool
    days_in_month: int


@tool(annotations={"title": "Parse a date-time", **READ_ONLY})
@_guard
def parse(text: str, zone: str = "UTC", format: str | None = None) -> Parsed:
    """Parse a date-time (ISO 8601, "now", Unix seconds, or a custom strptime format) and describe it: UTC form, Unix time, offset, DST, weekday, ISO week, day of year.

    Args:
        text: The date-time text, e.g. "2024-02-29T13:45:00+01:00", "2024-02-29", "now" or "@1709210700".
        zone: The zone for input without an offset (default UTC); the description is given in this zone when the input has none.
        format: A strptime format such as "%d/%m/%Y %H:%M" for non-ISO input; %z in it reads an offset.
    """
    tz = _zone(zone)
    if format is None:
        dt = _parse(text, tz, "text")
    else:
        if len(format) > MAX_FORMAT_CHARS or len(text) > MAX_INPUT_CHARS:
            raise ToolError("text or format is too long")
        try:
            dt = datetime.strptime(text.strip(), format)
        except ValueError as exc:
            raise ToolError(f"text does not match the format: {exc}") from None
        if dt.tzinfo is None:
            dt = _localize(dt, tz)
    iso_year, iso_week, _ = dt.isocalendar()
    return Parsed(
        time=_describe(dt),
        date=dt.date().isoformat(),
        clock=dt.timetz().replace(tzinfo=None).isoformat(),
        year=dt.year,
        month=dt.month,
        day=dt.day,
        iso_week=f"{iso_year}-W{iso_week:02d}",
        day_of_year=dt.timetuple().tm_yday,
        is_leap_year=calendar.isleap(dt.year),
        days_in_month=calendar.monthrange(dt.year, dt.month)[1],
    )


@tool(name="format", annotations={"title": "Format a date-time", **READ_ONLY})
@_guard
def format_datetime(datetime: str, format: str, zone: str = "UTC", input_zone: str | None = None) -> str:
    """Format a date-time with a strftime pattern, after converting it to a time zone.

    Common directives: %Y year, %m month, %d day, %H/%I hour (24/12), %M minute, %S second,
    %p AM/PM, %A/%a weekday name, %B/%b month name, %j day of year, %V ISO week, %Z zone
    abbreviation, %z offset, %% a literal %. Names are English (C locale).

    Args:
        datetime: ISO 8601 date-time, "now", or Unix seconds (@1700000000).
        format: The strftime pattern, e.g. "%A %d %B %Y, %H:%M %Z" (at most 500 characters).
        zone: The time zone to show the time in (IANA name, UTC or +hh:mm).
        input_zone: The zone of a date-time without offset; defaults to `zone`.
    """
    if len(format) > MAX_FORMAT_CHARS:
        raise ToolError(f"format is too long; the limit is {MAX_FORMAT_CHARS} characters")
    tz = _zone(zone)
    src = _zone(input_zone) if input_zone else tz
    dt = _parse(datetime, src).astimezone(tz)
    return dt.strftime(format)


@tool(annotations={"title": "Current time", "readOnlyHint": True, "openWorldHint": False})
def now(zone: str = "UTC") -> ZonedTime:
    """The current date and time in a time zone, with its UTC offset, abbreviation and DST flag.

    Args:
        zone: The time zone (IANA name such as Asia/Tokyo, UTC, or a fixed offset like -03:00).
    """
    return _describe(datetime.now(UTC).astimezone(_zone(zone)))
