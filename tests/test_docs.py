"""Every ```python snippet in README.md and docs/*.md runs as written (in a fresh namespace)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"```python\n(.*?)```", re.S)


def _snippets():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for f in files:
        for i, m in enumerate(_FENCE.finditer(f.read_text())):
            yield pytest.param(m.group(1), id=f"{f.name}#{i}")


@pytest.mark.parametrize("code", list(_snippets()))
def test_snippet_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})
