"""The data formats teams already have: LLaVA conversations (`data.source: llava`), local Hugging Face
datasets (`hf`: save_to_disk folders and parquet), webdataset tar shards (`webdataset`, brace
patterns). Each trains end to end on tiny files; a multi-turn conversation's loss covers exactly its
assistant tokens, packed or not; malformed rows stop the run before it writes anything, named by
file and line (or row, or shard and key), or with `data.skip_bad_rows` are skipped and counted."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers import tiny_graph_recipe_parts
from PIL import Image

from bridge.cli import main
from bridge.data.conversation import conversation_example, generation_prompt
from bridge.data.example import Turn
from bridge.data.paths import expand_data_paths
from bridge.data.tokenize import tokenize_prompt
from bridge.recipe import RecipeError, apply_overrides, load_recipe, recipe_changes, validate
from bridge.tiny_models import build_tokenizer
from bridge.training.batching import IGNORE, collate_examples, tokenize_example
from runner.multimodal.prompt_text import encode_text

ROOT = Path(__file__).resolve().parents[1]
COLOURS = {"red": (200, 30, 30), "blue": (30, 30, 200), "green": (30, 200, 30)}
QUICK = ["train.max_steps=2", "train.batch_size=2", "train.progress=false", "eval.enabled=false",
         "train.log_every=1"]


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    """Parquet conversions go to this test's folder, not the user's datasets cache."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def png(colour: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((32, 32, 3), COLOURS[colour], np.uint8)).save(out, "PNG")
    return out.getvalue()


def write_recipe(folder: Path, data: dict) -> Path:
    """The README's recipe for one's own files (a one-layer LLM reading 32x32 images through a small
    CNN) with this `data` section, next to the test's files."""
    raw = yaml.safe_load((ROOT / "recipes" / "files" / "tiny_vision.yaml").read_text())
    raw["data"] = data
    raw["train"]["device"] = "cpu"
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def llava_rows(folder: Path) -> list[dict]:
    """Two-turn conversations about one image each (the images written to `folder`)."""
    rows = []
    for i, colour in enumerate(COLOURS):
        (folder / f"{colour}.png").write_bytes(png(colour))
        rows.append({"id": str(i), "image": f"{colour}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat colour is it?"},
            {"from": "gpt", "value": colour},
            {"from": "human", "value": "Is it a square?"},
            {"from": "gpt", "value": "yes a square"},
        ]})
    return rows


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def summary_of(out: str) -> dict:
    return json.loads(out[out.index("{"):])


# ----------------------------------------------------------------------------- end to end
def test_llava_conversations_train_and_evaluate(tmp_path, capsys):
    """LLaVA's JSON (a pretty-printed array): two steps, then evaluation generates from each
    conversation's turns before its last answer."""
    (tmp_path / "llava.json").write_text(json.dumps(llava_rows(tmp_path), indent=2))
    recipe = write_recipe(tmp_path, {"source": "llava", "train": "llava.json", "eval": "llava.json"})
    out = tmp_path / "out"
    code, stdout, err = run(["train", str(recipe), "--output-dir", str(out), *QUICK[:3], "eval.enabled=true",
                             "eval.num_items=2", "eval.max_tokens=3"], capsys)
    assert code == 0, err
    summary = summary_of(stdout)
    assert summary["steps"] == 2 and summary["eval_n"] == 2 and summary["final_loss"] > 0
    sample = json.loads((out / "eval.json").read_text())["samples"][0]
    assert sample["prompt"] == "<image>\nWhat colour is it? red</s>Is it a square?"  # turn format {value}
    assert sample["target"] == "yes a square"


def test_hf_parquet_and_save_to_disk_train_with_renamed_columns(tmp_path, capsys):
    import datasets

    features = datasets.Features({"img": datasets.Image(), "caption": datasets.Value("string")})
    ds = datasets.Dataset.from_dict(
        {"img": [{"bytes": png(c), "path": None} for c in COLOURS],
         "caption": [f"a {c} square" for c in COLOURS]},
        features=features)
    ds.to_parquet(str(tmp_path / "train-0.parquet"))
    ds.select([2, 0]).to_parquet(str(tmp_path / "train-1.parquet"))
    ds.save_to_disk(str(tmp_path / "held_out"))
    recipe = write_recipe(tmp_path, {"source": "hf", "train": "train-*.parquet", "eval": "held_out",
                                     "columns": {"image": "img", "text": "caption"}})
    code, stdout, err = run(["train", str(recipe), "--output-dir", str(tmp_path / "out"), *QUICK], capsys)
    assert code == 0, err
    assert summary_of(stdout)["steps"] == 2

    from bridge.data.hf import HFDataset

    both = HFDataset(str(tmp_path / "train-*.parquet"), columns={"image": "img", "text": "caption"})
    assert [both[i].target for i in range(len(both))] == [
        "a red square", "a blue square", "a green square", "a green square", "a red square"]
    assert both[4].media["image"][0].getpixel((0, 0)) == COLOURS["red"]


def write_shards(folder: Path, samples: list[list[tuple[str, bytes]]], name: str = "train") -> None:
    for s, members in enumerate(samples):
        with tarfile.open(folder / f"{name}-{s:05d}.tar", "w") as tf:
            for file, data in members:
                info = tarfile.TarInfo(file)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def test_webdataset_shards_train_from_a_brace_pattern(tmp_path, capsys):
    shards = []
    for s, colour in enumerate(COLOURS):
        shards.append([(f"{s}000.png", png(colour)), (f"{s}000.txt", f"a {colour} square".encode()),
                       (f"{s}001.png", png("red")),
                       (f"{s}001.json", json.dumps({"text": "a red square", "id": s}).encode())])
    write_shards(tmp_path, shards)
    recipe = write_recipe(tmp_path, {"source": "webdataset", "train": "train-{00000..00002}.tar"})
    code, stdout, err = run(["train", str(recipe), "--output-dir", str(tmp_path / "out"), *QUICK], capsys)
    assert code == 0, err
    assert summary_of(stdout)["steps"] == 2
    # loader workers (forked, reading the shards at offsets) make the same batches
    code, workers, err = run(["train", str(recipe), "--output-dir", str(tmp_path / "out2"), *QUICK,
                              "train.num_workers=2"], capsys)
    assert code == 0 and summary_of(workers)["final_loss"] == summary_of(stdout)["final_loss"], err
    assert "building batches in the training process" not in err  # the workers did build them

    from bridge.data.tar_shards import ShardDataset

    data = ShardDataset(str(tmp_path / "train-{00000..00002}.tar"))
    assert len(data) == 6 and data[1].target == "a red square" and data[2].target == "a blue square"
    from bridge.run_check import target_texts  # the check's tiny tokenizer has the run's words

    targets = sorted(set(target_texts(load_recipe(recipe).data)))
    assert targets == ["a blue square", "a green square", "a red square"]
    assert data.vocab_words() == ["a", "blue", "green", "red", "square"]
    assert data[2].media["image"][0].getpixel((0, 0)) == COLOURS["blue"]
    # the .json's fields fill the template; the .txt samples have none, so they are bad rows here
    data = ShardDataset(str(tmp_path / "train-{00000..00002}.tar"), prompt="<image> {id}:",
                        columns={"text": "json"}, skip_bad_rows=True)
    assert [data[i].prompt for i in range(len(data))] == ["<image> 0:", "<image> 1:", "<image> 2:"]
    assert len(data.skipped) == 3 and "no text file (.json)" in data.skipped[0]


def test_shard_samples_are_grouped_as_webdataset_groups_them(tmp_path):
    """Keys up to the first dot of the file name, extensions in lower case, consecutive files one
    sample, metadata files ignored: the same samples webdataset's own reader yields."""
    import webdataset as wds

    from bridge.data.tar_shards import ShardDataset

    members = [("a/0001.seg.png", png("red")), ("a/0001.TXT", b"a red square"), ("__info__/x.txt", b"x"),
               ("a/0002.png", png("blue")), ("a/0002.txt", b"a blue square"),
               ("b.0003.png", png("green")), ("b.0003.txt", b"a green square")]
    write_shards(tmp_path, [members])
    theirs = [(s["__key__"], sorted(k for k in s if not k.startswith("__")))
              for s in wds.WebDataset(str(tmp_path / "train-00000.tar"), shardshuffle=False)]
    assert theirs == [("a/0001", ["seg.png", "txt"]), ("a/0002", ["png", "txt"]),
                      ("b", ["0003.png", "0003.txt"])]
    data = ShardDataset(str(tmp_path / "train-00000.tar"), columns={"image": "seg.png"}, skip_bad_rows=True)
    assert [data.where(i).rsplit(":", 1)[1] for i in range(len(data))] == ["a/0001"]
    assert len(data.skipped) == 2  # a/0002 and b have no .seg.png: their prompts' <image> has no item


# ----------------------------------------------------------------------------- multi-turn loss
def conversation(turn_format: str = "Q: {value} A:"):
    turns = (Turn("user", "<image> what?"), Turn("assistant", "red circle"), Turn("user", "sure?"),
             Turn("assistant", "yes"))
    return conversation_example(turns, {"image": [torch.zeros(2, 4)]}, turn_format)


def test_multi_turn_loss_covers_exactly_the_assistant_tokens():
    tok = build_tokenizer(["red", "circle", "yes"])
    rows = {"image": lambda item: 2}
    ex = conversation()
    te = tokenize_example(tok, ex, rows)
    enc = lambda text: list(encode_text(tok, text))  # noqa: E731
    img, eos = tok.convert_tokens_to_ids("<image>"), tok.eos_token_id
    q1, a1, q2, a2 = enc("Q: "), enc(" red circle"), enc("Q: sure? A:"), enc(" yes")
    tail = enc(" what? A:")
    assert te.seq.ids == [*q1, img, img, *tail, *a1, eos, *q2, *a2, eos]
    assert te.loss == ([False] * (len(q1) + 2 + len(tail)) + [True] * (len(a1) + 1) + [False] * len(q2)
                       + [True] * (len(a2) + 1))
    assert [tok.decode([i]) for i, learned in zip(te.seq.ids, te.loss) if learned] == [
        " red", " circle", "</s>", " yes", "</s>"]
    batch = collate_examples([ex], tok, {"image": type("E", (), {"num_rows": staticmethod(rows["image"]),
                                                                 "preprocess": staticmethod(lambda x: x),
                                                                 "collate": staticmethod(torch.stack)})()})
    assert ((batch.labels[0] != IGNORE).tolist()) == [False, *te.loss[1:]]
    # evaluation generates from exactly the tokens training put before the last answer
    last = len(te.seq.ids) - len(a2) - 1
    assert tokenize_prompt(tok, generation_prompt(tok, ex), ex.media, rows).ids == te.seq.ids[:last]


def test_multi_turn_loss_with_a_chat_template():
    """The template's own end-of-turn token is learned with each answer; a template that puts none
    after an answer gets EOS appended. Header text holding the answer's words is never learned."""
    tok = build_tokenizer(["red", "circle", "yes"])
    rows = {"image": lambda item: 2}
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }} yes|>\n{{ m['content'] }}"
                         "{% if m['role'] == 'assistant' %}</s>{% endif %}\n{% endfor %}")
    te = tokenize_example(tok, conversation(), rows)
    assert [tok.decode([i]) for i, learned in zip(te.seq.ids, te.loss) if learned] == [
        "red", " circle", "</s>", "yes", "</s>"]
    assert tok.decode([i for i, learned in zip(te.seq.ids, te.loss) if not learned]) == (
        "<|user yes|>\n<image><image> what?<|assistant yes|>\n<|user yes|>\nsure?<|assistant yes|>\n")
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    te = tokenize_example(tok, conversation(), rows)
    assert [tok.decode([i]) for i, learned in zip(te.seq.ids, te.loss) if learned] == [
        "red", " circle", "</s>", "yes", "</s>"]


#: ChatML as Qwen3 renders it: the last answer (only) after an empty think block
QWEN3_LIKE = """{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}<|im_start|>assistant
<think>

</think>

{{ m.content }}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}"""


def test_chatml_end_of_turn_is_learned_and_evaluation_sees_the_training_context():
    tok = build_tokenizer(["red", "circle", "yes"])
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    tok.chat_template = QWEN3_LIKE
    rows = {"image": lambda item: 2}
    turns = (Turn("system", "be brief"), Turn("user", "<image> what?"), Turn("assistant", "red circle"),
             Turn("user", "sure?"), Turn("assistant", "yes"))
    ex = conversation_example(turns, {"image": [torch.zeros(2, 4)]}, "{value}")
    te = tokenize_example(tok, ex, rows)
    assert [tok.decode([i]) for i, learned in zip(te.seq.ids, te.loss) if learned] == [
        "red", " circle", "<|im_end|>", "yes", "<|im_end|>"]
    prompt = generation_prompt(tok, ex)
    assert prompt.endswith("sure?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    last = len(te.seq.ids) - 2  # "yes" and <|im_end|>
    assert tokenize_prompt(tok, prompt, ex.media, rows).ids == te.seq.ids[:last]


TINY_BASE = {"name": "p", "seed": 0, "stage": "align", **tiny_graph_recipe_parts(),
             "train": {"batch_size": 4, "max_steps": 2, "lr": 1e-3, "progress": False, "device": "cpu"},
             "eval": {"enabled": False}}


@pytest.mark.parametrize("pack_length", [None, "longest"])
def test_packed_multi_turn_losses_equal_unpacked(tmp_path, pack_length):
    from bridge.training.trainer import Trainer

    trainer = Trainer(validate(apply_overrides(TINY_BASE, ["train.packing=true"])), tmp_path / "run")
    examples = []
    for i in range(5):
        ex = trainer.train_set[i]
        words = ex.target.split()
        turns = [Turn("user", "<graph> " + "x" * i), Turn("assistant", " ".join(words[:2]))]
        turns += [Turn("user", "and?"), Turn("assistant", " ".join(words[2:]) or "a")] * (i % 3)
        examples.append(conversation_example(tuple(turns), ex.media, "{value} ->"))
    padded = collate_examples(examples, trainer.tokenizer, trainer.encoders)
    packed = collate_examples(examples, trainer.tokenizer, trainer.encoders, pack=True,
                              pack_length=pack_length)
    assert packed.packed and len(set(padded.attention_mask.sum(1).tolist())) >= 4
    assert packed.target_counts == padded.target_counts and max(padded.target_counts) > 4
    model = trainer.model.eval()
    with torch.no_grad():
        want = torch.split(model.token_losses(padded), padded.target_counts)
        got = torch.split(model.token_losses(packed), packed.target_counts)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(packed), model(padded), rtol=0, atol=1e-5)


def test_a_long_conversation_loses_its_last_exchanges_to_fit(tmp_path):
    from bridge.training.fit_context import FitToContext

    tok = build_tokenizer(["red", "circle", "yes"])
    turns = (Turn("user", "<image> what?"), Turn("assistant", "red circle"),
             *[Turn("user", "more?"), Turn("assistant", "yes " * 10)] * 4)
    ex = conversation_example(turns, {"image": [torch.zeros(3, 4)]}, "{value}")
    rows = {"image": lambda item: 3}
    full = len(tokenize_example(tok, ex, rows).seq.ids)
    fitted = FitToContext([ex], tok, rows, context=full - 5)[0]
    assert len(fitted.turns) == 8 and len(tokenize_example(tok, fitted, rows).seq.ids) <= full - 5
    one = FitToContext([ex], tok, rows, context=11)[0]  # 12 tokens with the whole first answer
    assert len(one.turns) == 2 and one.target == "red" and len(tokenize_example(tok, one, rows).seq.ids) == 11


# ----------------------------------------------------------------------------- malformed rows
def test_malformed_llava_rows_exit_2_named_by_file_and_line(tmp_path, capsys):
    rows = llava_rows(tmp_path)
    rows[1]["conversations"][1]["from"] = "robot"
    rows[2]["image"] = "missing.png"
    (tmp_path / "llava.json").write_text(json.dumps(rows, indent=1))
    unanswered = {**rows[0], "conversations": rows[0]["conversations"][:1]}
    bad_jsonl = [json.dumps(rows[0]), "{not json", json.dumps(unanswered)]
    (tmp_path / "eval.jsonl").write_text("\n".join(bad_jsonl) + "\n")
    recipe = write_recipe(tmp_path, {"source": "llava", "train": "llava.json", "eval": "eval.jsonl"})
    out = tmp_path / "out"
    code, _, err = run(["train", str(recipe), "--output-dir", str(out), *QUICK], capsys)
    assert code == 2 and not out.exists() and "Traceback" not in err
    assert err.startswith("bridge: 4 problems found before training (nothing was written):"), err
    train, held_out = tmp_path / "llava.json", tmp_path / "eval.jsonl"
    second = json.dumps(rows, indent=1).split("\n").index(" {", 2) + 1  # the line row 1 starts on
    for line in (f"{train}:{second} (row 1): conversations[1]: 'from' is 'robot'; expected human or gpt",
                 f"(row 2): image file {tmp_path / 'missing.png'}: file not found",
                 f"{held_out}:2: not valid JSON",
                 f"{held_out}:3: the conversation must end with a gpt turn"):
        assert line in err, (line, err)


def test_malformed_hf_rows_and_shard_samples_are_named(tmp_path, capsys):
    import datasets

    ds = datasets.Dataset.from_dict({"image": [{"bytes": png("red"), "path": None}, None],
                                     "text": ["a red square", None]},
                                    features=datasets.Features({"image": datasets.Image(),
                                                                "text": datasets.Value("string")}))
    ds.to_parquet(str(tmp_path / "t.parquet"))
    recipe = write_recipe(tmp_path, {"source": "hf", "train": "t.parquet"})
    out = tmp_path / "out"
    code, _, err = run(["train", str(recipe), "--output-dir", str(out), *QUICK], capsys)
    assert code == 2 and not out.exists()
    assert f"{tmp_path / 't.parquet'}: row 1: the text column 'text' is null" in err, err
    code, _, err = run(["train", str(recipe), "--output-dir", str(out), *QUICK, "data.columns={image: img}"],
                       capsys)
    assert code == 2 and f"{tmp_path / 't.parquet'}: no column 'img' (data.columns.image)" in err, err

    write_shards(tmp_path, [[("k1.png", png("red")), ("k1.txt", b"a red square"), ("k2.png", png("red")),
                             ("k3.png", png("red")), ("k3.json", b"{\"caption\": 1}")]])
    recipe = write_recipe(tmp_path, {"source": "webdataset", "train": "train-00000.tar"})
    code, _, err = run(["train", str(recipe), "--output-dir", str(out), *QUICK], capsys)
    shard = tmp_path / "train-00000.tar"
    assert code == 2 and not out.exists()
    assert f"{shard}:k2: no text file (.txt or .json); its files: png" in err, err
    assert f"{shard}:k3: the .json has no string field 'text'" in err, err


def test_skip_bad_rows_trains_and_counts_them(tmp_path, capsys):
    """One row malformed (found before the run), one image that fails only when decoded (found while
    training): both skipped and counted in metrics.jsonl and the summary."""
    rows = llava_rows(tmp_path)
    raw = (tmp_path / "red.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(raw[: len(raw) // 2])  # a good header, damaged pixels
    rows[2]["image"] = "cut.png"
    lines = [json.dumps(rows[0]), "{broken", json.dumps(rows[2]), json.dumps(rows[1])]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    recipe = write_recipe(tmp_path, {"source": "llava", "train": "train.jsonl"})
    out = tmp_path / "out"
    code, _, err = run(["train", str(recipe), "--output-dir", str(out), *QUICK], capsys)
    assert code == 2 and f"{tmp_path / 'train.jsonl'}:2: not valid JSON" in err and not out.exists()

    code, stdout, err = run(["train", str(recipe), "--output-dir", str(out), *QUICK, "train.max_steps=3",
                             "data.skip_bad_rows=true"], capsys)
    assert code == 0, err
    assert "data.skip_bad_rows: 1 malformed row(s) will be skipped (train: 1); the first:" in err
    assert f"passing over a row that fails when read: {tmp_path / 'train.jsonl'}:3: image file" in err
    assert summary_of(stdout)["skipped_rows"] == 2
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 3 and metrics[-1]["skipped_rows"] == 2

    # a file that cannot be read is never skipped
    (tmp_path / "broken.json").write_text('[{"id": 1}, {"id": ')
    code, _, err = run(["train", str(recipe), "--output-dir", str(tmp_path / "o2"), *QUICK,
                        "data.skip_bad_rows=true", f"data.eval={tmp_path / 'broken.json'}"], capsys)
    assert code == 2 and "no row after it can be read" in err and not (tmp_path / "o2").exists()


def test_skip_bad_rows_still_refuses_a_corrupt_shard(tmp_path, capsys):
    write_shards(tmp_path, [[("k1.png", png("red")), ("k1.txt", b"a red square")]] * 2)
    data = (tmp_path / "train-00001.tar").read_bytes()
    (tmp_path / "train-00001.tar").write_bytes(data[:1000])  # cut inside the image
    recipe = write_recipe(tmp_path, {"source": "webdataset", "train": "train-{00000..00001}.tar",
                                     "skip_bad_rows": True})
    code, _, err = run(["train", str(recipe), "--output-dir", str(tmp_path / "out"), *QUICK], capsys)
    assert code == 2 and f"{tmp_path / 'train-00001.tar'}: not a readable tar file" in err, err


# ----------------------------------------------------------------------------- paths, recipe, extras
def test_brace_patterns_expand_in_order_and_name_missing_shards(tmp_path):
    for i in (0, 1, 2, 10):
        (tmp_path / f"s-{i:05d}.tar").write_bytes(b"")
    got = expand_data_paths(str(tmp_path / "s-{00000..00002}.tar"))
    assert got == [tmp_path / f"s-{i:05d}.tar" for i in (0, 1, 2)]
    assert expand_data_paths(str(tmp_path / "s-{00010,00001}.tar")) == [tmp_path / "s-00010.tar",
                                                                       tmp_path / "s-00001.tar"]
    assert len(expand_data_paths(str(tmp_path / "s-*.tar"))) == 4
    with pytest.raises(ValueError, match=r"not found: .*s-00003\.tar, .*s-00004\.tar"):
        expand_data_paths(str(tmp_path / "s-{00000..00004}.tar"))
    (tmp_path / "odd{1}.tar").write_bytes(b"")
    assert expand_data_paths(str(tmp_path / "odd{1}.tar")) == [tmp_path / "odd{1}.tar"]  # a real name

    base = {**TINY_BASE, "data": {"source": "webdataset", "train": str(tmp_path / "s-{00000..00003}.tar")}}
    with pytest.raises(RecipeError, match=r"data.train: not found: .*s-00003\.tar"):
        validate(base)
    base["data"] = {"source": "jsonl", "train": str(tmp_path / "s-*.tar")}
    with pytest.raises(RecipeError, match="patterns are for data.source hf and webdataset"):
        validate(base)


def test_recipe_keys_for_the_sources(tmp_path):
    (tmp_path / "d.json").write_text("[]")
    recipe = write_recipe(tmp_path, {"source": "llava", "train": "d.json"})
    assert load_recipe(recipe).data.prompt == "{value}"  # llava's default turn format
    with pytest.raises(RecipeError) as info:
        load_recipe(recipe, ["data.prompt='USER: <image> {value} {x}'", "data.columns={img: a}"])
    text = str(info.value)
    assert "data.prompt: the turn format" in text and "leave them out of the format" in text
    assert "data.columns: unknown role 'img' (did you mean 'image'?)" in text
    assert "data.columns: only data.source hf and webdataset read columns" in text
    old = load_recipe(recipe).to_dict()
    del old["data"]["columns"], old["data"]["skip_bad_rows"]  # a recipe saved before the keys existed
    assert recipe_changes(old, load_recipe(recipe).to_dict()) == []


def test_a_missing_extra_is_named(tmp_path, monkeypatch):
    from bridge.data.hf import HFDataset
    from bridge.data.paths import expand_braces

    monkeypatch.setitem(sys.modules, "datasets", None)
    monkeypatch.setitem(sys.modules, "braceexpand", None)
    (tmp_path / "x.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"needs the datasets package \(the data extra: pip install -e"):
        HFDataset(str(tmp_path / "x.parquet"))
    with pytest.raises(ValueError, match=r"braceexpand package \(the data extra"):
        expand_braces("a-{0..2}")
