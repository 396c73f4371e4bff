"""Who imports whom in the `loadopt` package, read from the source with `ast` (nothing is imported).

Every import counts: module-level, function-local and under `TYPE_CHECKING`. `from P import n` is an edge to
the module `P.n` where that is a module, else to `P`. The package a module sits in is not an edge of its own
(Python runs `P/__init__.py` first, but `__init__` files here hold only re-exports).

    python tools/import_graph.py            # cycles, upward imports, the largest folders
    python tools/import_graph.py --mermaid  # the layers picture for docs/architecture.md
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "loadopt"

# The layers, lowest first: a module may import its own layer or any below it, never one above. A module is
# placed by the longest entry that names it or a package above it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("loadopt.errors", "loadopt.files", "loadopt.version", "loadopt.clock"),
    ("loadopt.named",),
    ("loadopt.machine", "loadopt.schema", "loadopt.accelerators_table", "loadopt.config_models", "loadopt.device",
     "loadopt.progress", "loadopt.imaging"),
    ("loadopt.recipe",),
    ("loadopt.storage",),
    ("loadopt.loaders",),
    ("loadopt.config",),
    ("loadopt.bench",),
    ("loadopt.procurement", "loadopt.serve", "loadopt.measure"),
    ("loadopt.api", "loadopt.report"),
    ("loadopt.explain", "loadopt.doctor"),
    ("loadopt.cli", "loadopt"),  # the commands, and the package's lazy names for users
)


@dataclass(frozen=True)
class ImportGraph:
    """Modules by dotted name, with the file each lives in and the modules each imports."""

    files: dict[str, Path]
    imports: dict[str, set[str]]

    def folders(self) -> dict[str, list[str]]:
        """Each package (folder) and the modules directly in it, `__init__` not counted."""
        out: dict[str, list[str]] = defaultdict(list)
        for name, path in self.files.items():
            if path.name != "__init__.py":
                out[name.rsplit(".", 1)[0]].append(name)
        return dict(out)

    def cycles(self) -> list[list[str]]:
        """The strongly connected components of more than one module, each sorted, largest first."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[list[str]] = []
        counter = [0]

        def visit(node: str) -> None:
            # Iterative Tarjan: the package's depth would pass Python's recursion limit on a long chain.
            work = [(node, iter(sorted(self.imports.get(node, ()))))]
            index[node] = low[node] = counter[0]
            counter[0] += 1
            stack.append(node)
            on_stack.add(node)
            while work:
                current, children = work[-1]
                advanced = False
                for child in children:
                    if child not in index:
                        index[child] = low[child] = counter[0]
                        counter[0] += 1
                        stack.append(child)
                        on_stack.add(child)
                        work.append((child, iter(sorted(self.imports.get(child, ())))))
                        advanced = True
                        break
                    if child in on_stack:
                        low[current] = min(low[current], index[child])
                if advanced:
                    continue
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[current])
                if low[current] == index[current]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == current:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

        for node in sorted(self.files):
            if node not in index:
                visit(node)
        return sorted(found, key=lambda c: (-len(c), c))

    def upward(self) -> list[tuple[str, str]]:
        """Imports from a module to one in a higher layer."""
        return sorted((source, target) for source, targets in self.imports.items() for target in targets
                      if layer_of(target) > layer_of(source))


def layer_of(module: str) -> int:
    """The module's layer; an entry point (`__main__`) is above every layer."""
    if module.endswith("__main__"):
        return len(LAYERS)
    best, rank = -1, len(LAYERS)
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), index
    return rank


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_graph(root: Path = ROOT, package: str = PACKAGE) -> ImportGraph:
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    native = {module_name(p, root).split(".cpython")[0] for p in (root / package).rglob("*.pyi")}
    imports: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    # `import a.b.c` names a.b.c; the longest prefix that is one of ours is the edge
                    parts = alias.name.split(".")
                    for end in range(len(parts), 0, -1):
                        if ".".join(parts[:end]) in files:
                            targets.add(".".join(parts[:end]))
                            break
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(name, path.name == "__init__.py", node)
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in files:
                        targets.add(submodule)
                    elif submodule in native:
                        continue  # a compiled module imports nothing of ours
                    elif source in files:
                        targets.add(source)
        targets.discard(name)
        imports[name] = targets
    return ImportGraph(files, imports)


LEAF_LAYERS = 4  # the layers drawn as one box: the modules and folders everything else stands on


def place(module: str) -> str | None:
    """The box a module is drawn in: the `LAYERS` entry that places it, or `leaves`; None for an entry point or
    the package's lazy names (`loadopt/__init__.py`), which stand above everything."""
    if module.endswith("__main__") or module == PACKAGE:
        return None
    if layer_of(module) < LEAF_LAYERS:
        return "leaves"
    return max((p for prefixes in LAYERS for p in prefixes if module == p or module.startswith(p + ".")), key=len)


def box_edges(graph: ImportGraph) -> set[tuple[str, str]]:
    """Box A -> box B where a module of A imports one of B, less each edge that others imply (the transitive
    reduction: the boxes stand in layers, so the graph has no cycle and the reduction is the picture's)."""
    edges: set[tuple[str, str]] = set()
    for source, targets in graph.imports.items():
        for target in targets:
            a, b = place(source), place(target)
            if a and b and a != b:
                edges.add((a, b))
    out: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        out[a].add(b)

    def reaches(start: str, goal: str) -> bool:
        todo, seen = [n for n in out[start] if n != goal], set()
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(out[node])
        return False

    return {(a, b) for a, b in edges if not reaches(a, b)}


def mermaid(graph: ImportGraph) -> str:
    """The layers' boxes, each naming its folders, and an arrow where one imports from another, bottom-up."""
    edges = sorted(box_edges(graph))
    boxes = sorted({n for e in edges for n in e})
    folders = graph.folders()

    def label(box: str) -> str:
        if box == "leaves":
            members = sorted({m.removeprefix(PACKAGE + ".").split(".")[0] for m in graph.files if place(m) == box})
            return "leaves: " + ", ".join(members)
        inside = sorted(f.removeprefix(box + ".") for f in folders if f.startswith(box + "."))
        path = box.replace(".", "/") + ("/" if box in folders else ".py")
        return path + (": " + ", ".join(inside) if inside else "")

    lines = ["flowchart BT"] + [f'    {b.replace(".", "_")}["{label(b)}"]' for b in boxes]
    lines += [f'    {a.replace(".", "_")} --> {b.replace(".", "_")}' for a, b in edges]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mermaid", action="store_true", help="print the folders' picture as a Mermaid chart")
    args = parser.parse_args(argv)
    graph = read_graph()
    if args.mermaid:
        sys.stdout.write(mermaid(graph))
        return 0
    cycles = graph.cycles()
    print(f"modules: {len(graph.files)}")
    print(f"import cycles: {len(cycles)}")
    for cycle in cycles:
        print("  " + " <-> ".join(m.removeprefix(PACKAGE + ".") for m in cycle))
    upward = graph.upward()
    print(f"upward imports: {len(upward)}")
    for source, target in upward:
        print(f"  {source} -> {target}")
    folders = sorted(graph.folders().items(), key=lambda kv: -len(kv[1]))
    print(f"largest folder: {folders[0][0]} ({len(folders[0][1])} modules)")
    for name, modules in folders:
        print(f"  {name}: {len(modules)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
