"""The house drawn from the code: graphexec's rooms (its folders and top-level modules), the
imports between them, and each room's floor (a room stands above everything it imports).

    python tools/architecture.py            # rewrite docs/architecture.md
    python tools/architecture.py --check    # exit 1 if docs/architecture.md is stale

Every import counts, at module level or inside a function: a lazy import is still a
dependency. tests/test_architecture.py holds the house to its rules with the same reading:
no circle between files or rooms, every file at most 400 lines, at most 10 modules at the
package's top, and this page current.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graphexec"
PAGE = ROOT / "docs" / "architecture.md"
FACE = "graphexec"  # the package's __init__: the public API


@dataclass
class Module:
    name: str  # dotted, e.g. graphexec.engine.step
    path: Path
    lines: int
    imports: set[str] = field(default_factory=set)  # dotted graphexec modules

    @property
    def room(self) -> str:
        parts = self.name.split(".")
        return FACE if len(parts) == 1 else parts[1]


def read_modules(package: Path = PACKAGE) -> dict[str, Module]:
    """Every module of the package with the graphexec modules it imports."""
    mods: dict[str, Module] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        text = path.read_text()
        mods[".".join(parts)] = Module(".".join(parts), path, len(text.splitlines()))
    for mod in mods.values():
        tree = ast.parse(mod.path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from a.b import c`: c is a module when a.b.c is one
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                         else node.module for a in node.names]  # fmt: skip
            else:
                continue
            mod.imports.update(n for n in names if n in mods and n != mod.name)
    return mods


def room_edges(mods: dict[str, Module]) -> dict[str, set[str]]:
    """room -> the rooms it imports (itself left out)."""
    edges: dict[str, set[str]] = {m.room: set() for m in mods.values()}
    for m in mods.values():
        edges[m.room].update(mods[i].room for i in m.imports if mods[i].room != m.room)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def floors(edges: dict[str, set[str]]) -> dict[str, int]:
    """Floor 1: imports no other room; otherwise one above the highest room it imports."""
    out: dict[str, int] = {}

    def floor(v: str, seen: tuple[str, ...] = ()) -> int:
        if v not in out:
            if v in seen:
                raise ValueError(f"import circle through {v}")
            out[v] = 1 + max((floor(w, seen + (v,)) for w in edges[v]), default=0)
        return out[v]

    for v in edges:
        floor(v)
    return out


def summary(mods: dict[str, Module], room: str) -> str:
    """The first sentence of the room's docstring (its __init__ or its module)."""
    name = FACE if room == FACE else f"{FACE}.{room}"
    doc = ast.get_docstring(ast.parse(mods[name].path.read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    return first.split(". ")[0].rstrip(".") + "." if first else ""


def page(mods: dict[str, Module]) -> str:
    edges = room_edges(mods)
    fl = floors(edges)
    order = sorted(edges, key=lambda r: (-fl[r], r))
    lines = [
        "# The house",
        "",
        "Generated from the code by `python tools/architecture.py` (do not edit by hand;",
        "`tests/test_architecture.py` fails when this page is stale). A room is a folder of",
        "`graphexec/` or a module at its top; an arrow `A --> B` means A imports B, so data",
        "and calls flow down the page. Floor 1 imports no other room.",
        "",
        "```mermaid",
        "flowchart TD",
    ]
    for r in order:
        label = "graphexec (public API)" if r == FACE else f"{r}/" if _is_pkg(r) else f"{r}.py"
        lines.append(f'    {_node(r)}["{label}"]')
    for r in order:
        for w in sorted(edges[r], key=lambda x: (-fl[x], x)):
            lines.append(f"    {_node(r)} --> {_node(w)}")
    lines += ["```", "", "| floor | room | files | lines | imports | what it holds |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in order:
        files = [m for m in mods.values() if m.room == r]
        name = "`graphexec`" if r == FACE else f"`{r}/`" if _is_pkg(r) else f"`{r}.py`"
        below = ", ".join(sorted(edges[r], key=lambda x: (-fl[x], x))) or "-"
        lines.append(f"| {fl[r]} | {name} | {len(files)} | {sum(m.lines for m in files):,} "
                     f"| {below} | {summary(mods, r)} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _is_pkg(room: str) -> bool:
    return (PACKAGE / room).is_dir()


def _node(room: str) -> str:
    return "face" if room == FACE else room


def main(argv: list[str]) -> int:
    text = page(read_modules())
    if "--check" in argv:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python tools/architecture.py")
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
