"""Training-step throughput (samples/s): Bridge's trainer vs a plain Hugging Face loop, same run.

Workload (the vision align recipe): open_clip ViT-B-32 tower (random init, frozen) -> 2-layer MLP
projector (trained) -> a Qwen3-0.6B-shaped LLM (random bf16 weights from the tiny-model kit:
hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, vocab 151936; frozen), bf16 autocast,
AdamW on the projector. Synthetic shapes images (64x64, resized to 224 by open_clip's
preprocessing) and their captions, prompt "<image>\\nDescribe the image.", batch 32.

The baseline is what one writes by hand with transformers: encoder rows and token embeddings
concatenated into `inputs_embeds`, `model(inputs_embeds=..., attention_mask=..., labels=...)`,
backward, step. Both loops include their data preparation (drawing, preprocessing, tokenizing)
in the timed region, see the same examples and use the same optimizer (AdamW, fused on CUDA,
same betas / weight decay / grad clip). The three contenders are timed in interleaved rounds
with the order rotated each round (median reported), so none gains from running first or last;
the host time spent building batches is reported per contender.

    python3 benchmarks/train_throughput.py             # GPU, < 5 min (builds a 0.6B model dir first)
    python3 benchmarks/train_throughput.py --small --device cpu --steps 2 --rounds 2   # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

# The same Qwen3-0.6B shape as the engine benchmark (one definition for all benchmarks).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import QWEN3_06B  # noqa: E402

SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
PROMPT = "<image>\nDescribe the image."


def recipe_dict(model_dir: Path, args) -> dict:
    tower = {"name": "open_clip", "arch": "bridge-tiny-vit" if args.small else "ViT-B-32"}
    return {
        "name": "train-throughput",
        "seed": 0,
        "stage": "align",
        "model": {"path": str(model_dir), "dtype": "bfloat16"},
        "encoder": {"modality": "image", "tower": tower, "projector": {"name": "mlp", "num_layers": 2}},
        "data": {
            "source": "shapes",
            "prompt": PROMPT,
            "num_train": 100000,
            "num_eval": 10,
            "options": {"image_size": 32 if args.small else 64},
        },
        "train": {
            "batch_size": args.batch,
            "max_steps": 10**6,
            "lr": 1e-3,
            "precision": "bf16",
            "device": args.device,
            "progress": False,
            "resume": False,
            "grad_clip": 1.0,
        },
        "eval": {"enabled": False},
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PrepTimer:
    """Host time spent building batches (drawing, preprocessing, tokenizing, collating, copying
    in): pure CPU work, so perf_counter around it needs no device sync."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def make_bridge(recipe, out_dir: Path, args):
    """Bridge's trainer; returns (step function, prep timer, optimizer description)."""
    from bridge.training.trainer import Trainer

    trainer = Trainer(recipe, out_dir)
    timer = PrepTimer()
    trainer._micro_batch = timer.wrap(trainer._micro_batch)
    opt = f"AdamW fused={getattr(trainer, 'fused_optimizer', False)}"
    return (lambda i: trainer.train_step()), timer, opt


def make_plain_hf(recipe, model_dir: Path, args):
    """The hand-written baseline: inputs_embeds + labels into the HF model. Same examples, same
    encoder, same optimizer settings as the trainer (AdamW, fused on CUDA, weight decay 0,
    grad clip 1.0), so only the step's design differs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bridge.data.sources import build_datasets
    from bridge.training.sampler import ResumableSampler
    from encoders.api import build_encoder

    device = torch.device(args.device)
    tok = AutoTokenizer.from_pretrained(model_dir)
    llm = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).requires_grad_(False)
    )
    torch.manual_seed(0)
    enc = build_encoder({**recipe.encoder, "llm_hidden_size": llm.config.hidden_size}).to(device)
    enc.set_trainable(tower=False, projector=True)
    fused = device.type == "cuda"
    tr = recipe.train
    opt = torch.optim.AdamW(
        [p for p in enc.parameters() if p.requires_grad],
        lr=tr.lr,
        betas=tuple(tr.betas),
        weight_decay=tr.weight_decay,
        **({"fused": True} if fused else {}),
    )
    train, _ = build_datasets(recipe.data, recipe.seed)
    sampler = ResumableSampler(len(train), args.batch, seed=recipe.seed)
    embed = llm.get_input_embeddings()
    before, after = PROMPT.split("<image>")
    pre_ids = tok(before, add_special_tokens=True, return_tensors="pt").input_ids[0].to(device)
    post_ids = tok(after, add_special_tokens=False, return_tensors="pt").input_ids[0].to(device)
    timer = PrepTimer()

    @timer.wrap
    def prepare(i: int):
        examples = [train[j] for j in sampler.micro_batch(i)]
        return examples, enc.collate([enc.preprocess(ex.media["image"][0]) for ex in examples])

    def step(i: int) -> float:
        examples, batch = prepare(i)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            rows = enc(batch)
            seqs, labels = [], []
            for ex, r in zip(examples, rows):
                target = torch.tensor(
                    tok(" " + ex.target, add_special_tokens=False).input_ids + [tok.eos_token_id],
                    device=device,
                )
                seq = torch.cat([embed(pre_ids), r.to(torch.bfloat16), embed(post_ids), embed(target)])
                n_prompt = len(pre_ids) + r.shape[0] + len(post_ids)
                seqs.append(seq)
                labels.append(torch.cat([torch.full((n_prompt,), -100, device=device), target]))
            longest = max(s.shape[0] for s in seqs)
            inputs = torch.zeros(len(seqs), longest, seqs[0].shape[1], dtype=seqs[0].dtype, device=device)
            lab = torch.full((len(seqs), longest), -100, dtype=torch.long, device=device)
            mask = torch.zeros(len(seqs), longest, dtype=torch.long, device=device)
            for k, (s, lb) in enumerate(zip(seqs, labels)):
                inputs[k, : s.shape[0]] = s
                lab[k, : s.shape[0]] = lb
                mask[k, : s.shape[0]] = 1
            loss = llm(inputs_embeds=inputs, attention_mask=mask, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in enc.parameters() if p.requires_grad], tr.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step, timer, f"AdamW fused={fused}"


def interleaved(contenders: dict, args, device: torch.device) -> dict:
    """Warm every contender up, then `rounds` rounds of `steps` timed steps each, the order
    rotated every round, so no contender is favoured by running first or last (clocks, caches,
    allocator state). Reports the median round per contender."""
    counters = {name: 0 for name in contenders}
    for name, c in contenders.items():
        for _ in range(args.warmup + c.get("extra_warmup", 0)):
            c["last_loss"] = c["step"](counters[name])
            counters[name] += 1
    rates = {name: [] for name in contenders}
    prep = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            c = contenders[name]
            sync(device)
            c["timer"].seconds = 0.0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                c["last_loss"] = c["step"](counters[name])
                counters[name] += 1
            sync(device)
            elapsed = time.perf_counter() - t0
            rates[name].append(args.steps * args.batch / elapsed)
            prep[name].append(c["timer"].seconds / args.steps * 1e3)
    out = {}
    for name in names:
        k = sorted(range(len(rates[name])), key=lambda j: rates[name][j])[len(rates[name]) // 2]
        out[name] = {
            "samples_per_s": rates[name][k],
            "all_rounds": [round(x, 1) for x in rates[name]],
            "ms_per_step": args.batch / rates[name][k] * 1e3,
            "prep_ms_per_step": prep[name][k],
            "last_loss": contenders[name]["last_loss"],
            "optimizer": contenders[name]["optimizer"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (median reported)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--small", action="store_true", help="tiny LLM + tiny ViT (smoke test)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    from bridge.recipe import validate
    from bridge.tiny_models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        shape = SMALL if args.small else QWEN3_06B
        model_dir = build_tiny_model(Path(tmp) / "llm", "qwen3", dtype=torch.bfloat16, **shape)
        print(
            f"built the {'small' if args.small else 'Qwen3-0.6B-shaped'} LLM dir "
            f"in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        recipe = validate(recipe_dict(model_dir, args))
        # repeated epochs with the frozen tower's outputs cached: a small train set, one epoch of
        # warm-up fills the cache, the timed steps are all repeat visits
        epoch_steps = 4
        cached_recipe = validate(
            recipe_dict(model_dir, args)
            | {"data": {**recipe_dict(model_dir, args)["data"], "num_train": epoch_steps * args.batch}}
        )
        cached_recipe.train["cache_tower_outputs"] = True
        contenders = {}
        for name, make in (
            ("bridge trainer", lambda: make_bridge(recipe, Path(tmp) / "run", args)),
            ("bridge + cache", lambda: make_bridge(cached_recipe, Path(tmp) / "run_cached", args)),
            ("plain HF loop", lambda: make_plain_hf(recipe, model_dir, args)),
        ):
            step, timer, opt = make()
            contenders[name] = {"step": step, "timer": timer, "optimizer": opt}
        contenders["bridge + cache"]["extra_warmup"] = epoch_steps
        device = torch.device(args.device)
        res = interleaved(contenders, args, device)
    notes = {
        "bridge + cache": "frozen tower outputs cached, repeat epochs",
        "plain HF loop": "inputs_embeds + labels, full-vocab logits",
    }
    for name, r in res.items():
        print(
            f"{name:15s}: {r['samples_per_s']:8.1f} samples/s  {r['ms_per_step']:7.1f} ms/step "
            f"(host data prep {r['prep_ms_per_step']:6.1f} ms/step; rounds {r['all_rounds']}; "
            f"{r['optimizer']}; last loss {r['last_loss']:.3f}) {notes.get(name, '')}",
            flush=True,
        )
    bridge_rate = res["bridge trainer"]["samples_per_s"]
    cached_rate = res["bridge + cache"]["samples_per_s"]
    hf_rate = res["plain HF loop"]["samples_per_s"]
    ratio = bridge_rate / hf_rate
    print(
        f"ratio bridge / plain HF: {ratio:.2f}x; with the tower cache on repeat epochs: "
        f"{cached_rate / hf_rate:.2f}x (median of {args.rounds} interleaved rounds of {args.steps} steps)"
    )
    result = {
        "workload": "vision align, ViT-B-32 frozen + MLP, Qwen3-0.6B-shaped bf16 frozen, batch "
        f"{args.batch}" + (" (small)" if args.small else ""),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "steps": args.steps,
        "rounds": args.rounds,
        "optimizer": res["bridge trainer"]["optimizer"] + " (both loops)",
        "bridge_samples_per_s": round(bridge_rate, 1),
        "plain_hf_samples_per_s": round(hf_rate, 1),
        "ratio": round(ratio, 3),
        "bridge_cached_tower_samples_per_s": round(cached_rate, 1),
        "ratio_cached": round(cached_rate / hf_rate, 3),
        "prep_ms_per_step": {k: round(v["prep_ms_per_step"], 1) for k, v in res.items()},
        "all_rounds": {k: v["all_rounds"] for k, v in res.items()},
    }
    print("| workload | Bridge samples/s | Bridge + tower cache, repeats | plain HF samples/s | ratios |")
    print("|---|---|---|---|---|")
    print(
        f"| {result['workload']} | {result['bridge_samples_per_s']} | "
        f"{result['bridge_cached_tower_samples_per_s']} | {result['plain_hf_samples_per_s']} | "
        f"{result['ratio']}x / {result['ratio_cached']}x |"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
