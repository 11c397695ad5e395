"""Recipe schema: validation messages name the key, defaults fill in, overrides keep YAML types."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bridge.recipe import (
    SCHEMA,
    RecipeError,
    apply_overrides,
    describe_schema,
    load_recipe,
    parse_override,
    validate,
)

ROOT = Path(__file__).resolve().parents[1]


def _minimal(**extra) -> dict:
    raw = {
        "model": {"tiny": {"hidden_size": 32}},
        "encoder": {"tower": {"name": "gin"}, "projector": {"name": "linear"}},
        "data": {"source": "graphs", "prompt": "<graph>"},
    }
    raw.update(extra)
    return raw


def test_defaults_fill_in_and_attribute_access():
    r = validate(_minimal())
    assert r.stage == "align"
    assert r.train.lr == SCHEMA["train"]["lr"].default
    assert r.train.lora.targets == ["q_proj", "v_proj"]
    assert r.eval.num_items == 200
    assert r.to_dict()["train"]["batch_size"] == SCHEMA["train"]["batch_size"].default


def test_unknown_key_names_path_and_nearest_valid_key():
    with pytest.raises(
        RecipeError, match=r"unknown key 'train\.batch_sise'.*did you mean 'train\.batch_size'"
    ):
        validate(_minimal(train={"batch_sise": 8}))
    with pytest.raises(RecipeError, match=r"'train\.lora\.rnk'.*'train\.lora\.rank'"):
        validate(_minimal(train={"lora": {"rnk": 4}}))
    with pytest.raises(RecipeError, match=r"'trian'.*'train'"):
        validate(_minimal(trian={}))


def test_unknown_key_misplaced_suggests_path_elsewhere():
    # `warmup_steps` belongs under train: the message points there
    with pytest.raises(RecipeError, match=r"unknown key 'eval\.warmup_steps'.*'train\.warmup_steps'"):
        validate(_minimal(eval={"warmup_steps": 3}))


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(RecipeError, match=r"data\.train: file or directory not found: .*nope/train\.jsonl"):
        validate(_minimal(data={"source": "jsonl", "train": str(missing)}))
    with pytest.raises(RecipeError, match=r"model\.path: file or directory not found"):
        validate({"model": {"path": str(tmp_path / "no_model")}, "encoder": {}, "data": {"source": "shapes"}})
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "missing.yaml")


def test_type_and_choice_errors():
    with pytest.raises(RecipeError, match=r"train\.batch_size: expected int, got str"):
        validate(_minimal(train={"batch_size": "8"}))
    with pytest.raises(RecipeError, match=r"stage: 'pretrain' is not one of"):
        validate(_minimal(stage="pretrain"))
    with pytest.raises(RecipeError, match=r"train\.max_steps: must be >= 1"):
        validate(_minimal(train={"max_steps": 0}))
    with pytest.raises(RecipeError, match="exactly one of model.path"):
        validate({"encoder": {}, "data": {"source": "shapes"}})
    with pytest.raises(RecipeError, match="stage align keeps the LLM frozen"):
        validate(_minimal(train={"trainable": {"llm": True}}))


def test_int_accepted_where_float_expected():
    r = validate(_minimal(train={"lr": 1}))
    assert isinstance(r.train.lr, float) and r.train.lr == 1.0


def test_overrides_are_yaml_typed_and_nested():
    assert parse_override("train.lr=3e-4") == (["train", "lr"], 3e-4)
    assert parse_override("train.progress=false") == (["train", "progress"], False)
    assert parse_override("train.lora.targets=[q_proj, k_proj]")[1] == ["q_proj", "k_proj"]
    raw = apply_overrides(_minimal(), ["train.batch_size=4", "encoder.tower.dim=16", "stage=finetune"])
    r = validate(raw)
    assert r.train.batch_size == 4 and r.encoder["tower"]["dim"] == 16 and r.stage == "finetune"
    with pytest.raises(RecipeError, match="expected key.sub=value"):
        parse_override("train.lr")
    with pytest.raises(RecipeError, match=r"unknown key 'train\.bach_size'.*'train\.batch_size'"):
        validate(apply_overrides(_minimal(), ["train.bach_size=4"]))


def test_load_recipe_file_with_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(_minimal(name="x")))
    r = load_recipe(path, ["train.max_steps=7"])
    assert r.name == "x" and r.train.max_steps == 7


def test_describe_schema_lists_every_leaf_with_default():
    text = describe_schema()
    assert "train.lora.rank = 8" in text
    assert "stage = 'align' [align|finetune]" in text


@pytest.mark.parametrize("path", sorted((ROOT / "recipes" / "demo").glob("*.yaml")), ids=lambda p: p.name)
def test_demo_recipes_validate(path):
    r = load_recipe(path)
    assert r.model.tiny is not None and r.eval.num_items >= 200


# ----------------------------------------------------------------------------- real recipes on stand-ins


def _jsonl(path: Path, rows: list[dict]) -> Path:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _vision_standin(tmp: Path) -> list[str]:
    """A tiny open_clip checkpoint file (visual-only state dict) and PNG images."""
    import numpy as np
    import torch
    from open_clip.model import _build_vision_tower
    from PIL import Image

    from encoders.vision_towers import BUILTIN_OPEN_CLIP_CONFIGS

    cfg = BUILTIN_OPEN_CLIP_CONFIGS["bridge-tiny-vit"]  # an open_clip visual tower, as a CLIP file holds it
    visual = _build_vision_tower(cfg["embed_dim"], cfg["vision_cfg"])
    ckpt = tmp / "clip.bin"
    torch.save({f"visual.{k}": v for k, v in visual.state_dict().items()}, ckpt)
    rows = []
    for i in range(4):
        Image.fromarray(np.full((40, 40, 3), 40 * i, dtype=np.uint8)).save(tmp / f"{i}.png")
        rows.append({"image": f"{i}.png", "text": f"shade {i}"})
    return [
        "encoder.tower.arch=bridge-tiny-vit",
        f"encoder.tower.pretrained={ckpt}",
        f"data.train={_jsonl(tmp / 'train.jsonl', rows)}",
        f"data.eval={_jsonl(tmp / 'eval.jsonl', rows)}",
    ]


def _audio_standin(tmp: Path) -> list[str]:
    """A tiny local Whisper directory and WAV files."""
    import torch
    import transformers

    from encoders.api import save_wav

    cfg = transformers.WhisperConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=80,
        max_source_positions=50,
        max_target_positions=32,
        vocab_size=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    transformers.WhisperModel(cfg).save_pretrained(tmp / "whisper")
    rows = []
    for i in range(4):
        t = torch.arange(8000) / 16000
        save_wav(tmp / f"{i}.wav", 0.3 * torch.sin(2 * torch.pi * (200 + 100 * i) * t), 16000)
        rows.append({"audio": f"{i}.wav", "text": f"tone {i}"})
    return [
        f"encoder.tower.path={tmp / 'whisper'}",
        f"data.train={_jsonl(tmp / 'train.jsonl', rows)}",
        f"data.eval={_jsonl(tmp / 'eval.jsonl', rows)}",
    ]


def _graph_standin(tmp: Path) -> list[str]:
    import json

    rows = []
    for i in range(4):
        n = 3 + i
        graph = {
            "num_nodes": n,
            "edges": [[j, j + 1] for j in range(n - 1)],
            "node_features": [[float(j == k) for k in range(4)] for j in range(n)],
        }
        (tmp / f"{i}.json").write_text(json.dumps(graph))
        rows.append({"graph": f"{i}.json", "text": f"chain {n}"})
    return [
        "encoder.tower.node_feature_dim=4",
        "encoder.tower.dim=32",
        f"data.train={_jsonl(tmp / 'train.jsonl', rows)}",
        f"data.eval={_jsonl(tmp / 'eval.jsonl', rows)}",
    ]


@pytest.mark.parametrize(
    "name, family, standin",
    [
        ("vision_openclip_qwen3", "qwen3", _vision_standin),
        ("audio_whisper_llama", "llama", _audio_standin),
        ("graph_gat_qwen3", "qwen3", _graph_standin),
    ],
)
def test_real_recipe_loads_local_weights_and_trains_a_step(name, family, standin, tmp_path):
    """The real recipes' loading paths, on tiny local stand-ins of the real files: the LLM dir, the
    tower's weights, JSONL rows with media paths; one training step and an eval through the runner."""
    import json

    from bridge.tiny_models import build_tiny_model
    from bridge.training.trainer import Trainer

    path = ROOT / "recipes" / "real" / f"{name}.yaml"
    with pytest.raises(RecipeError, match="not found"):  # as shipped, the EDIT paths are named when absent
        load_recipe(path)
    llm = build_tiny_model(
        tmp_path / "llm",
        family,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
    )
    overrides = [
        f"model.path={llm}",
        "model.dtype=float32",
        "train.precision=fp32",
        "train.max_steps=1",
        "train.batch_size=2",
        "train.progress=false",
        "train.device=cpu",
        "eval.num_items=2",
        "eval.max_tokens=3",
        *standin(tmp_path),
    ]
    r = load_recipe(path, overrides)
    assert r.stage == "align"
    summary = Trainer(r, tmp_path / "out").run()
    assert summary["steps"] == 1 and summary["eval"]["n"] == 2
    meta = json.loads((tmp_path / "out" / "checkpoints" / "step_1" / "meta.json").read_text())
    assert meta["llm_dir"] == str(llm.resolve())  # align: the local LLM dir is served as is


# ------------------------------------------------------------------ errors before work, all at once
def _shapes_recipe(tmp_path: Path, **edits) -> Path:
    raw = yaml.safe_load((ROOT / "recipes" / "demo" / "shapes.yaml").read_text())
    for key, value in edits.items():
        node = raw
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_every_recipe_problem_in_one_message_before_anything_is_written(tmp_path, capsys):
    from bridge.cli import main

    path = _shapes_recipe(
        tmp_path,
        **{
            "encoder.tower": {
                "name": "open_clip",
                "arch": "bridge-tiny-vit",
                "pretrained": "weights/clip.bin",
            },
            "encoder.projector": {"name": "mpl"},
            "data.prompt": "describe:",
            "model.tiny.hidden_sise": 64,
        },
    )
    out = tmp_path / "out"
    overrides = ["train.lr=.nan", "train.batch_size=1000000000", "data.num_train=-5"]
    assert main(["train", str(path), "--output-dir", str(out), *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not out.exists()  # nothing written, base_model included
    expected = [
        f"encoder.tower: open_clip tower: pretrained file {tmp_path / 'weights' / 'clip.bin'} does not exist",
        "encoder.projector: unknown projector name 'mpl' (did you mean 'mlp'?)",
        "data.prompt: 'describe:' has no <image> placeholder",
        "unknown key 'model.tiny.hidden_sise' (did you mean 'model.tiny.hidden_size'?)",
        "train.lr: must be a finite number, got nan",
        "train.batch_size: must be <= 65536, got 1000000000",
        "data.num_train: must be >= 0, got -5",
    ]
    for line in expected:
        assert line in err, (line, err)
    assert err.startswith(f"bridge: {len(expected)} problems in recipe {path}:")


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lr=.inf", "train.lr: must be a finite number, got inf"),
        ("train.lr=0", "train.lr: must be > 0, got 0.0"),
        ("train.grad_accum_steps=-1", "train.grad_accum_steps: must be >= 1, got -1"),
        ("eval.max_tokens=10000000", "eval.max_tokens: must be <= 65536"),
        ("train.lora.dropout=.nan", "train.lora.dropout: must be a finite number"),
        ("train.betas=[0.9, 2]", "train.betas: expected two numbers in [0, 1)"),
        ("model.tiny.num_layers=-2", "model.tiny.num_layers: must be >= 1, got -2"),
        ("model.tiny.hidden_size=big", "model.tiny.hidden_size: expected int, got str"),
        ("encoder.tower.channels=[16, -8, 64]", "encoder.tower: conv tower: channels must be a list of ints"),
        ("encoder.tower.chanels=[8]", "encoder.tower: tower 'conv': unknown config key(s) ['chanels']"),
    ],
)
def test_values_out_of_range_are_refused_naming_the_key(override, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(ROOT / "recipes" / "demo" / "shapes.yaml", [override])
    assert message in str(info.value)


def test_relative_paths_resolve_against_the_recipe_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"graph": "g.json", "text": "a ring"}\n')
    (folder / "g.json").write_text('{"num_nodes": 3, "edges": [[0, 1], [1, 2], [2, 0]]}')
    recipe = folder / "r.yaml"
    raw = _minimal(
        data={"source": "jsonl", "train": "train.jsonl", "eval": "missing.jsonl", "prompt": "<graph>"}
    )
    recipe.write_text(yaml.safe_dump(raw))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(
        RecipeError, match=rf"data\.eval: file or directory not found: {folder / 'missing.jsonl'}"
    ):
        load_recipe(recipe)
    r = load_recipe(recipe, ["data.eval=null"])
    assert r.data.train == str(folder / "train.jsonl")
    # a path typed on the command line is relative to where it was typed
    (elsewhere / "other.jsonl").write_text('{"graph": "g.json", "text": "x"}\n')
    assert load_recipe(recipe, ["data.eval=other.jsonl"]).data.eval == str(elsewhere / "other.jsonl")


def test_usage_shows_overrides_as_optional(capsys):
    from bridge.cli import main

    for argv in (["train"], ["demo"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "[key.sub=value ...]" in err and "required: key.sub" not in err
