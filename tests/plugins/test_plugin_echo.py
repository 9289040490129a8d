from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def echo(load_plugin):
    return load_plugin("echo")


@pytest.mark.parametrize("text", ["hello", "", "ünïcødé ✓ \n\t", "x" * 100_000])
def test_echo_returns_text_unchanged(echo, text):
    out = echo.call("echo", text=text)
    assert out.result.content == [{"type": "text", "text": text}]
    assert not out.result.is_error and not out.result.has_structured


def test_echo_manifest_for_the_benchmark(echo):
    assert echo.manifest.prefix == ""
    assert echo.manifest.limits.max_concurrency == 2
    assert list(echo.tools) == ["echo"]
    assert echo.tools["echo"].input_schema["required"] == ["text"]
