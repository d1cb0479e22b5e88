"""Every Python example in docs/api.md and README.md runs as written (CPU, reference path)."""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _examples():
  out = []
  for doc in ("docs/api.md", "README.md"):
    text = (ROOT / doc).read_text()
    for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
      line = text[:text.index(block)].count("\n") + 1
      out.append(pytest.param(block, id=f"{doc}:{line}"))
  return out


EXAMPLES = _examples()


def test_docs_have_examples():
  assert len(EXAMPLES) >= 10


@pytest.mark.parametrize("code", EXAMPLES)
def test_example_runs(code):
  exec(compile(code, "<docs example>", "exec"), {"__name__": "__docs_example__"})
