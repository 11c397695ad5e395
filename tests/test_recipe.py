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
        "encoder": {"tower": {"name": "gin"}},
        "data": {"source": "graphs"},
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
