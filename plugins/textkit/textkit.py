"""textkit: text statistics, regex search/replace, unified diffs, slugs and case conversion.

Everything is offline and bounded: texts are capped at 1 MB, patterns at 1000 characters, match
counts and output sizes are capped, and regex patterns with nested unbounded quantifiers (the
classic catastrophic-backtracking shape, e.g. ``(a+)+``) are refused before they run.
"""

from __future__ import annotations

import collections
import difflib
import re
import unicodedata
from typing import Annotated, Literal

import msgspec

from sandbox import ToolError, tool

MAX_TEXT_BYTES = 1_000_000
MAX_PATTERN_CHARS = 1000
MAX_REPLACEMENT_CHARS = 10_000
MAX_OUTPUT_CHARS = 2_000_000
MAX_MATCHES = 10_000
MAX_DIFF_BYTES = 512_000
MAX_DIFF_LINES = 5_000

READ_ONLY = {"readOnlyHint": True, "idempotentHint": True, "openWorldHint": False}

_WORD = re.compile(r"\w+(?:['\u2019-]\w+)*")
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?\u2026])[\"'\u201d\u2019)\]]*\s+")
_PARAGRAPH_SPLIT = re.compile(r"\n\s*\n")
_STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before being below
    between both but by can could did do does doing down during each few for from further had has have
    having he her here hers herself him himself his how i if in into is it its itself just me more most
    my myself no nor not now of off on once only or other our ours ourselves out over own same she
    should so some such than that the their theirs them themselves then there these they this those
    through to too under until up very was we were what when where which while who whom why will with
    would you your yours yourself yourselves""".split()  # noqa: SIM905
)


def _check_text(text: str, name: str = "text", limit: int = MAX_TEXT_BYTES) -> None:
    # Cheap pre-check on characters first (a character is at most 4 UTF-8 bytes).
    if len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit:
        raise ToolError(f"{name} is too large: the limit is {limit:,} bytes of UTF-8")


# -- regex safety ------------------------------------------------------------------------------

_FLAG_LETTERS = {
    "i": re.IGNORECASE,
    "m": re.MULTILINE,
    "s": re.DOTALL,
    "x": re.VERBOSE,
    "a": re.ASCII,
}

try:  # CPython's regex parser; used only to refuse patterns that backtrack exponentially.
    from re import _constants as _sre_c  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - other interpreters
    _sre_c = _sre_parse = None

#: Repeats with a maximum above this count as "unbounded" for the nesting check.
_BIG_REPEAT = 100


def _nested_unbounded(parsed: object) -> bool:
    """True if an unbounded repeat contains another unbounded repeat (e.g. ``(a+)+``, ``(a*b?)*``).

    Possessive quantifiers and atomic groups do not backtrack, so they are allowed.
    """
    c = _sre_c

    def big(max_: int) -> bool:
        return max_ == c.MAXREPEAT or max_ > _BIG_REPEAT

    def children(op: object, av: object) -> list[object]:
        """The sub-patterns a node contains (none for possessive repeats and atomic groups)."""
        if op == c.SUBPATTERN:
            return [av[-1]]  # type: ignore[index]
        if op == c.BRANCH:
            return list(av[1])  # type: ignore[index]
        if op in (c.ASSERT, c.ASSERT_NOT):
            return [av[1]]  # type: ignore[index]
        if op == c.GROUPREF_EXISTS:
            return [b for b in av[1:] if b is not None]  # type: ignore[index]
        return []  # literals, classes, and POSSESSIVE_REPEAT / ATOMIC_GROUP (they never backtrack)

    def walk(items: object, inside_big_repeat: bool) -> bool:
        for op, av in items:  # type: ignore[attr-defined]
            if op in (c.MAX_REPEAT, c.MIN_REPEAT):
                _, hi, sub = av
                if big(hi) and inside_big_repeat:
                    return True
                if walk(sub, inside_big_repeat or big(hi)):
                    return True
            elif any(walk(child, inside_big_repeat) for child in children(op, av)):
                return True
        return False

    return walk(parsed, False)


def _compile(pattern: str, flags: str) -> re.Pattern[str]:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ToolError(f"pattern is too long ({len(pattern):,} characters); the limit is {MAX_PATTERN_CHARS}")
    value = 0
    for letter in flags.replace(" ", "").replace(",", ""):
        flag = _FLAG_LETTERS.get(letter.lower())
        if flag is None:
            raise ToolError(f"unknown regex flag {letter!r}; use any of: i, m, s, x, a")
        value |= flag
    try:
        compiled = re.compile(pattern, value)
    except re.error as exc:
        raise ToolError(f"invalid regular expression: {exc}") from None
    except (RecursionError, OverflowError):
        raise ToolError("regular expression is too complex") from None
    if _sre_parse is not None:
        try:
            parsed = _sre_parse.parse(pattern, value)
        except (re.error, RecursionError, OverflowError):  # pragma: no cover - compile() accepted it
            parsed = None
        if parsed is not None and _nested_unbounded(parsed):
            raise ToolError(
                "pattern refused: it nests unbounded quantifiers (like (a+)+ or (\\w+\\s?)*), which can take "
                "exponential time. Rewrite it without the nesting, or use a possessive quantifier (a++) or an "
                "atomic group (?>...)."
            )
    return compiled


# -- stats ---------------------------------------------------------------------------------------


class WordCount(msgspec.Struct):
    word: str
    count: int


class TextStats(msgspec.Struct):
    characters: int
    characters_no_whitespace: int
    bytes_utf8: int
    words: int
    unique_words: int
    lines: int
    sentences: int
    paragraphs: int
    average_word_length: float
    reading_time_seconds: int
    reading_time: str
    top_words: list[WordCount]


@tool(annotations={"title": "Text statistics", **READ_ONLY})
def stats(
    text: str,
    top_n: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=100,
            description="How many of the most frequent words to list (0-100); ties are ordered alphabetically.",
        ),
    ] = 10,
    ignore_stopwords: bool = False,
    words_per_minute: Annotated[
        int,
        msgspec.Meta(ge=50, le=2000, description="Reading speed used for the reading-time estimate (50-2000)."),
    ] = 200,
) -> TextStats:
    """Count characters, words, lines, sentences and paragraphs of a text, list its most frequent words and estimate its reading time.

    Words are runs of letters/digits (contractions and hyphenated words count as one); sentences end
    with . ! ? or an ellipsis followed by whitespace; paragraphs are separated by blank lines.

    Args:
        text: The text to analyse (at most 1 MB).
        ignore_stopwords: Leave common English function words (the, and, of, ...) out of the top words.
    """
    _check_text(text)
    words = _WORD.findall(text)
    lowered = [w.lower() for w in words]
    counts = collections.Counter(lowered)
    ranked = counts.items()
    if ignore_stopwords:
        ranked = [(w, n) for w, n in ranked if w not in _STOPWORDS]
    top = sorted(ranked, key=lambda item: (-item[1], item[0]))[:top_n]
    stripped = text.strip()
    sentences = sum(1 for part in _SENTENCE_SPLIT.split(stripped) if _WORD.search(part)) if stripped else 0
    paragraphs = sum(1 for part in _PARAGRAPH_SPLIT.split(text) if part.strip())
    lines = text.count("\n") + (1 if text and not text.endswith("\n") else 0)
    seconds = round(len(words) * 60 / words_per_minute)
    if seconds < 60:
        human = f"{seconds} s"
    else:
        minutes, rest = divmod(seconds, 60)
        human = f"{minutes} min" if rest == 0 else f"{minutes} min {rest} s"
    return TextStats(
        characters=len(text),
        characters_no_whitespace=sum(1 for ch in text if not ch.isspace()),
        bytes_utf8=len(text.encode("utf-8", "surrogatepass")),
        words=len(words),
        unique_words=len(counts),
        lines=lines,
        sentences=sentences,
        paragraphs=paragraphs,
        average_word_length=round(sum(len(w) for w in words) / len(words), 2) if words else 0.0,
        reading_time_seconds=seconds,
        reading_time=human,
        top_words=[WordCount(w, n) for w, n in top],
    )


# -- regex search ------------------------------------------------------------------------------


class GroupMatch(msgspec.Struct):
    index: int
    name: str | None
    text: str | None
    start: int | None
    end: int | None


class RegexMatch(msgspec.Struct):
    text: str
    start: int
    end: int
    line: int
    column: int
    groups: list[GroupMatch]


class SearchResult(msgspec.Struct):
    count: int
    truncated: bool
    matches: list[RegexMatch]


@tool(annotations={"title": "Regex search", **READ_ONLY})
def regex_search(
    text: str,
    pattern: str,
    flags: str = "",
    max_matches: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            le=MAX_MATCHES,
            description="Stop after this many matches (1-10000); `truncated` tells whether more were left.",
        ),
    ] = 100,
) -> SearchResult:
    """Find the matches of a Python regular expression in a text, with their spans, line/column and capture groups.

    Offsets are 0-based character (code point) indexes into the text, end exclusive; line and column
    are 1-based. Groups that did not take part in a match have null text and spans. Patterns whose
    nested unbounded quantifiers could backtrack exponentially are refused.

    Args:
        text: The text to search (at most 1 MB).
        pattern: A Python `re` regular expression (at most 1000 characters).
        flags: Flag letters: i (ignore case), m (^ and $ match at line breaks), s (. matches newlines), x (verbose), a (ASCII-only \\w \\d \\s).
    """
    _check_text(text)
    compiled = _compile(pattern, flags)
    names = {index: name for name, index in compiled.groupindex.items()}
    matches: list[RegexMatch] = []
    truncated = False
    budget = MAX_OUTPUT_CHARS
    line, line_start, scanned = 1, 0, 0
    for m in compiled.finditer(text):
        if len(matches) >= max_matches:
            truncated = True
            break
        start, end = m.span()
        newlines = text.count("\n", scanned, start)
        if newlines:
            line += newlines
            line_start = text.rfind("\n", scanned, start) + 1
        scanned = start
        groups = []
        for index in range(1, compiled.groups + 1):
            g_start, g_end = m.span(index)
            value = m.group(index)
            groups.append(
                GroupMatch(
                    index=index,
                    name=names.get(index),
                    text=value,
                    start=None if value is None else g_start,
                    end=None if value is None else g_end,
                )
            )
            budget -= len(value or "")
        budget -= end - start
        if budget < 0:
            truncated = True
            break
        matches.append(RegexMatch(m.group(0), start, end, line, start - line_start + 1, groups))
    return SearchResult(count=len(matches), truncated=truncated, matches=matches)


# -- regex replace -----------------------------------------------------------------------------


class ReplaceResult(msgspec.Struct):
    text: str
    replacements: int


class _TooBig(Exception):
    pass


@tool(annotations={"title": "Regex replace", **READ_ONLY})
def regex_replace(
    text: str,
    pattern: str,
    replacement: str,
    flags: str = "",
    count: Annotated[
        int,
        msgspec.Meta(
            ge=0, le=1_000_000, description="Replace at most this many matches, from the start; 0 replaces all of them."
        ),
    ] = 0,
) -> ReplaceResult:
    """Replace the matches of a Python regular expression in a text and return the new text and the number of replacements.

    The replacement is a Python template: \\1 or \\g<1> insert a numbered group, \\g<name> a named
    group, \\n a newline; write \\\\ for a literal backslash.

    Args:
        text: The text to edit (at most 1 MB).
        pattern: A Python `re` regular expression (at most 1000 characters).
        replacement: The replacement template (at most 10000 characters).
        flags: Flag letters: i (ignore case), m (^ and $ match at line breaks), s (. matches newlines), x (verbose), a (ASCII-only \\w \\d \\s).
    """
    _check_text(text)
    if len(replacement) > MAX_REPLACEMENT_CHARS:
        raise ToolError(f"replacement is too long; the limit is {MAX_REPLACEMENT_CHARS} characters")
    compiled = _compile(pattern, flags)
    # Validate the template up front (CPython compiles it before scanning), so a bad template
    # fails even when nothing matches.
    try:
        compiled.sub(replacement, "")
    except (re.error, IndexError) as exc:
        raise ToolError(f"invalid replacement template: {exc}") from None
    produced = 0
    limit = MAX_OUTPUT_CHARS

    def expand(m: re.Match[str]) -> str:
        nonlocal produced
        try:
            out = m.expand(replacement)
        except (re.error, IndexError) as exc:
            raise ToolError(f"invalid replacement template: {exc}") from None
        produced += len(out) - (m.end() - m.start())
        if len(text) + produced > limit:
            raise _TooBig
        return out

    try:
        result, n = compiled.subn(expand, text, count=count)
    except _TooBig:
        raise ToolError(f"the result would exceed {limit:,} characters; replace fewer matches") from None
    return ReplaceResult(text=result, replacements=n)


# -- diff --------------------------------------------------------------------------------------


class DiffResult(msgspec.Struct):
    identical: bool
    added_lines: int
    removed_lines: int
    hunks: int
    diff: str


@tool(annotations={"title": "Unified diff", **READ_ONLY})
def diff(
    a: str,
    b: str,
    from_name: str = "a",
    to_name: str = "b",
    context_lines: Annotated[
        int,
        msgspec.Meta(ge=0, le=100, description="Unchanged lines shown around each change (0-100)."),
    ] = 3,
) -> DiffResult:
    """Compare two texts line by line and return a unified diff (as `diff -u` / `git diff` print it) with counts of added and removed lines.

    A last line without a trailing newline is marked "\\ No newline at end of file", as GNU diff does.

    Args:
        a: The original text (at most 512 KB and 5000 lines).
        b: The new text (at most 512 KB and 5000 lines).
        from_name: Label of the original text in the --- header line.
        to_name: Label of the new text in the +++ header line.
    """
    for name, value in (("a", a), ("b", b)):
        _check_text(value, name, MAX_DIFF_BYTES)
        if value.count("\n") > MAX_DIFF_LINES:
            raise ToolError(f"{name} has too many lines; the limit is {MAX_DIFF_LINES:,}")
    for label in (from_name, to_name):
        if len(label) > 500 or "\n" in label:
            raise ToolError("file labels must be single lines of at most 500 characters")
    a_lines = a.splitlines(keepends=True)
    b_lines = b.splitlines(keepends=True)
    out: list[str] = []
    added = removed = hunks = 0
    for line in difflib.unified_diff(a_lines, b_lines, from_name, to_name, n=context_lines):
        if line.startswith("@@"):
            hunks += 1
        elif hunks and line.startswith("+"):  # before the first hunk come the ---/+++ headers
            added += 1
        elif hunks and line.startswith("-"):
            removed += 1
        if not line.endswith(("\n", "\r")):
            line += "\n\\ No newline at end of file\n"
        out.append(line)
    return DiffResult(identical=a == b, added_lines=added, removed_lines=removed, hunks=hunks, diff="".join(out))


# -- slugify and case conversion ---------------------------------------------------------------


@tool(annotations={"title": "Slugify", **READ_ONLY})
def slugify(
    text: str,
    separator: Literal["-", "_", "."] = "-",
    max_length: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=1000,
            description="Cut the slug to at most this many characters at a word boundary when possible; 0 means no limit.",
        ),
    ] = 0,
    ascii_only: bool = True,
    lowercase: bool = True,
) -> str:
    """Turn a text into a URL/file-name friendly slug, e.g. "Héllo, Wörld!" -> "hello-world".

    Accents are transliterated (é -> e); every run of other characters becomes one separator.

    Args:
        text: The text to slugify (at most 100 KB).
        separator: The character placed between words.
        ascii_only: Drop characters that have no ASCII transliteration (e.g. CJK); when false, Unicode letters are kept.
        lowercase: Lowercase the slug.
    """
    _check_text(text, limit=100_000)
    value = unicodedata.normalize("NFKD", text)
    if ascii_only:
        value = value.encode("ascii", "ignore").decode("ascii")
    else:
        value = "".join(ch for ch in value if not unicodedata.combining(ch))
    if lowercase:
        value = value.lower()
    words = re.findall(r"[^\W_]+", value)
    slug = separator.join(words)
    if max_length and len(slug) > max_length:
        cut = slug[: max_length + 1]
        boundary = cut.rfind(separator)
        slug = cut[:boundary] if boundary > 0 else slug[:max_length]
        slug = slug.strip(separator)
    if not slug:
        hint = " (try ascii_only=false to keep non-Latin letters)" if ascii_only and text.strip() else ""
        raise ToolError(f"the text has no letters or digits to build a slug from{hint}")
    return slug


def _split_words(text: str) -> list[str]:
    """Words of an identifier or phrase: splits on non-alphanumerics and on case changes."""
    words: list[str] = []
    for chunk in re.findall(r"[^\W_]+", text):
        start = 0
        for i in range(1, len(chunk)):
            prev, ch = chunk[i - 1], chunk[i]
            nxt = chunk[i + 1] if i + 1 < len(chunk) else ""
            if ((prev.islower() or prev.isdigit()) and ch.isupper()) or (
                prev.isupper() and ch.isupper() and nxt.islower()
            ):
                words.append(chunk[start:i])
                start = i
        words.append(chunk[start:])
    return words


def _capitalize(word: str) -> str:
    return word[:1].upper() + word[1:].lower()


CaseName = Literal["lower", "upper", "title", "sentence", "camel", "pascal", "snake", "kebab", "constant", "dot"]


@tool(annotations={"title": "Convert case", **READ_ONLY})
def convert_case(text: str, to: CaseName) -> str:
    """Convert a text or identifier to another letter case or naming style.

    lower, upper, title and sentence keep the text's punctuation and spacing. The identifier styles
    (camel: fooBar, pascal: FooBar, snake: foo_bar, kebab: foo-bar, constant: FOO_BAR, dot: foo.bar)
    split the input into words on spaces, punctuation and case changes ("HTTPServerError" ->
    HTTP, Server, Error) and join them again.

    Args:
        text: The text or identifier to convert (at most 1 MB).
        to: The target case or naming style.
    """
    _check_text(text)
    if to == "lower":
        return text.lower()
    if to == "upper":
        return text.upper()
    if to == "title":
        return re.sub(r"[^\W_]+(?:['\u2019][^\W_]+)*", lambda m: _capitalize(m.group(0)), text)
    if to == "sentence":
        lowered = text.lower()
        return re.sub(r"(^|[.!?]\s+)([^\W\d_])", lambda m: m.group(1) + m.group(2).upper(), lowered)
    words = _split_words(text)
    if not words:
        raise ToolError("the text has no letters or digits to convert")
    if to == "camel":
        return words[0].lower() + "".join(_capitalize(w) for w in words[1:])
    if to == "pascal":
        return "".join(_capitalize(w) for w in words)
    if to == "snake":
        return "_".join(w.lower() for w in words)
    if to == "kebab":
        return "-".join(w.lower() for w in words)
    if to == "constant":
        return "_".join(w.upper() for w in words)
    if to == "dot":
        return ".".join(w.lower() for w in words)
    raise ToolError(f"unknown case {to!r}")  # pragma: no cover - Literal is checked first
