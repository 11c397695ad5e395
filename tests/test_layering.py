"""The import rules of docs/ARCHITECTURE.md: bridge -> runner, bridge -> encoders, nothing back.

Checked on the source (AST), so a lazy import inside a function is caught too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "runner": {"encoders", "bridge"},
    "encoders": {"runner", "bridge"},
}


def _imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_wing_does_not_import_the_hall_or_the_other_wing(package):
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = _imported_top_levels(path) & FORBIDDEN[package]
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "import direction violated:\n" + "\n".join(offenders)


def test_layering_check_sees_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom bridge.wire import x\n\ndef f():\n    import encoders.api\n")
    assert _imported_top_levels(probe) == {"os", "bridge", "encoders"}
