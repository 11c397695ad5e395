"""The README's tables of engine options and environment variables are the generated ones, and every
`BRIDGE_*` variable the code reads is in `runner.envs` (one list of settings, no stray switches)."""

from __future__ import annotations

import re
from pathlib import Path

from runner.config import options_table_markdown
from runner.envs import BRIDGE_VARIABLES, env_table_markdown

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _between(name: str) -> str:
    text = README.read_text()
    begin, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    assert begin in text and end in text, f"README lacks the {name} markers"
    return text.split(begin, 1)[1].split(end, 1)[0]


def test_readme_options_table_is_the_generated_one():
    assert _between("options-table") == options_table_markdown(), (
        "regenerate: runner.config.options_table_markdown()")


def test_readme_env_table_is_the_generated_one():
    assert _between("env-table") == env_table_markdown(), "regenerate: runner.envs.env_table_markdown()"


def test_every_bridge_variable_in_the_product_code_is_registered():
    registered = {v.name for v in BRIDGE_VARIABLES}
    found: dict[str, Path] = {}
    for package in ("bridge", "runner", "encoders"):
        for path in (ROOT / package).rglob("*.py"):
            for name in re.findall(r"\bBRIDGE_[A-Z0-9_]+\b", path.read_text()):
                if name != "BRIDGE_VARIABLES":
                    found.setdefault(name, path)
    stray = {name: str(path.relative_to(ROOT)) for name, path in found.items() if name not in registered}
    assert not stray, f"environment variables outside runner.envs: {stray}"
    assert registered <= set(found), "a registered variable no code reads"
