"""FSDP2 with `train.mixed_precision: bf16` (MixedPrecisionPolicy: bf16 params for compute, fp32
reduction): the policy really computes decoder layers in bf16 on fp32 shards with fp32 gradients,
and a 2-rank gloo run on the CPU trains with it (loss goes down) and saves an fp32 checkpoint."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from safetensors.torch import load_file
from test_distributed import RECIPE

from bridge.recipe import RecipeError, validate
from bridge.training.fsdp import mixed_precision_policy, shard_model

ROOT = Path(__file__).resolve().parents[1]


class _Toy(torch.nn.Module):
    """A root with two 'decoder layers' (`layers`, where decoder_layers looks) and a head."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def test_policy_computes_layers_in_bf16_on_fp32_shards_with_fp32_grads(tmp_path):
    assert mixed_precision_policy("none") is None
    policy = mixed_precision_policy("bf16")
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32,
                                                                               torch.float32)
    with pytest.raises(ValueError, match="train.mixed_precision: 'fp8' is not one of"):
        mixed_precision_policy("fp8")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        toy = _Toy()
        shard_model(toy, toy, torch.device("cpu"), 1, "bf16")
        seen = []  # hooks added after sharding run after FSDP's: they see what the layer computes with
        for layer in toy.layers:
            layer.register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
        loss = toy(torch.randn(4, 8)).pow(2).mean()
        assert loss.dtype == torch.float32  # the layers hand fp32 back to the root's head
        loss.backward()
        assert seen == [(torch.bfloat16, torch.bfloat16)] * 2  # weights and inputs in bf16
        for p in toy.parameters():  # the sharded weights the optimizer steps, and their grads: fp32
            assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_train_with_bf16_mixed_precision(tmp_path):
    recipe = copy.deepcopy(RECIPE)
    recipe["name"] = "fsdp-bf16"
    recipe["train"].update({"trainable": {"llm": True}, "schedule": "constant", "lr": 3e-3, "max_steps": 3,
                            "distributed": "fsdp", "mixed_precision": "bf16", "batch_size": 4})
    path, out = tmp_path / "r.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(recipe))
    proc = subprocess.run([sys.executable, "-m", "bridge", "train", str(path), "--output-dir", str(out),
                           "--nproc", "2"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and losses[-1] < losses[0]  # it trains
    ckpt = out / "checkpoints" / "step_3"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["wrapper"] == "fsdp" and meta["world_size"] == 2
    trained = load_file(str(ckpt / "llm_trainable.safetensors"))
    base = load_file(str(out / "base_model" / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in trained.values())  # fp32 master weights saved
    assert any(not base[k].equal(trained[k]) for k in base)


def test_mixed_precision_recipe_key():
    assert validate(RECIPE).train.mixed_precision == "none"
    with pytest.raises(RecipeError, match=r"train.mixed_precision: 'fp16' is not one of \['none', 'bf16'\]"):
        validate({**RECIPE, "train": {**RECIPE["train"], "mixed_precision": "fp16"}})
