"""The packed attention paths on CUDA in bf16: the varlen flash kernel (the default on CUDA) and
flex_attention against the block-diagonal mask in fp32, GQA included; whole packed training steps
against padded ones; torch.compile with activation checkpointing against eager."""

from __future__ import annotations

import pytest
import torch
from test_packing import _split, _varied, recipe

from bridge.training.batching import collate_examples
from bridge.training.packed_attention import (
    block_diagonal_mask,
    flex_block_mask,
    use_mode,
    varlen_attention_forward,
)
from bridge.training.packing import LONGEST
from bridge.training.trainer import Trainer

pytestmark = pytest.mark.gpu


class _Attn(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 4
    training = False


def _reference(q, k, v, segments):
    """fp32 SDPA with the block-diagonal mask, GQA by repeating k/v heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.float().repeat_interleave(groups, dim=1) for x in (k, v))
    mask = block_diagonal_mask(segments)
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask)
    return out.transpose(1, 2)


def test_varlen_and_flex_attention_match_the_block_mask_in_bf16():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    lengths = [[70, 130, 56], [200, 40, 16]]  # two rows of 256, the second with a padding tail
    rows, length, heads, kv_heads, dim = 2, 256, 8, 2, 64
    segments = torch.full((rows, length), -1, dtype=torch.long)
    bounds, sample = [0], 0
    for r, row in enumerate(lengths):
        off = 0
        for n in row:
            segments[r, off : off + n] = sample
            sample, off = sample + 1, off + n
            bounds.append(r * length + off)
        if off < length:
            bounds.append((r + 1) * length)
    segments = segments.to(dev)
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    q = torch.randn(rows, heads, length, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(rows, kv_heads, length, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(rows, kv_heads, length, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    want = _reference(q, k, v, segments)
    got, _ = varlen_attention_forward(
        _Attn(), q, k, v, None, scaling=dim**-0.5, cu_seq_lens_q=cu, max_length_q=200
    )
    real = segments >= 0
    torch.testing.assert_close(got.float()[real], want[real], rtol=2e-2, atol=2e-2)
    # gradients flow through the varlen kernel and match the reference's
    grad = torch.randn_like(want)
    g_got = torch.autograd.grad(got.float()[real], (q, k, v), grad[real])
    g_want = torch.autograd.grad(want[real], (q, k, v), grad[real])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)

    from torch.nn.attention.flex_attention import flex_attention

    block_mask = flex_block_mask(segments)
    flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(flex.float()[real], want[real], rtol=2e-2, atol=2e-2)


def _losses(trainer, batch):
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        return _split(trainer.model.token_losses(batch.to(trainer.device)), batch.target_counts)


@pytest.mark.parametrize("mode", ["varlen", "flex"])
def test_packed_losses_match_padded_on_cuda_bf16(tmp_path, mode):
    trainer = Trainer(recipe("train.device=cuda", "train.precision=bf16"), tmp_path / "run")
    assert trainer.model.attention_mode == "varlen"
    assert trainer.collate_options == {"pack": True, "pack_length": None}
    trainer.model.eval()
    examples = _varied(trainer)
    padded = collate_examples(examples, trainer.tokenizer, trainer.encoders)
    want = _losses(trainer, padded)  # a padded batch through the same model: causal SDPA
    use_mode(trainer.llm, mode)
    trainer.model.attention_mode = mode
    length = None if mode == "varlen" else LONGEST
    packed = collate_examples(examples, trainer.tokenizer, trainer.encoders, pack=True, pack_length=length)
    got = _losses(trainer, packed)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=3e-2)


def test_packed_training_on_cuda_follows_padded(tmp_path):
    common = ["train.device=cuda", "train.precision=bf16", "train.max_steps=4"]
    padded = Trainer(recipe(*common, "train.packing=false"), tmp_path / "a")
    packed = Trainer(recipe(*common), tmp_path / "b")
    assert packed.collate_options["pack"] and not padded.collate_options
    for _ in range(4):
        assert packed.train_step() == pytest.approx(padded.train_step(), rel=2e-2, abs=2e-2)
    packed.close_data()
    padded.close_data()


def test_compile_and_activation_checkpointing_follow_eager(tmp_path):
    common = ["train.device=cuda", "train.precision=bf16", "train.max_steps=3", "stage=finetune",
              "train.trainable.llm=true"]
    eager = Trainer(recipe(*common), tmp_path / "a")
    fast_keys = ("train.compile=true", "train.activation_checkpointing=true")
    fast = Trainer(recipe(*common, *fast_keys), tmp_path / "b")
    for _ in range(3):
        assert fast.train_step() == pytest.approx(eager.train_step(), rel=2e-2, abs=2e-2)
    fast.close_data()
    eager.close_data()
