"""The manual renders as written: every page through the Markdown that MkDocs reads (its default extensions), with no
list run into the paragraph above it, no code span showing an escaping backslash, and no file named that is not in
the repository."""

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
    named = [path for path in FILE_NAMED.findall(page.read_text()) if not _in_repository(path)]
    assert not named, f"names a file that is not in the repository: {named[0]}"


# A file of the repository named in a code span: from its top (`benchmarks/x.py`) or within the package (`bench/x.py`).
FILE_NAMED = re.compile(r"`((?:loadopt|benchmarks|tests|examples|tools|configs|docs|bench|storage|loaders|serve|"
                        r"measure|cli|report|procurement|imaging|schema)/[\w./-]+\.(?:py|md|yaml|c|sh|json))`")


def _in_repository(path: str) -> bool:
    return (ROOT / path).exists() or (ROOT / "loadopt" / path).exists()
