"""Sequence packing, the fused LM head + cross-entropy, and the per-layer options (activation
checkpointing) on tiny models: a packed batch's per-sample losses are the unpacked ones, the fused
loss and its gradients are the plain path's, checkpointing changes no number."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import tiny_graph_recipe_parts

from bridge.data.example import Example
from bridge.recipe import RecipeError, apply_overrides, validate
from bridge.training.batching import collate_examples
from bridge.training.loss_head import fused_linear_cross_entropy, plain_linear_cross_entropy
from bridge.training.packing import LONGEST, packed_layout
from bridge.training.trainer import Trainer

BASE = {
    "name": "p",
    "seed": 0,
    "stage": "align",
    **tiny_graph_recipe_parts(),
    "train": {"batch_size": 6, "max_steps": 2, "lr": 1e-3, "progress": False, "device": "cpu"},
    "eval": {"enabled": False},
}


def recipe(*overrides: str):
    return validate(apply_overrides(BASE, list(overrides)))


def test_first_fit_decreasing_fills_rows_without_overlap():
    lengths = [5, 3, 7, 2, 4, 1]
    layout = packed_layout(lengths, 8)
    assert layout.num_rows == 3  # 22 tokens need three rows of 8
    spans = {}
    for i, n in enumerate(lengths):
        spans.setdefault(layout.row_of[i], []).append((layout.offset_of[i], n))
    for row in spans.values():
        row.sort()
        assert row[0][0] == 0 and row[-1][0] + row[-1][1] <= 8
        assert all(a + n == b for (a, n), (b, _) in zip(row, row[1:]))  # contiguous, no gap
    one_row = packed_layout(lengths, None)
    assert one_row.num_rows == 1 and one_row.row_length == sum(lengths)
    assert packed_layout(lengths, LONGEST).row_length <= 7
    with pytest.raises(ValueError, match="train.pack_length=6"):
        packed_layout(lengths, 6)


def _split(losses: torch.Tensor, counts: list[int]) -> list[torch.Tensor]:
    return list(torch.split(losses, counts))


def _varied(trainer, n: int = 6) -> list[Example]:
    """Samples of different lengths: text before the graph's rows, targets of 2 to 5 words."""
    out = []
    for i in range(n):
        ex = trainer.train_set[i]
        words = ex.target.split()[: 2 + i % 4]
        out.append(dataclasses.replace(ex, prompt="x" * (3 * i) + ex.prompt, target=" ".join(words)))
    return out


@pytest.mark.parametrize("pack_length", [None, 24, LONGEST])
def test_packed_per_sample_losses_equal_unpacked(tmp_path, pack_length):
    trainer = Trainer(recipe("train.packing=true"), tmp_path / "run")
    assert trainer.model.attention_mode == "sdpa" and trainer.collate_options["pack"]
    examples = _varied(trainer)
    padded = collate_examples(examples, trainer.tokenizer, trainer.encoders)
    packed = collate_examples(
        examples, trainer.tokenizer, trainer.encoders, pack=True, pack_length=pack_length
    )
    assert packed.packed and not padded.packed
    assert len(set(padded.attention_mask.sum(1).tolist())) >= 5  # lengths differ
    assert packed.input_ids.numel() <= padded.input_ids.numel()
    if pack_length is None:
        assert packed.input_ids.shape[0] == 1 and not (packed.segment_ids < 0).any()  # no padding
    model = trainer.model.eval()
    with torch.no_grad():
        want = _split(model.token_losses(padded), padded.target_counts)
        got = _split(model.token_losses(packed), packed.target_counts)
        assert [len(x) for x in got] == [len(x) for x in want]
        for a, b in zip(got, want):
            torch.testing.assert_close(a.mean(), b.mean(), rtol=0, atol=1e-5)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(packed), model(padded), rtol=0, atol=1e-5)


def test_packed_training_steps_match_unpacked(tmp_path):
    """Whole optimizer steps (grad clipping, AdamW) on packed batches follow the padded run."""
    padded = Trainer(recipe("train.packing=false", "train.max_steps=3"), tmp_path / "a")
    packed = Trainer(
        recipe("train.packing=true", "train.pack_length=40", "train.max_steps=3"), tmp_path / "b"
    )
    for _ in range(3):
        assert packed.train_step() == pytest.approx(padded.train_step(), abs=1e-5)


def test_fused_loss_and_gradients_equal_the_plain_head():
    torch.manual_seed(0)
    n, hidden, vocab = 37, 16, 50
    h = torch.randn(n, hidden, dtype=torch.float64).float()
    weight = torch.randn(vocab, hidden) * 0.3
    bias = torch.randn(vocab) * 0.1
    targets = torch.randint(0, vocab, (n,))
    token_weight = torch.rand(n)
    results = []
    for fn in (plain_linear_cross_entropy, lambda *a: fused_linear_cross_entropy(*a, chunk_rows=8)):
        args = [t.clone().requires_grad_(True) for t in (h, weight, bias)]
        loss = fn(*args, targets, token_weight)
        (loss * 1.7).backward()
        results.append((loss.detach(), *(a.grad for a in args)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a frozen head: gradients reach the hidden states only
    hh = h.clone().requires_grad_(True)
    fused_linear_cross_entropy(hh, weight, None, targets, token_weight, chunk_rows=5).backward()
    ref = h.clone().requires_grad_(True)
    plain_linear_cross_entropy(ref, weight, None, targets, token_weight).backward()
    torch.testing.assert_close(hh.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_model_loss_fused_equals_plain_with_gradients(tmp_path):
    trainer = Trainer(recipe("stage=finetune", "train.trainable.llm=true"), tmp_path / "run")
    model = trainer.model.eval()
    batch = trainer._micro_batch(0)
    grads = []
    for fused in (True, False):
        model.fused_loss = fused
        model.zero_grad(set_to_none=True)
        loss = model(batch)
        loss.backward()
        named = model.named_parameters()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in named if p.grad is not None}))
    (l1, g1), (l2, g2) = grads
    torch.testing.assert_close(l1, l2, rtol=1e-6, atol=1e-6)
    assert g1.keys() == g2.keys() and any("lm_head" in k for k in g1)
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_changes_no_number(tmp_path):
    plain = Trainer(recipe("stage=finetune", "train.trainable.llm=true"), tmp_path / "a")
    full = ("stage=finetune", "train.trainable.llm=true")
    ckpt = Trainer(recipe(*full, "train.activation_checkpointing=true"), tmp_path / "b")
    for _ in range(2):
        assert ckpt.train_step() == pytest.approx(plain.train_step(), abs=1e-6)
    for (name, a), b in zip(plain.llm.named_parameters(), ckpt.llm.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_packing_keys_are_validated():
    with pytest.raises(RecipeError, match="train.pack_length: must be >= 1"):
        recipe("train.pack_length=0")
    with pytest.raises(RecipeError, match="train.packing: expected bool or null"):
        recipe("train.packing=3")
    r = recipe()
    assert r.train.packing is None and r.train.pack_length is None
    assert r.train.activation_checkpointing is False and r.train.compile is None  # on on CUDA, off on CPU


def test_fsdp_on_one_rank_follows_the_plain_run(tmp_path):
    """train.distributed=fsdp outside torchrun: FSDP2 over a one-rank group, same steps as unwrapped."""
    full = ("stage=finetune", "train.trainable.llm=true", "train.max_steps=2")
    plain = Trainer(recipe(*full), tmp_path / "a")
    fsdp = ("train.distributed=fsdp", "train.activation_checkpointing=true")
    sharded = Trainer(recipe(*full, *fsdp), tmp_path / "b")
    assert plain.wrapper == "none" and sharded.wrapper == "fsdp" and sharded.dist.own_group
    for _ in range(2):
        assert sharded.train_step() == pytest.approx(plain.train_step(), abs=1e-5)
    sharded.save_checkpoint()
    from bridge.training.distributed import shutdown

    shutdown(sharded.dist)
