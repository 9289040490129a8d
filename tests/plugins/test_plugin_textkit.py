from __future__ import annotations

import pytest

from sandbox import ToolError


@pytest.fixture(scope="module")
def tk(load_plugin):
    return load_plugin("textkit")


# -- stats -------------------------------------------------------------------------------------


def test_stats_counts(tk):
    text = "Hello world. Hello again!\n\nDon't stop-me now? yes"
    s = tk.module.stats(text, top_n=3)
    assert s.characters == len(text)
    assert s.words == 8  # Don't and stop-me are one word each
    assert s.unique_words == 7
    assert s.lines == 3
    assert s.sentences == 4
    assert s.paragraphs == 2
    assert [(w.word, w.count) for w in s.top_words] == [("hello", 2), ("again", 1), ("don't", 1)]
    assert s.reading_time_seconds == 2 and s.reading_time == "2 s"


def test_stats_empty_and_stopwords(tk):
    s = tk.module.stats("")
    assert (s.words, s.lines, s.sentences, s.paragraphs, s.average_word_length) == (0, 0, 0, 0, 0.0)
    s = tk.module.stats("the cat and the hat and the bat", top_n=2, ignore_stopwords=True)
    assert [w.word for w in s.top_words] == ["bat", "cat"]


def test_stats_reading_time_minutes(tk):
    s = tk.module.stats("word " * 450, words_per_minute=200)
    assert s.reading_time_seconds == 135 and s.reading_time == "2 min 15 s"


def test_stats_through_worker_is_structured(tk):
    out = tk.call("stats", text="a b c", top_n=1)
    assert out.structured["words"] == 3
    assert out.structured["top_words"] == [{"word": "a", "count": 1}]


def test_stats_rejects_bad_arguments(tk):
    assert "Invalid arguments" in tk.error("stats", text="x", top_n=1000)


def test_text_size_limit(tk):
    big = "é" * 600_000  # 1.2 MB of UTF-8 though only 600k characters
    with pytest.raises(ToolError, match="too large"):
        tk.module.stats(big)


# -- regex search ------------------------------------------------------------------------------


def test_regex_search_spans_groups_lines(tk):
    r = tk.module.regex_search("foo bar\nbaz FOO", r"(?P<first>f)(o+)|(x)", flags="i")
    assert r.count == 2 and not r.truncated
    m1, m2 = r.matches
    assert (m1.text, m1.start, m1.end, m1.line, m1.column) == ("foo", 0, 3, 1, 1)
    assert (m2.text, m2.start, m2.end, m2.line, m2.column) == ("FOO", 12, 15, 2, 5)
    g1, g2, g3 = m2.groups
    assert (g1.index, g1.name, g1.text, g1.start, g1.end) == (1, "first", "F", 12, 13)
    assert (g2.name, g2.text) == (None, "OO")
    assert (g3.text, g3.start, g3.end) == (None, None, None)


def test_regex_search_max_matches(tk):
    r = tk.module.regex_search("a" * 50, "a", max_matches=10)
    assert r.count == 10 and r.truncated


def test_regex_search_flags(tk):
    assert tk.module.regex_search("a\nb", "^b$").count == 0
    assert tk.module.regex_search("a\nb", "^b$", flags="m").count == 1
    assert tk.module.regex_search("a\nb", "a.b", flags="s").count == 1
    with pytest.raises(ToolError, match="unknown regex flag"):
        tk.module.regex_search("a", "a", flags="q")


def test_regex_refuses_long_pattern_and_bad_syntax(tk):
    with pytest.raises(ToolError, match="too long"):
        tk.module.regex_search("a", "a" * 1001)
    with pytest.raises(ToolError, match="invalid regular expression"):
        tk.module.regex_search("a", "(unclosed")


@pytest.mark.parametrize("pattern", [r"(a+)+b", r"(\w+\s?)*$", r"(?:a*)*", r"((ab)*c)+", r"(a{1,500})*"])
def test_regex_refuses_catastrophic_nesting(tk, pattern):
    with pytest.raises(ToolError, match="nests unbounded quantifiers"):
        tk.module.regex_search("aaaa", pattern)


@pytest.mark.parametrize("pattern", [r"(?:a|b)*c", r"(a++)+", r"(?>a+)+", r"(\d{1,3}\.){3}\d{1,3}", r"\w+@\w+\.\w+"])
def test_regex_allows_safe_patterns(tk, pattern):
    tk.module.regex_search("aaa 1.2.3.4 x@y.z", pattern)


# -- regex replace -----------------------------------------------------------------------------


def test_regex_replace_groups_and_count(tk):
    r = tk.module.regex_replace("a1b22c333", r"(\d+)", r"<\1>")
    assert (r.text, r.replacements) == ("a<1>b<22>c<333>", 3)
    r = tk.module.regex_replace("a1b22c333", r"(?P<n>\d+)", r"[\g<n>]", count=2)
    assert (r.text, r.replacements) == ("a[1]b[22]c333", 2)


def test_regex_replace_bad_template_fails_even_without_match(tk):
    with pytest.raises(ToolError, match="invalid replacement template"):
        tk.module.regex_replace("zzz", r"(a)", r"\2")
    assert "invalid replacement template" in tk.error("regex_replace", text="a", pattern="a", replacement="\\g<nope>")


def test_regex_replace_output_bound(tk):
    with pytest.raises(ToolError, match="exceed"):
        tk.module.regex_replace("a" * 1000, "", "x" * 5000)


# -- diff --------------------------------------------------------------------------------------


def test_diff_unified(tk):
    r = tk.module.diff("a\nb\nc\n", "a\nB\nc\nd\n", from_name="old.txt", to_name="new.txt")
    assert not r.identical
    assert (r.added_lines, r.removed_lines, r.hunks) == (2, 1, 1)
    assert r.diff == "--- old.txt\n+++ new.txt\n@@ -1,3 +1,4 @@\n a\n-b\n+B\n c\n+d\n"


def test_diff_no_newline_marker_and_identical(tk):
    r = tk.module.diff("x", "y")
    assert r.diff.endswith("-x\n\\ No newline at end of file\n+y\n\\ No newline at end of file\n")
    same = tk.module.diff("same\n", "same\n")
    assert same.identical and same.diff == "" and same.hunks == 0


def test_diff_counts_lines_that_look_like_headers(tk):
    r = tk.module.diff("x\n", "++ y\n")
    assert (r.added_lines, r.removed_lines) == (1, 1)


def test_diff_limits(tk):
    with pytest.raises(ToolError, match="too many lines"):
        tk.module.diff("\n" * 5_001, "")


# -- slugify and case ----------------------------------------------------------------------------


def test_slugify(tk):
    s = tk.module.slugify
    assert s("  Héllo, Wörld! -- Ça va? ") == "hello-world-ca-va"
    assert s("Hello World", separator="_", lowercase=False) == "Hello_World"
    assert s("the quick brown fox", max_length=12) == "the-quick"
    assert s("日本語 text", ascii_only=False) == "日本語-text"
    with pytest.raises(ToolError, match="ascii_only=false"):
        s("日本語")


@pytest.mark.parametrize(
    ("to", "expected"),
    [
        ("camel", "httpServerErrorCode2"),
        ("pascal", "HttpServerErrorCode2"),
        ("snake", "http_server_error_code_2"),
        ("kebab", "http-server-error-code-2"),
        ("constant", "HTTP_SERVER_ERROR_CODE_2"),
        ("dot", "http.server.error.code.2"),
    ],
)
def test_convert_case_identifiers(tk, to, expected):
    assert tk.module.convert_case("HTTPServerError code-2", to) == expected


def test_convert_case_prose(tk):
    c = tk.module.convert_case
    assert c("hello WORLD, it's me", "title") == "Hello World, It's Me"
    assert c("hello. WORLD is big! yes", "sentence") == "Hello. World is big! Yes"
    assert c("MiXeD", "lower") == "mixed" and c("MiXeD", "upper") == "MIXED"
    assert c("some_snake_case", "camel") == "someSnakeCase"


def test_convert_case_rejects_unknown_style_via_schema(tk):
    assert "Invalid arguments" in tk.error("convert_case", text="x", to="shouty")
