"""The house's rules, read from the code (`tools/architecture.py`): data flows down (no
circle between files or rooms), files stay short, the package's top holds only its face
and public types, and docs/architecture.md is the current drawing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("architecture", ROOT / "tools" / "architecture.py")
arch = importlib.util.module_from_spec(spec)
sys.modules["architecture"] = arch
spec.loader.exec_module(arch)

MAX_LINES = 400
MAX_TOP_MODULES = 10


@pytest.fixture(scope="module")
def mods():
    return arch.read_modules()


def test_no_import_circle_between_files(mods) -> None:
    edges = {name: m.imports for name, m in mods.items()}
    assert arch.circles(edges) == []


def test_no_room_imports_a_room_above_it(mods) -> None:
    """A room-level circle is a lower room importing a higher one: none."""
    assert arch.circles(arch.room_edges(mods)) == []


def test_every_file_is_at_most_400_lines(mods) -> None:
    long = {m.name: m.lines for m in mods.values() if m.lines > MAX_LINES}
    assert long == {}


def test_the_package_top_holds_at_most_10_modules() -> None:
    top = sorted(p.name for p in arch.PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_no_two_modules_share_a_name(mods) -> None:
    """A newcomer finds a concept by its file name: one file per name (packages' faces
    and the __main__ aside)."""
    seen: dict[str, str] = {}
    for name, m in mods.items():
        base = m.path.stem
        if base in ("__init__", "__main__"):
            continue
        assert base not in seen, (name, seen.get(base))
        seen[base] = name


def test_the_reading_sees_lazy_and_from_imports(tmp_path) -> None:
    """The checks above would pass vacuously if imports were missed: a circle made of a
    lazy import and a `from package import module` is found."""
    pkg = tmp_path / "graphexec"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a" / "__init__.py").write_text("")
    (pkg / "a" / "x.py").write_text("def f():\n    from graphexec.b import y\n")
    (pkg / "b.py").write_text("from graphexec.a import x\n")
    mods = arch.read_modules(pkg)
    assert mods["graphexec.a.x"].imports == {"graphexec.b"}
    assert mods["graphexec.b"].imports == {"graphexec.a.x"}
    assert arch.circles(arch.room_edges(mods)) == [["a", "b"]]
    with pytest.raises(ValueError, match="circle"):
        arch.floors(arch.room_edges(mods))


def test_docs_architecture_page_is_current(mods) -> None:
    assert arch.PAGE.read_text() == arch.page(mods), "run python tools/architecture.py"
