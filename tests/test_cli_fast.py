"""The CLI answers at once: `bridge --help`, `bridge train --help`, `bridge defaults` and usage errors
load no torch (checked in a fresh process through `sys.modules`, not timed), and the static table of
built-in part names that `bridge defaults` prints is the registry's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "runner", "encoders", "fastapi", "numpy", "PIL")

_PROBE = """
import contextlib, io, json, sys
from bridge.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(HEAVY)))
print(json.dumps({"code": code, "heavy": heavy, "out": out.getvalue(), "err": err.getvalue()}))
"""


def _run(*argv: str) -> dict:
    probe = _PROBE.replace("json.loads(HEAVY)", repr(list(HEAVY)))
    done = subprocess.run([sys.executable, "-c", probe, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["demo", "--help"], ["eval", "--help"],
                                  ["defaults"], ["train"], ["bogus"]])
def test_help_and_usage_load_no_heavy_module(argv):
    result = _run(*argv)
    assert result["heavy"] == [], result
    assert result["code"] in (0, 2)
    assert "usage: bridge" in result["out"] + result["err"] or "train.lr = " in result["out"]


def test_defaults_lists_the_schema_and_the_built_in_parts():
    out = _run("defaults")["out"]
    assert "train.lr = 0.001" in out and "data.truncate = False" in out
    assert "# towers: conformer, conv, gat, gcn, gin, hf_vision, open_clip" in out


def test_static_built_in_names_are_the_registry():
    from bridge.builtin_parts import BUILTIN_PARTS
    from encoders.api import PREPROCESSORS, PROJECTORS, TOWERS

    assert {k: sorted(v) for k, v in BUILTIN_PARTS.items()} == {
        "towers": sorted(TOWERS), "projectors": sorted(PROJECTORS), "preprocessors": sorted(PREPROCESSORS)}


def test_bridge_package_exports_stay_reachable_lazily():
    code = ("import sys, bridge; assert 'torch' not in sys.modules; "
            "from bridge import load_prompt_embeds, encode_prompt_embeds, DEFAULT_MAX_PROMPT_EMBEDS_BYTES; "
            "assert callable(load_prompt_embeds) and DEFAULT_MAX_PROMPT_EMBEDS_BYTES > 0")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
