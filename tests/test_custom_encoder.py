"""The researcher's path: a tower of one's own, used from a recipe and the CLI, saved, and loaded
again in a process that never imported it; the README's example is this repository's example."""

from __future__ import annotations

import json
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from PIL import Image

from bridge.cli import main
from encoders.api import TOWERS, build_encoder, build_tower, load_encoder

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "recipes" / "custom"


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, flags=re.S)


def test_readme_example_is_the_repository_example():
    section = _readme_section("Write your own encoder")
    assert _blocks(section, "python") == [(EXAMPLE / "colour_grid.py").read_text()]
    assert _blocks(section, "yaml") == [(EXAMPLE / "colour_grid.yaml").read_text()]
    (command,) = _blocks(section, "bash")
    assert command.strip() == "bridge train recipes/custom/colour_grid.yaml --output-dir runs/colour-grid"


def test_readme_example_trains_then_loads_in_a_registry_that_never_saw_it(tmp_path, monkeypatch, capsys):
    (command,) = _blocks(_readme_section("Write your own encoder"), "bash")
    argv = shlex.split(command)[1:]
    argv[1] = str(ROOT / argv[1])  # the command as written, run from a scratch folder
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 200 and summary["eval_n"] == 32
    assert summary["exact_match"] >= 0.3  # colours are learnt; the coarse grid loses some shapes
    run = tmp_path / "runs" / "colour-grid"
    config = json.loads((run / "checkpoints" / "step_200" / "encoder" / "image" / "config.json").read_text())
    assert config["imports"] == [str(EXAMPLE / "colour_grid.py")]
    assert config["tower"]["name"] == "colour_grid"

    # forget the tower, as a fresh process would: loading must import the recorded file again
    module = TOWERS.pop("colour_grid").__module__
    sys.modules.pop(module, None)
    from bridge.api import Bridge

    bridge = Bridge.from_checkpoint(run, device="cpu")
    assert "colour_grid" in TOWERS
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    out = bridge.generate([{"prompt": "<image>", "image": image}], max_tokens=4)
    assert out[0].outputs[0].token_ids

    # a recorded module that is gone: the error names it and the file that listed it
    moved = tmp_path / "moved_encoder"
    moved.mkdir()
    for f in (run / "checkpoints" / "step_200" / "encoder" / "image").iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    config["imports"] = [str(tmp_path / "gone" / "colour_grid.py")]
    (moved / "config.json").write_text(json.dumps({"bridge_encoder_format": 1, **config}))
    with pytest.raises(ValueError, match=r"config\.json: imports: cannot import .*gone/colour_grid\.py"):
        load_encoder(moved)

    assert main(["defaults", str(EXAMPLE / "colour_grid.yaml")]) == 0
    assert re.search(r"# towers: .*colour_grid", capsys.readouterr().out)


def _write_module(tmp_path: Path, name: str, body: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))


_GOOD_TOWER = """
    import torch
    from torch import nn
    import encoders

    class Rows(encoders.Tower):
        modality = "graph"
        def __init__(self, dim=8, width=None):
            super().__init__()
            self.out_dim = dim
            self.lin = nn.Linear(1, width or dim)
        @classmethod
        def from_config(cls, cfg):
            return cls(**cfg)
        def export_config(self):
            return {"dim": self.out_dim}
        def preprocess(self, item):
            return torch.tensor([[float(item["num_nodes"])]])
        def collate(self, processed):
            return {"x": torch.stack(processed)}
        def output_rows(self, item):
            return 1
        def forward(self, batch):
            return self.lin(batch["x"]), None
"""


def test_module_class_reference_builds_saves_and_loads(tmp_path, monkeypatch):
    _write_module(tmp_path, "ref_towers_ok", _GOOD_TOWER)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = {
        "tower": {"name": "ref_towers_ok:Rows", "dim": 8},
        "projector": {"name": "linear"},
        "llm_hidden_size": 16,
    }
    enc = build_encoder(cfg)
    assert enc.config["tower"]["name"] == "ref_towers_ok:Rows"  # export_config gave no name: the reference
    enc.save(tmp_path / "enc")
    again = load_encoder(tmp_path / "enc")
    graph = {"num_nodes": 3, "edges": [[0, 1]]}
    assert torch.equal(again.encode([graph])[0], enc.encode([graph])[0])


def test_tower_missing_a_method_is_named_at_build(tmp_path, monkeypatch):
    _write_module(
        tmp_path,
        "ref_towers_bad",
        _GOOD_TOWER.replace(
            '        def collate(self, processed):\n            return {"x": torch.stack(processed)}\n', ""
        ),
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"tower class ref_towers_bad\.Rows does not define collate"):
        build_tower({"name": "ref_towers_bad:Rows"})


def test_wrong_out_dim_names_tower_and_both_widths(tmp_path, monkeypatch):
    _write_module(tmp_path, "ref_towers_wide", _GOOD_TOWER)
    monkeypatch.syspath_prepend(str(tmp_path))
    enc = build_encoder(
        {
            "tower": {"name": "ref_towers_wide:Rows", "dim": 16, "width": 12},
            "projector": {"name": "mlp"},
            "llm_hidden_size": 8,
        }
    )
    with pytest.raises(ValueError, match=r"'ref_towers_wide:Rows' \(Rows\).*out_dim=16.*got width 12"):
        enc.encode([{"num_nodes": 2, "edges": [[0, 1]]}])


def test_unimportable_reference_names_the_module():
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_pkg\.towers'"):
        build_tower({"name": "no_such_pkg.towers:Tower"})
    with pytest.raises(ValueError, match=r"unknown tower name 'gni' \(did you mean 'gin'\?\)"):
        build_tower({"name": "gni"})
