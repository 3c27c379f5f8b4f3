"""The front page stays a front page: README.md at most 15 KB (it was 18.1 KB with a
hand-kept module tree that repeated the modules' own docstrings; the layer table and
docs/*.md hold the rest)."""

from __future__ import annotations

from support import ROOT

MAX_README_BYTES = 15_000


def test_the_readme_is_at_most_15_kb():
    size = (ROOT / "README.md").stat().st_size
    assert size <= MAX_README_BYTES, f"README.md is {size} bytes; move detail to docs/"
