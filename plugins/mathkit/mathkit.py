"""mathkit: a safe arithmetic evaluator, descriptive statistics and unit conversion.

The evaluator parses with ``ast`` and walks a whitelist of nodes itself (never ``eval``): numbers,
``+ - * / // % **``, unary signs, parentheses, a fixed set of functions and the constants pi, e,
tau. Expression length, node count, nesting depth, integer size and exponents are all bounded.
"""

from __future__ import annotations

import ast
import math
import statistics as pystats
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from sandbox import ToolError, tool

READ_ONLY = {"readOnlyHint": True, "idempotentHint": True, "openWorldHint": False}

MAX_EXPRESSION_CHARS = 1000
MAX_NODES = 3000
MAX_DEPTH = 500
#: Largest integer (in bits) any intermediate result may have (~3000 decimal digits).
MAX_INT_BITS = 10_000
MAX_FACTORIAL = 1000
MAX_NUMBERS = 100_000


class _EvalError(Exception):
    pass


def _check_int(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _EvalError(f"integer result too large (more than {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise _EvalError("result is not a finite number")
    return value


def _num(value: Any, fname: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _EvalError(f"{fname}() needs numbers")
    return value


def _int_arg(value: Any, fname: str) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise _EvalError(f"{fname}() needs whole numbers")
    return value


def _factorial(n: Any) -> int:
    n = _int_arg(n, "factorial")
    if n < 0:
        raise _EvalError("factorial() is not defined for negative numbers")
    if n > MAX_FACTORIAL:
        raise _EvalError(f"factorial() is limited to n <= {MAX_FACTORIAL}")
    return math.factorial(n)


def _round(x: Any, ndigits: Any = None) -> int | float:
    x = _num(x, "round")
    if ndigits is None:
        return round(x)
    nd = _int_arg(ndigits, "round")
    if not -400 <= nd <= 400:
        raise _EvalError("round() ndigits must be between -400 and 400")
    return round(x, nd)


def _log(x: Any, base: Any = None) -> float:
    x = _num(x, "log")
    if base is None:
        return math.log(x)
    return math.log(x, _num(base, "log"))


def _minmax(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    def wrapped(*args: Any) -> Any:
        if not args:
            raise _EvalError(f"{name}() needs at least one argument")
        return fn(_num(a, name) for a in args)

    return wrapped


def _unary(fn: Callable[[float], Any], name: str) -> Callable[[Any], Any]:
    def wrapped(x: Any) -> Any:
        return fn(_num(x, name))

    return wrapped


#: name -> (function, min args, max args or None for variadic)
FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int | None]] = {
    "sqrt": (_unary(math.sqrt, "sqrt"), 1, 1),
    "cbrt": (_unary(math.cbrt, "cbrt"), 1, 1),
    "exp": (_unary(math.exp, "exp"), 1, 1),
    "log": (_log, 1, 2),
    "ln": (_unary(math.log, "ln"), 1, 1),
    "log10": (_unary(math.log10, "log10"), 1, 1),
    "log2": (_unary(math.log2, "log2"), 1, 1),
    "sin": (_unary(math.sin, "sin"), 1, 1),
    "cos": (_unary(math.cos, "cos"), 1, 1),
    "tan": (_unary(math.tan, "tan"), 1, 1),
    "asin": (_unary(math.asin, "asin"), 1, 1),
    "acos": (_unary(math.acos, "acos"), 1, 1),
    "atan": (_unary(math.atan, "atan"), 1, 1),
    "atan2": (lambda y, x: math.atan2(_num(y, "atan2"), _num(x, "atan2")), 2, 2),
    "sinh": (_unary(math.sinh, "sinh"), 1, 1),
    "cosh": (_unary(math.cosh, "cosh"), 1, 1),
    "tanh": (_unary(math.tanh, "tanh"), 1, 1),
    "degrees": (_unary(math.degrees, "degrees"), 1, 1),
    "radians": (_unary(math.radians, "radians"), 1, 1),
    "abs": (_unary(abs, "abs"), 1, 1),
    "round": (_round, 1, 2),
    "floor": (_unary(math.floor, "floor"), 1, 1),
    "ceil": (_unary(math.ceil, "ceil"), 1, 1),
    "trunc": (_unary(math.trunc, "trunc"), 1, 1),
    "min": (_minmax(min, "min"), 1, None),
    "max": (_minmax(max, "max"), 1, None),
    "hypot": (lambda *a: math.hypot(*(_num(x, "hypot") for x in a)), 1, None),
    "factorial": (_factorial, 1, 1),
    "gcd": (lambda *a: math.gcd(*(_int_arg(x, "gcd") for x in a)), 1, None),
    "lcm": (lambda *a: math.lcm(*(_int_arg(x, "lcm") for x in a)), 1, None),
}

CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}


def _power(base: Any, exp: Any) -> Any:
    if isinstance(base, int) and isinstance(exp, int):
        if exp < 0:
            if base == 0:
                raise _EvalError("0 cannot be raised to a negative power")
            if abs(base) == 1:
                return 1 if base == 1 or exp % 2 == 0 else -1
            return float(base) ** max(exp, -100_000)  # anything below underflows to 0.0 anyway
        # |base| >= 2 has at least (bits - 1) * exp bits: refuse before computing anything huge.
        if abs(base) > 1 and (base.bit_length() - 1) * exp > MAX_INT_BITS:
            raise _EvalError(f"integer power too large (result would exceed {MAX_INT_BITS} bits)")
        if abs(base) > 1 and exp > MAX_INT_BITS:
            raise _EvalError(f"integer power too large (result would exceed {MAX_INT_BITS} bits)")
        return base**exp
    b, x = float(base), float(exp)
    if b == 0 and x < 0:
        raise _EvalError("0 cannot be raised to a negative power")
    if b < 0 and not x.is_integer():
        raise _EvalError("a negative number cannot be raised to a fractional power")
    try:
        return b**x
    except OverflowError:
        raise _EvalError("result too large") from None


def _multiply(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS + 1:
        raise _EvalError(f"integer result too large (more than {MAX_INT_BITS} bits)")
    return a * b


def _divide(a: Any, b: Any) -> Any:
    if b == 0:
        raise _EvalError("division by zero")
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b  # exact integer division stays an integer (no float rounding for big ints)
    return a / b


def _floordiv(a: Any, b: Any) -> Any:
    if b == 0:
        raise _EvalError("division by zero")
    return a // b


def _mod(a: Any, b: Any) -> Any:
    if b == 0:
        raise _EvalError("modulo by zero")
    return a % b


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: _multiply,
    ast.Div: _divide,
    ast.FloorDiv: _floordiv,
    ast.Mod: _mod,
    ast.Pow: _power,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: lambda a: +a, ast.USub: lambda a: -a}
_OP_SYMBOLS = {
    ast.BitXor: "^ (use ** for powers)",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.MatMult: "@",
    ast.Invert: "~",
    ast.Not: "not",
}


def _evaluate(node: ast.AST, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise _EvalError("expression is nested too deeply")
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, depth + 1)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise _EvalError(f"only numbers are allowed, not {node.value!r}")
        return _check_int(node.value)
    if isinstance(node, ast.BinOp):
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise _EvalError(f"operator {_OP_SYMBOLS.get(type(node.op), type(node.op).__name__)} is not allowed")
        left = _evaluate(node.left, depth + 1)
        right = _evaluate(node.right, depth + 1)
        return _check_int(op(left, right))
    if isinstance(node, ast.UnaryOp):
        uop = _UNARY.get(type(node.op))
        if uop is None:
            raise _EvalError(f"operator {_OP_SYMBOLS.get(type(node.op), type(node.op).__name__)} is not allowed")
        return _check_int(uop(_evaluate(node.operand, depth + 1)))
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        if node.id in FUNCTIONS:
            raise _EvalError(f"{node.id} is a function; call it like {node.id}(x)")
        raise _EvalError(f"unknown name {node.id!r}; constants are: {', '.join(CONSTANTS)}")
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            shown = node.func.id if isinstance(node.func, ast.Name) else "this"
            raise _EvalError(f"unknown function {shown!r}; available: {', '.join(sorted(FUNCTIONS))}")
        if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
            raise _EvalError("functions take plain positional arguments only")
        fn, lo, hi = FUNCTIONS[node.func.id]
        if len(node.args) < lo or (hi is not None and len(node.args) > hi):
            want = str(lo) if hi == lo else f"{lo} to {hi}" if hi is not None else f"at least {lo}"
            raise _EvalError(f"{node.func.id}() takes {want} argument(s), got {len(node.args)}")
        args = [_evaluate(a, depth + 1) for a in node.args]
        try:
            return _check_int(fn(*args))
        except ValueError:
            raise _EvalError(f"{node.func.id}() is not defined for {', '.join(map(_fmt, args))}") from None
        except OverflowError:
            raise _EvalError(f"{node.func.id}() result too large") from None
    kind = type(node).__name__
    hints = {
        "Attribute": "attribute access",
        "Subscript": "indexing",
        "Compare": "comparisons",
        "BoolOp": "and/or",
        "Lambda": "lambdas",
        "IfExp": "conditional expressions",
    }
    raise _EvalError(f"{hints.get(kind, kind)} is not allowed in expressions")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


class EvalResult(msgspec.Struct):
    expression: str
    #: The value as a JSON number: exact for integers up to 2**53, a float approximation beyond,
    #: null when even a float cannot hold it. ``text`` is always exact.
    result: float | int | None
    text: str
    is_integer: bool


def _json_number(value: float) -> int | float | None:
    if isinstance(value, float) or abs(value) <= 2**53:
        return value
    try:
        return float(value)
    except OverflowError:
        return None


@tool(
    annotations={"title": "Evaluate arithmetic", "readOnlyHint": True, "idempotentHint": True, "openWorldHint": False}
)
def evaluate(expression: str, precision: Annotated[int, msgspec.Meta(ge=0, le=17)] | None = None) -> EvalResult:
    """Safely evaluate an arithmetic expression such as "2 * (3 + 4) ** 2 / sqrt(16)" and return the exact result.

    Allowed: numbers (1, 2.5, 1e-3, 0x1f, 1_000), + - * / // % ** (power), unary + and -,
    parentheses, the constants pi, e and tau, and the functions sqrt, cbrt, exp, log(x[, base]),
    ln, log10, log2, sin, cos, tan, asin, acos, atan, atan2(y, x), sinh, cosh, tanh, degrees,
    radians, abs, round(x[, ndigits]), floor, ceil, trunc, min, max, hypot, factorial, gcd, lcm.
    Trigonometry uses radians. Integers are exact up to about 3000 digits (`text` holds the exact
    value; `result` is a JSON number, approximate beyond 2**53); / between integers that divide
    evenly stays an integer. Nothing else (names, attributes, comparisons) is accepted.

    Args:
        expression: The expression to evaluate (at most 1000 characters).
        precision: Round a non-integer result to this many decimal places (0-17); omit to keep full precision.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression is too long; the limit is {MAX_EXPRESSION_CHARS} characters")
    if not expression.strip():
        raise ToolError("expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        where = f" at column {exc.offset}" if exc.offset else ""
        raise ToolError(f"syntax error{where}: {exc.msg}") from None
    except (RecursionError, MemoryError, ValueError):
        raise ToolError("expression is too complex") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ToolError(f"expression is too complex (more than {MAX_NODES} elements)")
    try:
        value = _evaluate(tree)
    except _EvalError as exc:
        raise ToolError(str(exc)) from None
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("result too large") from None
    except RecursionError:
        raise ToolError("expression is nested too deeply") from None
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("result is not a finite number")
        if precision is not None:
            value = round(value, precision)
        if value == 0:
            value = 0.0  # no "-0.0"
    return EvalResult(expression, _json_number(value), _fmt(value), isinstance(value, int))


# -- statistics ---------------------------------------------------------------------------------


class Percentile(msgspec.Struct):
    percentile: float
    value: float


class Statistics(msgspec.Struct):
    count: int
    sum: float
    mean: float
    median: float
    min: float
    max: float
    range: float
    mode: list[float]
    variance: float | None
    stdev: float | None
    population_variance: float
    population_stdev: float
    percentiles: list[Percentile]


def _percentile(ordered: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (NumPy's default, Excel's PERCENTILE.INC)."""
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    frac = pos - lo
    return ordered[lo] + (ordered[hi] - ordered[lo]) * frac


@tool(
    annotations={
        "title": "Descriptive statistics",
        "readOnlyHint": True,
        "idempotentHint": True,
        "openWorldHint": False,
    }
)
def statistics(
    numbers: list[float],
    percentiles: list[Annotated[float, msgspec.Meta(ge=0, le=100)]] | None = None,
) -> Statistics:
    """Descriptive statistics of a list of numbers: count, sum, mean, median, mode(s), min, max, range, sample and population variance and standard deviation, and percentiles.

    Sample variance/stdev (n-1) are null for fewer than two numbers. Percentiles use linear
    interpolation between closest ranks (as NumPy's default and Excel's PERCENTILE.INC).

    Args:
        numbers: The data (1 to 100000 finite numbers).
        percentiles: Percentiles to compute, each from 0 to 100 (default: 25, 50, 75, 90, 95, 99).
    """
    if not numbers:
        raise ToolError("numbers is empty; give at least one number")
    if len(numbers) > MAX_NUMBERS:
        raise ToolError(f"too many numbers; the limit is {MAX_NUMBERS:,}")
    data = [float(x) for x in numbers]
    if not all(math.isfinite(x) for x in data):
        raise ToolError("numbers must all be finite")
    wanted = [25.0, 50.0, 75.0, 90.0, 95.0, 99.0] if percentiles is None else [float(p) for p in percentiles]
    if len(wanted) > 100:
        raise ToolError("at most 100 percentiles can be asked for")
    for p in wanted:
        if not 0 <= p <= 100:
            raise ToolError(f"percentile {p} is outside 0-100")
    ordered = sorted(data)
    try:
        mean = pystats.fmean(data)
        pvariance = pystats.pvariance(data)
        variance = pystats.variance(data) if len(data) > 1 else None
    except OverflowError:
        raise ToolError("the numbers are too large to compute statistics on") from None
    modes = sorted(pystats.multimode(data))
    if len(modes) == len(set(data)) and len(data) > 1:
        modes = []  # every value occurs equally often: there is no mode
    return Statistics(
        count=len(data),
        sum=math.fsum(data),
        mean=mean,
        median=pystats.median(ordered),
        min=ordered[0],
        max=ordered[-1],
        range=ordered[-1] - ordered[0],
        mode=modes[:100],
        variance=variance,
        stdev=None if variance is None else math.sqrt(variance),
        population_variance=pvariance,
        population_stdev=math.sqrt(pvariance),
        percentiles=[Percentile(p, _percentile(ordered, p)) for p in wanted],
    )


# -- unit conversion ------------------------------------------------------------------------------

#: category -> {symbol: (factor to the base unit, aliases)}; temperature is handled separately.
_LINEAR: dict[str, dict[str, tuple[float, tuple[str, ...]]]] = {
    "length": {
        "m": (1.0, ("meter", "meters", "metre", "metres")),
        "km": (1000.0, ("kilometer", "kilometers", "kilometre", "kilometres")),
        "cm": (0.01, ("centimeter", "centimeters", "centimetre", "centimetres")),
        "mm": (0.001, ("millimeter", "millimeters", "millimetre", "millimetres")),
        "um": (1e-6, ("µm", "micrometer", "micrometers", "micron", "microns")),
        "nm": (1e-9, ("nanometer", "nanometers", "nanometre", "nanometres")),
        "in": (0.0254, ("inch", "inches", '"')),
        "ft": (0.3048, ("foot", "feet", "'")),
        "yd": (0.9144, ("yard", "yards")),
        "mi": (1609.344, ("mile", "miles")),
        "nmi": (1852.0, ("nautical mile", "nautical miles", "nautical_mile")),
        "au": (149_597_870_700.0, ("astronomical unit", "astronomical units")),
        "ly": (9_460_730_472_580_800.0, ("light year", "light years", "light-year", "light-years", "lightyear")),
    },
    "mass": {
        "kg": (1.0, ("kilogram", "kilograms", "kilo", "kilos")),
        "g": (0.001, ("gram", "grams")),
        "mg": (1e-6, ("milligram", "milligrams")),
        "ug": (1e-9, ("µg", "mcg", "microgram", "micrograms")),
        "t": (1000.0, ("tonne", "tonnes", "metric ton", "metric tons")),
        "lb": (0.45359237, ("lbs", "pound", "pounds")),
        "oz": (0.028349523125, ("ounce", "ounces")),
        "st": (6.35029318, ("stone", "stones")),
        "ton": (907.18474, ("short ton", "short tons", "us ton", "us tons")),
        "long_ton": (1016.0469088, ("long ton", "long tons", "imperial ton", "imperial tons")),
    },
    "time": {
        "s": (1.0, ("sec", "secs", "second", "seconds")),
        "ms": (1e-3, ("millisecond", "milliseconds")),
        "us": (1e-6, ("µs", "microsecond", "microseconds")),
        "ns": (1e-9, ("nanosecond", "nanoseconds")),
        "min": (60.0, ("mins", "minute", "minutes")),
        "h": (3600.0, ("hr", "hrs", "hour", "hours")),
        "d": (86400.0, ("day", "days")),
        "wk": (604800.0, ("week", "weeks")),
        "yr": (31_557_600.0, ("year", "years", "julian year")),
    },
    # Data sizes are case-sensitive: b = bit, B = byte; k/M/G = powers of 1000, Ki/Mi/Gi = of 1024.
    "data": {
        "bit": (1.0, ("bits", "b")),
        "B": (8.0, ("byte", "bytes", "octet", "octets")),
        "kbit": (1e3, ("kb", "kilobit", "kilobits", "Kbit")),
        "Mbit": (1e6, ("Mb", "megabit", "megabits")),
        "Gbit": (1e9, ("Gb", "gigabit", "gigabits")),
        "Tbit": (1e12, ("Tb", "terabit", "terabits")),
        "kB": (8e3, ("KB", "kilobyte", "kilobytes")),
        "MB": (8e6, ("megabyte", "megabytes")),
        "GB": (8e9, ("gigabyte", "gigabytes")),
        "TB": (8e12, ("terabyte", "terabytes")),
        "PB": (8e15, ("petabyte", "petabytes")),
        "KiB": (8.0 * 2**10, ("kibibyte", "kibibytes")),
        "MiB": (8.0 * 2**20, ("mebibyte", "mebibytes")),
        "GiB": (8.0 * 2**30, ("gibibyte", "gibibytes")),
        "TiB": (8.0 * 2**40, ("tebibyte", "tebibytes")),
        "PiB": (8.0 * 2**50, ("pebibyte", "pebibytes")),
        "Kibit": (2.0**10, ("kibibit", "kibibits")),
        "Mibit": (2.0**20, ("mebibit", "mebibits")),
        "Gibit": (2.0**30, ("gibibit", "gibibits")),
    },
}

_TEMPERATURE: dict[str, tuple[str, ...]] = {
    "C": ("°C", "celsius", "centigrade", "degc"),
    "F": ("°F", "fahrenheit", "degf"),
    "K": ("kelvin", "kelvins"),
    "R": ("°R", "rankine", "degr"),
}


def _build_index() -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    """Exact-spelling index and lowercase index (the latter without case-ambiguous data symbols)."""
    exact: dict[str, tuple[str, str]] = {}
    lower: dict[str, tuple[str, str]] = {}
    for category, units in _LINEAR.items():
        for symbol, (_, aliases) in units.items():
            for name in (symbol, *aliases):
                exact[name] = (category, symbol)
                if category != "data" or len(name) > 5:  # "mb"/"Mb"/"MB" differ; full names do not
                    lower.setdefault(name.lower(), (category, symbol))
    for symbol, aliases in _TEMPERATURE.items():
        for name in (symbol, *aliases):
            exact[name] = ("temperature", symbol)
            lower.setdefault(name.lower(), ("temperature", symbol))
    return exact, lower


_EXACT, _LOWER = _build_index()


def _lookup(unit: str) -> tuple[str, str]:
    key = " ".join(unit.strip().split())
    found = _EXACT.get(key) or _LOWER.get(key.lower())
    if found is None and key.lower().endswith("s") and len(key) > 3:
        found = _LOWER.get(key.lower()[:-1])
    if found is None:
        data_symbols = {sym.lower(): sym for sym in _LINEAR["data"]}
        if key.lower() in data_symbols or key.lower() in ("mb", "gb", "tb", "kb", "pb"):
            raise ToolError(
                f"unit {unit!r} is ambiguous: data units are case-sensitive (b = bit, B = byte), "
                "e.g. Mb = megabit, MB = megabyte, MiB = mebibyte"
            )
        listing = "; ".join(
            f"{cat}: {', '.join(units)}"
            for cat, units in (*((c, list(u)) for c, u in _LINEAR.items()), ("temperature", list(_TEMPERATURE)))
        )
        raise ToolError(f"unknown unit {unit!r}. Known units ({listing})")
    return found


def _to_kelvin(value: float, unit: str) -> float:
    return {"C": value + 273.15, "F": (value - 32) * 5 / 9 + 273.15, "K": value, "R": value * 5 / 9}[unit]


def _from_kelvin(value: float, unit: str) -> float:
    return {"C": value - 273.15, "F": (value - 273.15) * 9 / 5 + 32, "K": value, "R": value * 9 / 5}[unit]


class Conversion(msgspec.Struct):
    value: float
    from_unit: str
    to_unit: str
    result: float
    category: str
    text: str


@tool(annotations={"title": "Convert units", "readOnlyHint": True, "idempotentHint": True, "openWorldHint": False})
def convert_units(value: float, from_unit: str, to_unit: str) -> Conversion:
    """Convert a value between units of length, mass, time, temperature or data size.

    Units are given by symbol or name, e.g. length: m, km, cm, mm, um, nm, in, ft, yd, mi, nmi, au,
    ly; mass: kg, g, mg, ug, t, lb, oz, st, ton (US short ton), long_ton; time: s, ms, us, ns, min,
    h, d, wk, yr; temperature: C, F, K, R; data: bit, B, kB, MB, GB, TB, PB (powers of 1000), KiB,
    MiB, GiB, TiB, PiB (powers of 1024), kbit, Mbit, Gbit, Tbit, Kibit, Mibit, Gibit. Data symbols
    are case-sensitive (Mb = megabit, MB = megabyte). Temperatures below absolute zero are refused.

    Args:
        value: The quantity to convert.
        from_unit: The unit of `value` (symbol or name, e.g. "km" or "kilometers").
        to_unit: The unit to convert to (symbol or name).
    """
    if not math.isfinite(value):
        raise ToolError("value must be a finite number")
    cat_from, sym_from = _lookup(from_unit)
    cat_to, sym_to = _lookup(to_unit)
    if cat_from != cat_to:
        raise ToolError(f"cannot convert {cat_from} ({sym_from}) to {cat_to} ({sym_to})")
    if cat_from == "temperature":
        kelvin = _to_kelvin(value, sym_from)
        if kelvin < -1e-9:
            raise ToolError(f"{value} {sym_from} is below absolute zero")
        result = _from_kelvin(max(kelvin, 0.0), sym_to)
    else:
        units = _LINEAR[cat_from]
        result = value * units[sym_from][0] / units[sym_to][0]
    if not math.isfinite(result):
        raise ToolError("result is too large")
    result = float(f"{result:.15g}")  # drop binary noise such as 0.30000000000000004
    if result == 0:
        result = 0.0
    return Conversion(value, sym_from, sym_to, result, cat_from, f"{value:g} {sym_from} = {result:.15g} {sym_to}")
