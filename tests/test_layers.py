"""The package's layers, read from its source: no import cycle, no import upward, no folder past 16 modules, the
dataset opener outside any one source, and the architecture page's picture drawn from the code as it is."""

import ast
import re
from pathlib import Path

from tools.import_graph import ROOT, layer_of, mermaid, read_graph

MAX_MODULES = 16


def test_no_import_cycle_and_none_upward():
    graph = read_graph()
    assert graph.cycles() == []
    assert graph.upward() == []


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The count holds only if function-local and TYPE_CHECKING imports are edges too: a package whose only
    cycle goes through them is found."""
    package = tmp_path / "loadopt"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "inner" / "__init__.py").write_text("")
    (package / "inner" / "a.py").write_text("def f():\n    from loadopt.inner import b\n")
    (package / "inner" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                            "    from .a import f\n")
    assert read_graph(tmp_path).cycles() == [["loadopt.inner.a", "loadopt.inner.b"]]


def test_no_folder_holds_more_than_16_modules():
    sizes = {folder: len(modules) for folder, modules in read_graph().folders().items()}
    assert max(sizes.values()) <= MAX_MODULES, {f: n for f, n in sizes.items() if n > MAX_MODULES}


def test_open_dataset_is_defined_apart_from_the_sources_and_typed():
    tree = ast.parse((ROOT / "loadopt" / "storage" / "open.py").read_text())
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "open_dataset"]
    assert found and ast.unparse(found[0].returns) == "Dataset"
    sources = ROOT / "loadopt" / "storage" / "sources"
    assert not [p.name for p in sources.glob("*.py") if re.search(r"^def open_dataset\b", p.read_text(), re.M)]


def test_every_module_has_a_layer_and_entry_points_sit_on_top():
    graph = read_graph()
    assert layer_of("loadopt.measure.__main__") > layer_of("loadopt.cli")
    assert layer_of("loadopt.storage.forms.ready") < layer_of("loadopt.loaders.arrow.loader")
    assert all(layer_of(m) >= 0 for m in graph.files)


def test_the_architecture_page_draws_the_layers_as_the_code_has_them():
    page = (ROOT / "docs" / "architecture.md").read_text()
    drawn = re.search(r"```mermaid\n(.*?)```", page, re.S)
    assert drawn, "docs/architecture.md has no layers picture"
    assert drawn.group(1) == mermaid(read_graph()), \
        "the picture is stale: paste the output of `python tools/import_graph.py --mermaid` into it"


def test_the_script_prints_the_counts(capsys):
    from tools.import_graph import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "import cycles: 0" in out and "upward imports: 0" in out
    assert Path(__file__).resolve().parents[1] == ROOT
