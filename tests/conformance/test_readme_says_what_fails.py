"""The README's conformance paragraph says what the expected-failure files say: every listed
scenario is accounted for, and nothing is called unbuilt that the suite passes."""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

#: How the README names each listed scenario (or the group it belongs to).
WORDING = {
    "completion-": "completion",
    "resources-": "resources",
    "prompts-": "prompts",
    "caching": "caching hints of the prompts",
    "input-required-result-non-tool-request": "input-required result on `prompts/get`",
    "sep-2164-resource-not-found": "`resources/read` of an unknown",
    "server-stateless": "`test_trigger_tool_change`",
}


def paragraph() -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    start = readme.index("The official conformance suite (")
    return " ".join(readme[start:readme.index("\n\n", start)].split())


def listed(name: str) -> list[str]:
    return re.findall(r"^\s+- ([a-z0-9-]+)", (HERE / name).read_text(encoding="utf-8"), re.M)


def test_every_expected_failure_is_named_in_the_readme() -> None:
    text = paragraph()
    for scenario in listed("expected-failures.yml") + listed("expected-failures-2026.yml"):
        words = [w for prefix, w in WORDING.items() if scenario.startswith(prefix)]
        assert words, f"{scenario}: a new expected failure; say in the README why it fails, and add it here"
        assert words[0] in text, f"the README's conformance paragraph does not account for {scenario}"


def test_the_readme_calls_nothing_unbuilt_that_the_suite_passes() -> None:
    text = paragraph()
    for phrase in ("not built", "come later", "which come later"):
        assert phrase not in text, phrase
    everything = " ".join(listed("expected-failures.yml") + listed("expected-failures-2026.yml"))
    assert "elicitation" not in everything and "sampling" not in everything and "tasks" not in everything
    assert "input-required results and tasks included, which pass" in text
