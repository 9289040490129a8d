"""Every skip says why, trio tests' included (``tests/skip_reasons.py``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_skip_inside_a_trio_test_is_reported_with_its_reason(tmp_path: Path) -> None:
    (tmp_path / "test_skipping.py").write_text(
        "import pytest\n\n\nasync def test_needs_something() -> None:\n"
        "    pytest.skip('the frobnicator is not installed here')\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "skip_reasons", "-p", "no:cacheprovider", "-rs",
                          "-o", "trio_mode=true", "--rootdir", str(tmp_path), "-c", "/dev/null", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                         env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"})
    assert "1 skipped" in out.stdout, out.stdout + out.stderr
    assert "SKIPPED [1] test_skipping.py:5: the frobnicator is not installed here" in out.stdout, out.stdout
