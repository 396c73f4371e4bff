"""The manual renders as written: every page through the Markdown that MkDocs reads (its default extensions), with no
list run into the paragraph above it, no code span showing an escaping backslash, and no path into files that are
not in the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md"))
LIST_ITEM = re.compile(r"\s*(- |\* |\d+\. )")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT / "docs")))
def test_the_page_renders_as_written(page):
    markdown = pytest.importorskip("markdown", reason="Markdown comes with mkdocs (pip install -e '.[test]')")
    html = markdown.markdown(page.read_text(), extensions=["toc", "tables", "fenced_code"])
    for block in re.findall(r"<(?:p|li)>(.*?)</(?:p|li)>", html, re.S):
        swallowed = [line for line in block.split("\n")[1:] if LIST_ITEM.match(line)]
        assert not swallowed, f"a list item rendered as text (a blank line or 4-space indent missing): {swallowed[0]}"
    escaped = [code for code in re.findall(r"<code>(.*?)</code>", html, re.S) if "\\|" in code]
    assert not escaped, f"a code span shows its escaping backslash (a pipe in a code span needs none): {escaped[0]}"
    outside = re.findall(r"\.\./shared/|DESIGN\.md", page.read_text())
    assert not outside, f"points at a file that is not in the repository: {outside[0]}"
