from __future__ import annotations

import math

import pytest

from sandbox import ToolError


@pytest.fixture(scope="module")
def mk(load_plugin):
    return load_plugin("mathkit")


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 * (3 + 4) ** 2 / sqrt(16)", 24.5),
        ("7 // 2 + 7 % 3", 4),
        ("-2 ** 2", -4),
        ("10 / 2", 5),
        ("1 / 4", 0.25),
        ("sin(pi / 2) + cos(0)", 2.0),
        ("log(8, 2)", 3.0),
        ("ln(e)", 1.0),
        ("max(1, 5, 3) - min(4, 2)", 3),
        ("round(2.675, 2)", 2.67),
        ("abs(-3) + floor(2.7) + ceil(2.1)", 8),
        ("factorial(5) + gcd(12, 18) + lcm(4, 6)", 138),
        ("0x1f + 1_000 + 1e3", 2031.0),
        ("hypot(3, 4)", 5.0),
        ("(-1) ** -3", -1),
        ("2 ** -2", 0.25),
    ],
)
def test_evaluate_values(mk, expression, value):
    r = mk.module.evaluate(expression)
    assert r.result == pytest.approx(value)
    assert type(r.result) is type(value) or isinstance(value, float)


def test_evaluate_exact_big_integers(mk):
    r = mk.module.evaluate("2 ** 100")
    assert r.text == str(2**100) and r.is_integer
    assert r.result == float(2**100)  # JSON number approximation beyond 2**53
    huge = mk.call("evaluate", expression="2 ** 9999")  # > float range: result null, text exact
    assert huge.structured["result"] is None
    assert huge.structured["text"] == str(2**9999)


def test_evaluate_precision(mk):
    assert mk.module.evaluate("1/3", precision=3).result == 0.333
    assert mk.module.evaluate("0.1 + 0.2").text == "0.30000000000000004"


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('true')", "unknown function"),
        ("(1).__class__", "attribute access"),
        ("x + 1", "unknown name"),
        ("[1, 2][0]", "not allowed"),
        ("2 ^ 3", "use \\*\\* for powers"),
        ("1 < 2", "comparisons"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("lambda: 1", "lambdas"),
        ("sqrt", "is a function"),
        ("sqrt(1, 2)", "takes 1 argument"),
        ("round(x=1)", "positional"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "modulo by zero"),
        ("sqrt(-1)", "not defined"),
        ("(-8) ** (1/3)", "fractional power"),
        ("1e308 * 10", "finite"),
        ("", "empty"),
        ("1 +", "syntax error"),
    ],
)
def test_evaluate_refuses(mk, expression, message):
    with pytest.raises(ToolError, match=message):
        mk.module.evaluate(expression)


@pytest.mark.parametrize(
    "expression",
    [
        "2 ** 10001",
        "10 ** 10 ** 10",
        "9 ** 9 ** 9",
        "2 ** 2 ** 2 ** 2 ** 2",
        "factorial(1001)",
        "(2 ** 5000) * (2 ** 5001)",
        "2.0 ** 100000",
    ],
)
def test_evaluate_bounds_huge_work(mk, expression):
    with pytest.raises(ToolError, match="too large|limited|finite"):
        mk.module.evaluate(expression)


def test_evaluate_bounds_size_and_depth(mk):
    with pytest.raises(ToolError, match="too long"):
        mk.module.evaluate("1+" * 600 + "1")
    with pytest.raises(ToolError, match="nested too deeply|too complex"):
        mk.module.evaluate("-" * 990 + "1")
    with pytest.raises(ToolError, match="syntax error|too complex"):
        mk.module.evaluate("(" * 300 + "1" + ")" * 300)


def test_evaluate_through_worker(mk):
    out = mk.call("evaluate", expression="6 * 7")
    assert out.structured == {"expression": "6 * 7", "result": 42, "text": "42", "is_integer": True}
    assert "division by zero" in mk.error("evaluate", expression="1/0")


# -- statistics ----------------------------------------------------------------------------------


def test_statistics_values(mk):
    s = mk.module.statistics([1, 2, 2, 3, 4, 10])
    assert s.count == 6 and s.sum == 22
    assert s.mean == pytest.approx(22 / 6)
    assert s.median == 2.5
    assert (s.min, s.max, s.range) == (1, 10, 9)
    assert s.mode == [2.0]
    assert s.variance == pytest.approx(10.6666667)
    assert s.stdev == pytest.approx(math.sqrt(10.6666667))
    assert s.population_stdev == pytest.approx(2.98142397)
    pct = {p.percentile: p.value for p in s.percentiles}
    assert pct[25] == 2.0 and pct[50] == 2.5 and pct[75] == 3.75 and pct[90] == 7.0


def test_statistics_custom_percentiles_single_value_and_no_mode(mk):
    s = mk.module.statistics([5], percentiles=[0, 100])
    assert s.variance is None and s.stdev is None and s.population_variance == 0
    assert [p.value for p in s.percentiles] == [5, 5]
    assert mk.module.statistics([1, 2, 3]).mode == []
    s = mk.module.statistics([10, 20, 30, 40], percentiles=[0, 100, 50])
    assert [p.value for p in s.percentiles] == [10, 40, 25]


def test_statistics_refuses(mk):
    with pytest.raises(ToolError, match="empty"):
        mk.module.statistics([])
    with pytest.raises(ToolError, match="too many"):
        mk.module.statistics([1.0] * 100_001)
    with pytest.raises(ToolError, match="finite"):
        mk.module.statistics([1.0, math.inf])
    assert "Invalid arguments" in mk.error("statistics", numbers=[1, 2], percentiles=[101])


# -- unit conversion -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "src", "dst", "expected"),
    [
        (1, "km", "mi", 0.621371192237334),
        (3, "feet", "meters", 0.9144),
        (12, "in", "cm", 30.48),
        (100, "C", "F", 212),
        (-40, "celsius", "fahrenheit", -40),
        (0, "K", "C", -273.15),
        (491.67, "R", "F", 32),
        (1, "lb", "g", 453.59237),
        (1, "GiB", "MB", 1073.741824),
        (1, "Mb", "MB", 0.125),
        (1, "MB", "Mbit", 8),
        (1024, "KiB", "MiB", 1),
        (90, "min", "h", 1.5),
        (1, "wk", "d", 7),
    ],
)
def test_convert_units(mk, value, src, dst, expected):
    assert mk.module.convert_units(value, src, dst).result == pytest.approx(expected)


def test_convert_units_errors(mk):
    with pytest.raises(ToolError, match="cannot convert mass"):
        mk.module.convert_units(1, "kg", "km")
    with pytest.raises(ToolError, match="unknown unit 'furlong'"):
        mk.module.convert_units(1, "furlong", "m")
    with pytest.raises(ToolError, match="case-sensitive"):
        mk.module.convert_units(1, "mb", "kB")
    with pytest.raises(ToolError, match="absolute zero"):
        mk.module.convert_units(-500, "C", "K")


def test_convert_units_through_worker(mk):
    out = mk.call("convert_units", value=72, from_unit="F", to_unit="C")
    assert out.structured["category"] == "temperature"
    assert out.structured["result"] == pytest.approx(22.2222222)
