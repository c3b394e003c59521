"""CONTRIBUTING.md's module map names every module of the three packages, so a reader can
find where a thing lives and a new module cannot land without saying what it is."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "CONTRIBUTING.md"
PACKAGES = ("batchpilot", "server", "operator")


def modules(package: str) -> list[str]:
    """Every module under a package, as a path relative to it (``engine/core.py``)."""
    base = ROOT / package
    return sorted(
        p.relative_to(base).as_posix()
        for p in base.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    )


def rows(text: str) -> list[tuple[str, str]]:
    """(first cell, whole row) of every table row."""
    found = []
    for line in text.splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            found.append((cells[1].strip(), line))
    return found


def section(package: str) -> str:
    """The part of the map about one package: the Layout row for ``batchpilot/``, the
    ``### `server/``` and ``### `operator/``` sections for the others."""
    text = MAP.read_text()
    if package == "batchpilot":
        return next(row for first, row in rows(text) if first == "`batchpilot/`")
    match = re.search(rf"^### `{package}/`.*?(?=^##)", text, flags=re.M | re.S)
    assert match, f"CONTRIBUTING.md has no section for {package}/"
    return match.group(0)


def named(module: str, text: str) -> bool:
    """A module is named by its path (`engine/core.py`), or by its file name in a row whose
    first cell is its folder (`crd/` ... `spec.py`)."""
    if f"`{module}`" in text:
        return True
    folder, _, name = module.rpartition("/")
    return any(
        first == f"`{folder}/`" and f"`{name}`" in row for first, row in rows(text) if folder
    ) or (not folder and f"`{name}`" in text)


def unnamed(package: str) -> list[str]:
    text = section(package)
    return [m for m in modules(package) if not named(m, text)]


def test_every_module_is_in_the_map():
    missing = {p: unnamed(p) for p in PACKAGES}
    assert not any(missing.values()), f"add these to CONTRIBUTING.md's module map: {missing}"


def test_a_module_missing_from_the_map_is_caught():
    text = "| module | what |\n|---|---|\n| `crd/` | `spec.py` |\n| `llm.py` | x |\n"
    assert named("crd/spec.py", text) and named("llm.py", text)
    assert not named("crd/status.py", text)
    assert not named("loop/spec.py", text)
    assert modules("server"), "the walk found no modules"
