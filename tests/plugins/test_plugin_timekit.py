from __future__ import annotations

import zoneinfo
from datetime import UTC, datetime

import pytest

from sandbox import ToolError

NY = "America/New_York"


@pytest.fixture(scope="module")
def tm(load_plugin):
    plugin = load_plugin("timekit")
    if not plugin.module._available_zones():
        pytest.skip("no IANA time zone database on this machine")
    return plugin


def test_convert_between_zones(tm):
    r = tm.module.convert("2024-07-01T09:00", "Asia/Kolkata", "Europe/Paris")
    assert r.source.iso == "2024-07-01T09:00:00+02:00" and r.source.abbreviation == "CEST" and r.source.is_dst
    assert r.target.iso == "2024-07-01T12:30:00+05:30" and r.target.utc_offset == "+05:30"
    assert r.source.utc == r.target.utc == "2024-07-01T07:00:00Z"


def test_convert_explicit_offset_wins_and_fixed_offsets(tm):
    r = tm.module.convert("2024-01-15T12:00:00Z", "-03:30", from_zone="Asia/Tokyo")
    assert r.source.zone == "UTC"
    assert r.target.iso == "2024-01-15T08:30:00-03:30" and r.target.is_dst is False


def test_convert_dst_gap_and_ambiguous_fold(tm):
    with pytest.raises(ToolError, match="does not exist"):
        tm.module.convert("2024-03-10T02:30", "UTC", NY)
    first = tm.module.convert("2024-11-03T01:30", "UTC", NY)
    second = tm.module.convert("2024-11-03T01:30", "UTC", NY, fold=1)
    assert first.source.ambiguous and second.source.ambiguous
    assert first.target.utc == "2024-11-03T05:30:00Z"
    assert second.target.utc == "2024-11-03T06:30:00Z"


def test_zone_names_forgiving_and_suggestions(tm):
    assert tm.module.convert("2024-01-01T00:00Z", "america/new york").target.zone == NY
    with pytest.raises(ToolError, match="did you mean Europe/Paris"):
        tm.module.convert("2024-01-01T00:00Z", "Europe/Pariss")
    with pytest.raises(ToolError, match="unknown time zone"):
        tm.module.convert("2024-01-01T00:00Z", "../../etc/passwd")


def test_add_respects_dst(tm):
    by_day = tm.module.add("2024-03-09T12:00", NY, days=1)
    assert by_day.result.iso == "2024-03-10T12:00:00-04:00"
    assert by_day.elapsed_seconds == 23 * 3600
    by_hours = tm.module.add("2024-03-09T12:00", NY, hours=24)
    assert by_hours.result.iso == "2024-03-10T13:00:00-04:00"
    gap = tm.module.add("2024-03-09T02:30", NY, days=1)
    assert gap.result.iso == "2024-03-10T03:30:00-04:00" and gap.shifted_out_of_dst_gap


def test_add_months_clamp_duration_and_subtract(tm):
    assert tm.module.add("2024-01-31", months=1).result.iso == "2024-02-29T00:00:00+00:00"
    assert tm.module.add("2023-01-31", months=1).result.iso == "2023-02-28T00:00:00+00:00"
    r = tm.module.add("2024-03-09T12:00", NY, duration="-P1M2DT3H")
    assert r.result.iso == "2024-02-07T09:00:00-05:00"
    r = tm.module.add("2024-01-01T00:00Z", duration="P1Y2M3DT4H5M6S", days=1)
    assert r.result.iso == "2025-03-05T04:05:06+00:00"
    assert tm.module.add("2024-01-01T00:00Z", duration="PT1.5H").result.iso == "2024-01-01T01:30:00+00:00"


def test_add_errors(tm):
    with pytest.raises(ToolError, match="not ISO 8601"):
        tm.module.add("2024-01-01", duration="P")
    with pytest.raises(ToolError, match="out of range|outside"):
        tm.module.add("9999-12-31", days=2)
    assert "Invalid arguments" in tm.error("add", datetime="2024-01-01", days=10**9)


def test_difference_calendar_and_totals(tm):
    d = tm.module.difference("2024-03-09T12:00", "2024-03-10T12:00", NY)
    assert d.total_hours == 23 and (d.days, d.hours) == (1, 0) and d.iso_duration == "P1D"
    d = tm.module.difference("2024-01-31", "2024-03-01T05:06:07.5")
    assert (d.years, d.months, d.days, d.hours, d.minutes, d.seconds) == (0, 1, 1, 5, 6, 7.5)
    assert d.iso_duration == "P1M1DT5H6M7.5S"
    assert d.calendar == "1 month, 1 day, 5 hours, 6 minutes, 7.5 seconds"
    back = tm.module.difference("2025-01-01", "2024-01-01")
    assert back.negative and back.total_days == -366 and back.iso_duration == "-P1Y"
    zero = tm.module.difference("2024-01-01", "2024-01-01T00:00:00Z")
    assert zero.iso_duration == "PT0S" and zero.calendar == "0 seconds"


def test_list_zones(tm):
    r = tm.module.list_zones("york")
    assert "America/New_York" in r.zones and r.total == len(r.zones)
    some = tm.module.list_zones("", limit=3)
    assert some.truncated and len(some.zones) == 3 and some.zones == sorted(some.zones)
    assert tm.module.list_zones("new york").zones == ["America/New_York"]
    assert tm.module.list_zones("no-such-zone-anywhere").total == 0


def test_parse_iso_format_and_unix(tm):
    p = tm.module.parse("2024-02-29T13:45:00+01:00")
    assert p.time.utc == "2024-02-29T12:45:00Z" and p.time.unix == 1709210700
    assert (p.iso_week, p.day_of_year, p.is_leap_year, p.days_in_month) == ("2024-W09", 60, True, 29)
    assert p.time.weekday == "Thursday"
    custom = tm.module.parse("29/02/2024 13:45", "Europe/Berlin", "%d/%m/%Y %H:%M")
    assert custom.time.iso == "2024-02-29T13:45:00+01:00" and custom.time.abbreviation == "CET"
    assert tm.module.parse("@0").time.utc == "1970-01-01T00:00:00Z"
    assert tm.module.parse("1709210700").time.utc == "2024-02-29T12:45:00Z"
    with pytest.raises(ToolError, match="not ISO 8601"):
        tm.module.parse("garbage")
    with pytest.raises(ToolError, match="does not match"):
        tm.module.parse("2024-01-01", format="%d/%m/%Y")


def test_format(tm):
    out = tm.call("format", datetime="2024-07-04T12:00Z", format="%A %d %B %Y, %H:%M %Z", zone="America/Los_Angeles")
    assert out.text == "Thursday 04 July 2024, 05:00 PDT"
    assert tm.module.format_datetime("2024-07-04T12:00", "%H:%M", zone="UTC", input_zone="+02:00") == "10:00"
    with pytest.raises(ToolError, match="too long"):
        tm.module.format_datetime("now", "%Y" * 300)


def test_now_is_current(tm):
    before = datetime.now(UTC).timestamp()
    r = tm.call("now", zone="Asia/Tokyo").structured
    assert r["zone"] == "Asia/Tokyo" and r["utc_offset"] == "+09:00"
    assert abs(r["unix"] - before) < 5


def test_missing_database_falls_back_with_clear_error(tm, monkeypatch):
    mod = tm.module
    monkeypatch.setattr(mod, "_available_zones", lambda: frozenset())
    real = zoneinfo.ZoneInfo

    def no_tzdata(key):
        raise zoneinfo.ZoneInfoNotFoundError(key)

    monkeypatch.setattr(mod.zoneinfo, "ZoneInfo", no_tzdata)
    try:
        with pytest.raises(ToolError, match="time zone database is not available"):
            mod.convert("2024-01-01T00:00Z", "Europe/Paris")
        with pytest.raises(ToolError, match="time zone database is not available"):
            mod.list_zones("paris")
        # UTC and fixed offsets keep working.
        assert mod.convert("2024-01-01T00:00Z", "+01:00").target.iso == "2024-01-01T01:00:00+01:00"
    finally:
        monkeypatch.setattr(mod.zoneinfo, "ZoneInfo", real)
