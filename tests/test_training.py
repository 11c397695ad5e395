"""Trainer pieces and short real runs on the tiny graph recipe (the cheapest encoder on a CPU):
stages and freezing, LoRA, schedule, grad accumulation, data order, outputs, atomic checkpoints
and resume (a process killed mid-save)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_graph_recipe_parts

from bridge.recipe import apply_overrides, validate
from bridge.training import checkpoint as ckpt_io
from bridge.training.lora import LoRALinear, apply_lora, merge_lora
from bridge.training.sampler import ResumableSampler
from bridge.training.schedule import lr_multiplier
from bridge.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "name": "t",
    "seed": 0,
    "stage": "align",
    **tiny_graph_recipe_parts(),
    "train": {
        "batch_size": 4,
        "max_steps": 3,
        "lr": 1e-3,
        "log_every": 1,
        "progress": False,
        "device": "cpu",
    },
    "eval": {"enabled": False, "num_items": 8, "max_tokens": 6},
}


def recipe(*overrides: str):
    return validate(apply_overrides(BASE, list(overrides)))


# ----------------------------------------------------------------------------- pure pieces


def test_lora_starts_as_identity_and_merges_exactly():
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"q_proj": torch.nn.Linear(8, 6), "o": torch.nn.Linear(6, 3)})
    x = torch.randn(5, 8)
    before = model["o"](model["q_proj"](x))
    assert apply_lora(model, ["q_proj"], rank=2, alpha=4.0) == ["q_proj"]
    assert isinstance(model["q_proj"], LoRALinear)
    assert torch.allclose(model["o"](model["q_proj"](x)), before)
    with torch.no_grad():
        model["q_proj"].lora_b.normal_()
    adapted = model["o"](model["q_proj"](x))
    assert not torch.allclose(adapted, before)
    assert merge_lora(model) == 1 and isinstance(model["q_proj"], torch.nn.Linear)
    assert torch.allclose(model["o"](model["q_proj"](x)), adapted, atol=1e-5)
    with pytest.raises(ValueError, match="match no linear layer"):
        apply_lora(model, ["nope"], rank=2, alpha=4.0)


def test_schedule_warmup_then_cosine_and_linear():
    kw = dict(warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_multiplier(s, kind="cosine", **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_multiplier(9, kind="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(14, kind="cosine", **kw) == pytest.approx(0.1)
    assert lr_multiplier(9, kind="linear", **kw) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(9, kind="constant", **kw) == 1.0


def test_sampler_ranks_partition_the_global_batch_and_epochs_reshuffle():
    one = ResumableSampler(10, 4, seed=3)
    r0 = ResumableSampler(10, 2, seed=3, rank=0, world_size=2)
    r1 = ResumableSampler(10, 2, seed=3, rank=1, world_size=2)
    for step in range(6):
        assert one.micro_batch(step) == r0.micro_batch(step) + r1.micro_batch(step)
    first_epoch = [i for s in range(5) for i in ResumableSampler(10, 2, seed=3).micro_batch(s)]
    second_epoch = [i for s in range(5, 10) for i in ResumableSampler(10, 2, seed=3).micro_batch(s)]
    assert sorted(first_epoch) == list(range(10)) == sorted(second_epoch)
    assert first_epoch != second_epoch


# ----------------------------------------------------------------------------- real runs


def _params(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_align_stage_trains_projector_only(tmp_path):
    t = Trainer(recipe(), tmp_path)
    enc = t.encoders["graph"]
    tower0, proj0, llm0 = _params(enc.tower), _params(enc.projector), _params(t.llm)
    assert t.trainable_counts()["llm"] == 0 and t.trainable_counts()["tower"] == 0
    t.run()
    assert all(torch.equal(tower0[n], p) for n, p in enc.tower.named_parameters())
    assert all(torch.equal(llm0[n], p) for n, p in t.llm.named_parameters())
    assert any(not torch.equal(proj0[n], p) for n, p in enc.projector.named_parameters())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all({"loss", "lr"} <= set(r) for r in rows)
    assert (tmp_path / "loss.png").stat().st_size > 1000
    meta = ckpt_io.read_meta(tmp_path / "checkpoints" / "step_3")
    assert meta["llm_dir"] == str((tmp_path / "base_model").resolve())  # frozen LLM: no copy
    assert not (tmp_path / "checkpoints" / "step_3" / "llm").exists()


def test_finetune_lora_trains_adapters_and_saves_merged_llm(tmp_path):
    from bridge.training.lora import LoRALinear

    t = Trainer(recipe("stage=finetune", "train.lora.rank=2"), tmp_path)
    lora_layers = [m for m in t.llm.modules() if isinstance(m, LoRALinear)]
    assert lora_layers and all(
        n.endswith(("lora_a", "lora_b")) for n, p in t.llm.named_parameters() if p.requires_grad
    )
    t.run()
    ckpt = tmp_path / "checkpoints" / "step_3"
    assert ckpt_io.read_meta(ckpt)["llm_dir"] == "llm"
    # the merged HF dir computes what the LoRA-wrapped model computes
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(ckpt / "llm")
    ids = torch.tensor([[1, 9, 10, 11]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, t.llm(ids).logits, atol=1e-5)


def test_grad_accumulation_matches_the_bigger_batch(tmp_path):
    big = Trainer(recipe("train.batch_size=8", "train.max_steps=1"), tmp_path / "big")
    acc = Trainer(
        recipe("train.batch_size=4", "train.grad_accum_steps=2", "train.max_steps=1"), tmp_path / "acc"
    )
    assert big.train_step() == pytest.approx(acc.train_step(), abs=1e-6)
    for (n, p), (_, q) in zip(big.model.encoders.named_parameters(), acc.model.encoders.named_parameters()):
        assert torch.allclose(p, q, atol=1e-6), n


def test_bf16_precision_runs(tmp_path):
    t = Trainer(recipe("train.precision=bf16", "train.max_steps=2"), tmp_path)
    assert t.run()["steps"] == 2
    assert all(p.dtype == torch.float32 for p in t.model.encoders.parameters())


def test_eval_json_through_runner(tmp_path):
    summary = Trainer(recipe("eval.enabled=true", "train.max_steps=1", "eval.batch_invariant=true"),
                      tmp_path).run()
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["n"] == 8 and 0.0 <= report["exact_match"] <= 1.0
    assert report == {**summary["eval"]} and len(report["samples"]) == 8
    assert {"prompt", "target", "output", "match"} <= set(report["samples"][0])
    # the engine settings the generations depend on, batch invariance first
    engine = report["engine"]
    assert engine["batch_invariant"] is True and engine["dtype"] == "float32" and engine["device"] == "cpu"
    assert {"max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching", "fused_layers"} <= set(engine)


#: `bridge train` in a child whose checkpoint writer stops after the fill of step 4 (a kill lands mid-save)
_SLOW_SAVE_CHILD = """
import sys, time
import bridge.training.checkpoint as ckpt_io
from bridge.cli import main
original = ckpt_io.write_checkpoint
def slow(output_dir, step, fill, keep=0):
    def fill_then_wait(tmp):
        meta = fill(tmp)
        if step == 4:
            time.sleep(60)
        return meta
    return original(output_dir, step, fill_then_wait, keep)
ckpt_io.write_checkpoint = slow
sys.exit(main(sys.argv[1:]))
"""


def _run_cli(out: Path, *overrides: str, slow_save: bool = False) -> subprocess.Popen:
    recipe_path = out.parent / "r.yaml"
    import yaml

    recipe_path.write_text(yaml.safe_dump(BASE))
    entry = ["-c", _SLOW_SAVE_CHILD] if slow_save else ["-m", "bridge"]
    return subprocess.Popen(
        [sys.executable, *entry, "train", str(recipe_path), "--output-dir", str(out), *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


def test_kill_during_save_keeps_previous_checkpoint_and_resume_matches(tmp_path):
    steps = ["train.max_steps=6", "train.checkpoint_every=2", "stage=finetune"]
    # uninterrupted reference
    ref = Trainer(recipe(*steps), tmp_path / "ref")
    ref.run()
    ref_rows = {
        r["step"]: r for r in map(json.loads, (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines())
    }

    out = tmp_path / "run"
    proc = _run_cli(out, *steps, slow_save=True)
    tmp_dir = out / "checkpoints" / f".tmp-step_4-{proc.pid}"
    deadline = time.time() + 50
    while not (tmp_dir / "encoder").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert (tmp_dir / "encoder").exists(), proc.communicate()[0].decode()[-2000:]
    proc.send_signal(signal.SIGKILL)  # mid-save: encoder written, no meta, not renamed
    proc.wait()
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_2"]
    assert ckpt_io.latest_checkpoint(out).name == "step_2"

    from bridge.api import Bridge  # the surviving checkpoint loads and generates

    bridge = Bridge.from_checkpoint(out, device="cpu")
    graph = {"num_nodes": 4, "edges": [[0, 1], [1, 2], [2, 3]]}
    assert bridge.build_requests([{"text": "<graph>", "graph": graph}])[0]["prompt_embeds"].shape[1] == 32

    resumed = Trainer(recipe(*steps), out)
    assert resumed.step == 2 and resumed.resumed_from.name == "step_2"
    resumed.run()
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):  # same data order, same LR, same weights -> same losses
        assert rows[step]["loss"] == pytest.approx(ref_rows[step]["loss"], abs=1e-4)
        assert rows[step]["lr"] == pytest.approx(ref_rows[step]["lr"])
    assert [p.name for p in ckpt_io.list_checkpoints(out)] == ["step_2", "step_4", "step_6"]


def test_tower_output_cache_matches_uncached_and_skips_the_tower_on_repeats(tmp_path):
    steps = ["data.num_train=8", "train.max_steps=4"]  # batch 4: two epochs of the 8 items
    plain = Trainer(recipe(*steps), tmp_path / "plain")
    cached = Trainer(recipe(*steps, "train.cache_tower_outputs=true"), tmp_path / "cached")
    calls = []
    cached.encoders["graph"].tower.register_forward_hook(lambda mod, inp, out: calls.append(1))
    for _ in range(4):
        assert plain.train_step() == pytest.approx(cached.train_step(), abs=1e-6)
    assert len(calls) == 2  # epoch 1 only: 2 batches of new items; epoch 2 is all cached
    assert len(cached.model.tower_cache) == 8
    with pytest.raises(ValueError, match="frozen, non-streaming tower"):
        Trainer(recipe("train.cache_tower_outputs=true", "train.trainable.tower=true"), tmp_path / "bad")


def test_step_indices_from_the_collate_give_the_reference_embeds_and_loss(tmp_path):
    """The sync-free step (index tensors built on the CPU) equals the straightforward reference:
    rows placed where is_token is False (scatter_rows) and per-sample mean cross-entropy from the
    full LM head (`llm(inputs_embeds, labels)`), averaged over samples."""
    from bridge.data.prompt_embeds import ordered_rows, scatter_rows
    from bridge.training.batching import IGNORE

    trainer = Trainer(recipe("train.batch_size=5"), tmp_path / "run")
    batch = trainer._micro_batch(0)
    b, length = batch.input_ids.shape
    flat_is_token = batch.is_token.reshape(-1)
    assert torch.equal(batch.row_slots, (~flat_is_token).nonzero().squeeze(1))
    shifted = batch.labels[:, 1:]
    where = shifted != IGNORE
    expected_pos = (torch.arange(b)[:, None] * length + torch.arange(length - 1)[None, :])[where]
    assert torch.equal(batch.target_pos, expected_pos)
    assert torch.equal(batch.target_ids, shifted[where])
    assert float(batch.target_weight.sum()) == pytest.approx(1.0)

    model = trainer.model.eval()
    with torch.no_grad():
        embeds = model.input_embeds(batch)
        token_embeds = trainer.llm.get_input_embeddings()(batch.input_ids.masked_fill(~batch.is_token, 0))
        rows = ordered_rows(batch.prompts, {"graph": model.encoder_rows("graph", batch)}, batch.first_item)
        torch.testing.assert_close(embeds, scatter_rows(token_embeds, batch.is_token, rows))
        loss = model(batch)
        per_sample = []
        for i in range(b):
            n = int(batch.attention_mask[i].sum())
            out = trainer.llm(inputs_embeds=embeds[i : i + 1, :n], labels=batch.labels[i : i + 1, :n])
            per_sample.append(out.loss)
        torch.testing.assert_close(loss, torch.stack(per_sample).mean())


# ----------------------------------------------------------------------------- loader workers


def _batch_fields(batch) -> list:
    """Everything a TrainBatch carries, comparable with ==/torch.equal (tensors as tensors)."""
    return [
        *(getattr(batch, n) for n in batch.TENSOR_FIELDS),
        *batch.tensors(),
        [
            (p.ids, p.is_token, [(s.modality, s.item_index, s.start, s.length) for s in p.spans])
            for p in batch.prompts
        ],
        batch.first_item,
        batch.num_items,
        batch.item_keys,
        batch.new_keys,
    ]


def _same_batches(a, b) -> None:
    fa, fb = _batch_fields(a), _batch_fields(b)
    assert len(fa) == len(fb)
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert x == y


def test_loader_workers_give_the_same_batches_and_losses(tmp_path):
    """train.num_workers=2 (forked DataLoader workers, batches built ahead) gives exactly the
    micro-batches and losses of num_workers=0 (built in the process): 12 micro-batches of 8 from
    36 items, so epoch boundaries fall inside micro-batches, with grad accumulation."""
    from bridge.training.loader import BatchStream, MicroBatchBuilder

    common = ["train.batch_size=8", "train.grad_accum_steps=2", "train.max_steps=6", "data.num_train=36"]
    inline = Trainer(recipe(*common, "train.num_workers=0"), tmp_path / "w0")
    workers = Trainer(recipe(*common, "train.num_workers=2"), tmp_path / "w2")
    assert (inline.num_workers, workers.num_workers) == (0, 2)

    def stream(t, n):
        b = MicroBatchBuilder(t.train_set, t.tokenizer, t.encoders, t.sampler, start=0)
        return BatchStream(b, 0, 12, t.device, num_workers=n)

    s0, s2 = stream(inline, 0), stream(workers, 2)
    assert s2.num_workers == 2  # really in workers, no fallback
    try:
        for _ in range(12):
            _same_batches(s0.next(), s2.next())
            s0.prefetch()
            s2.prefetch()
    finally:
        s2.close()
    for _ in range(6):
        assert inline.train_step() == workers.train_step()
    assert workers._batches.num_workers == 2 and workers._batches.rebuilt == 0
    assert workers.timing.steps == 6 and 0 <= workers.timing.data_wait_s <= workers.timing.step_s
    for p, q in zip(inline.model.encoders.parameters(), workers.model.encoders.parameters()):
        assert torch.equal(p, q)
    workers.close_data()


def test_tower_output_cache_with_loader_workers(tmp_path):
    """Workers cannot see the training process's tower cache; they replay the data order to know
    which items it holds, so repeat epochs still skip preprocessing and the tower, and the losses
    are those of the uncached in-process run. A new stream (after close_data, or when the step
    counter moves, as on resume) starts from the cache as it is."""
    steps = ["data.num_train=8", "train.max_steps=7"]  # batch 4: 3.5 epochs of the 8 items
    plain = Trainer(recipe(*steps), tmp_path / "plain")
    cached = Trainer(
        recipe(*steps, "train.cache_tower_outputs=true", "train.num_workers=2"), tmp_path / "cached"
    )
    calls = []
    cached.encoders["graph"].tower.register_forward_hook(lambda mod, inp, out: calls.append(1))
    for _ in range(4):
        assert plain.train_step() == pytest.approx(cached.train_step(), abs=1e-6)
    stream = cached._batches
    assert stream.num_workers == 2 and stream.rebuilt == 0
    assert len(calls) == 2  # epoch 1 only
    assert len(cached.model.tower_cache) == 8
    cached.close_data()
    for _ in range(2):
        assert plain.train_step() == pytest.approx(cached.train_step(), abs=1e-6)
    fresh = cached._batches
    assert fresh is not stream and fresh.num_workers == 2 and fresh.rebuilt == 0 and len(calls) == 2
    # a cache emptied behind the stream's back: the next batch, built by a worker that believes
    # its items cached, is rebuilt in the process at the point of use (the tower runs again)
    cached.model.tower_cache.clear()
    assert plain.train_step() == pytest.approx(cached.train_step(), abs=1e-6)
    assert fresh.rebuilt == 1 and len(calls) == 3
    cached.close_data()


def test_loader_falls_back_in_process_when_a_batch_cannot_leave_a_worker(tmp_path):
    """A collate that returns something unpicklable cannot come back from a worker: one line says
    so and the batches are built in the training process, the same batches."""
    from bridge.training.loader import BatchStream, MicroBatchBuilder

    t = Trainer(recipe(), tmp_path / "run")
    enc = t.encoders["graph"]
    collate = enc.collate
    enc.collate = lambda items: {**collate(items), "hook": lambda: None}  # a lambda: unpicklable
    said = []
    b = MicroBatchBuilder(t.train_set, t.tokenizer, t.encoders, t.sampler, start=0)
    s = BatchStream(b, 0, 3, t.device, num_workers=2, say=said.append)
    assert s.num_workers == 0 and len(said) == 1
    assert "cannot be sent from a worker process" in said[0] and "training process" in said[0]
    for m in range(3):
        got = s.next()
        _same_batches(got, t._micro_batch(m))
        s.prefetch()


class _BadItem:
    """A training set whose item `bad` cannot be read (as a corrupt JSONL image)."""

    def __init__(self, inner, bad: int):
        self.inner, self.bad = inner, bad

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"train.jsonl:{i + 1}: image file x.png: cannot decode the image")
        return self.inner[i]


def test_a_data_error_in_a_worker_is_raised_as_in_process(tmp_path):
    """A bad item met by a worker stops the workers and is raised with the in-process error's own
    type and message (not the worker's wrapped traceback); the batches before it came from the
    workers, in order."""
    from bridge.training.loader import BatchStream, MicroBatchBuilder

    t = Trainer(recipe("train.batch_size=4"), tmp_path / "run")
    bad = t.sampler.micro_batch(3)[1]  # an item of micro-batch 3
    data = _BadItem(t.train_set, bad)
    said = []
    b = MicroBatchBuilder(data, t.tokenizer, t.encoders, t.sampler, start=0)
    s = BatchStream(b, 0, 8, t.device, num_workers=2, say=said.append)
    assert s.num_workers == 2
    for m in range(3):
        _same_batches(s.next(), t._micro_batch(m))
    with pytest.raises(ValueError) as info:
        s.next()
    assert str(info.value) == f"train.jsonl:{bad + 1}: image file x.png: cannot decode the image"
    assert s.num_workers == 0 and len(said) == 1 and "worker failed on micro-batch 3" in said[0]
    s.close()


@pytest.mark.gpu
def test_loader_workers_and_side_stream_copies_on_cuda(tmp_path):
    """On CUDA: pinned batches from forked workers, copied on a side stream, give the losses of
    in-process batches (with grad accumulation, and with the tower cache on repeat epochs), and
    the step records its data wait."""
    common = ["train.device=cuda", "train.max_steps=6", "train.grad_accum_steps=2", "data.num_train=16"]
    for extra in ([], ["train.cache_tower_outputs=true"]):
        name = "cached" if extra else "plain"
        inline = Trainer(recipe(*common, *extra, "train.num_workers=0"), tmp_path / f"{name}0")
        workers = Trainer(recipe(*common, *extra, "train.num_workers=2"), tmp_path / f"{name}2")
        for _ in range(6):
            assert inline.train_step() == pytest.approx(workers.train_step(), abs=1e-6)
        stream = workers._batches
        assert stream.num_workers == 2 and stream.rebuilt == 0
        assert workers.timing.steps == 6 and 0 <= workers.timing.data_wait_s <= workers.timing.step_s
        workers.close_data()
        inline.close_data()


def test_num_workers_default():
    from bridge.training.loader import default_num_workers

    assert default_num_workers(torch.device("cpu")) == 0
    assert 0 <= default_num_workers(torch.device("cuda")) <= 4
    assert recipe().train.num_workers is None and recipe().train.prefetch_factor == 2
