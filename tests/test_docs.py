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
    # README has one snippet per piece; a regex that found nothing would pass every case below.
    readme = [b for b in BLOCKS if b.values[0].name == "README.md"]
    assert len(readme) >= 7, [b.id for b in BLOCKS]


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
