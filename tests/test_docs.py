"""Every ```python block in README.md and docs/*.md runs as pasted, so no snippet can rot.

Each block runs in a fresh namespace, in a temporary working directory (files it writes land
there), with the Keras state cleared afterwards. A block that needs a package this backend
lacks fails like any other test: the docs say which extra a piece needs.
"""

import re
from pathlib import Path

import keras
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks():
    for path in DOC_FILES:
        text = path.read_text()
        for i, match in enumerate(re.finditer(r"```python\n(.*?)```", text, flags=re.S)):
            line = text.count("\n", 0, match.start()) + 2
            yield pytest.param(
                path, line, match.group(1), id=f"{path.relative_to(ROOT)}:{line}-block{i}"
            )


BLOCKS = list(_python_blocks())


def test_the_docs_have_runnable_snippets():
    # Every piece has a runnable snippet on its docs page (the README's table links it), and
    # the README one combining a few; a regex that found nothing would pass every case below.
    readme_text = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(kp\.[^`]+)`.*\]\(docs/([\w.]+\.md)\) \|$", readme_text, flags=re.M)
    assert len(rows) >= 13, rows  # one per piece of the public API
    pages = {b.values[0].name for b in BLOCKS}
    assert "README.md" in pages, [b.id for b in BLOCKS]
    assert [(piece, page) for piece, page in rows if page not in pages] == []


@pytest.mark.slow  # minutes: each block imports and fits as pasted
@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("path,line,code", BLOCKS)
def test_snippet_runs_as_pasted(path, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__snippet__"}
    try:
        exec(compile(code, f"{path.name}:{line}", "exec"), namespace)
    finally:
        keras.mixed_precision.set_global_policy("float32")
        keras.backend.clear_session()
