"""Training-step throughput (samples/s): Bridge's trainer vs a plain Hugging Face loop, same run.

Workload (the vision align recipe): open_clip ViT-B-32 tower (random init, frozen) -> 2-layer MLP
projector (trained) -> a Qwen3-0.6B-shaped LLM (random bf16 weights from the tiny-model kit:
hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, vocab 151936; frozen), bf16 autocast,
AdamW on the projector. Synthetic shapes images (64x64, resized to 224 by open_clip's
preprocessing) and their captions, prompt "<image>\\nDescribe the image.", batch 32.

Contenders, all on the same examples in the same order, same optimizer (AdamW, fused on CUDA,
same betas / weight decay / grad clip):

- bridge trainer: `Trainer.train_step`. Its micro-batches are built by `train.num_workers`
  DataLoader workers (`--num-workers`, default the recipe's auto: min(4, CPUs - 1) on CUDA, 0 on
  the CPU), pinned, and copied to the GPU on a side stream while the previous step runs.
- bridge + cache: the same, frozen-tower outputs cached, timed on repeat epochs.
- plain HF loop: what one writes by hand with transformers: draw, preprocess and tokenize inline,
  encoder rows and token embeddings concatenated into `inputs_embeds`,
  `model(inputs_embeds=..., attention_mask=..., labels=...)`, backward, step.
- plain HF + DataLoader: the same step, with its data preparation (drawing, open_clip
  preprocessing, tokenizing, stacking) in a `torch.utils.data.DataLoader` with the same number of
  workers, `pin_memory=True`, `persistent_workers`, `prefetch_factor=2` and
  `.to(device, non_blocking=True)`: PyTorch's documented fastest input pipeline, so the peer is
  compared at its best, not only as the inline loop.

Timing: the contenders run in interleaved rounds with the order rotated each round (the median
round is reported), so none gains from running first or last. While one contender runs, the
others' loader workers keep their queues full (num_workers x prefetch_factor batches), so the
first few steps of a round start with ready batches; 30 steps per round keep that head start
small next to the steady state.

Data wait % of step: the time a step waited for data over its wall time. Bridge's trainer records
it itself (`Trainer.timing`: host time blocked on the loader plus device time the step's stream
waited for a copy, see bridge/training/loader.py). For the HF loops it is the host time spent
preparing data inline (plain loop) or blocked on the DataLoader (HF + DataLoader).

Model FLOP utilisation (MFU) of the LLM part: useful LLM FLOPs per step over (step time x the bf16
matmul rate measured in this run, `generate.measure_matmul_rate`). The LLM is frozen, so there are
no weight gradients: the forward costs 2 N per token, the backward (gradients with respect to
activations only, to reach the projector) another 2 N. Per step, summed over the B samples of
T_i tokens (prompt with the encoder rows, plus target) and G_i target tokens:

    FLOPs = sum_i [ 4 N_body T_i + 4 V H G_i + 12 L d_attn T_i^2 ]

N_body: decoder parameters without the embedding table (the lookup is no matmul); V H: the LM
head, which is only useful at the positions that predict a target (Bridge applies it only there;
the HF loop computes full-vocabulary logits at every position, which counts as waste, not work);
12 L d_attn T^2: attention scores and values (QK^T and AV, 2 T^2 d_attn FLOPs each forward, twice
that backward) over L layers with d_attn = heads x head_dim, counted without the causal half (the
PaLM convention). The tower and projector are not counted. Same formula for every contender.

    python3 benchmarks/train_throughput.py             # GPU, < 5 min (builds a 0.6B model dir first)
    python3 benchmarks/train_throughput.py --small --device cpu --steps 2 --rounds 2   # smoke test
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

# The same Qwen3-0.6B shape and bf16 matmul-rate probe as the engine benchmark.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import QWEN3_06B, measure_matmul_rate  # noqa: E402

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
            "num_workers": args.num_workers,
            "prefetch_factor": args.prefetch_factor,
        },
        "eval": {"enabled": False},
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timing:
    """Step wall time and the part of it spent waiting for data (what `Trainer.timing` records),
    kept by hand for the HF loops."""

    def __init__(self):
        self.step_s = 0.0
        self.data_wait_s = 0.0

    def reset(self) -> None:
        self.step_s = self.data_wait_s = 0.0

    def wait(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.data_wait_s += time.perf_counter() - t0

        return timed

    def step(self, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.step_s += time.perf_counter() - t0

        return timed


def make_bridge(recipe, out_dir: Path, args):
    """Bridge's trainer; returns (contender dict, trainer)."""
    from bridge.training.trainer import Trainer

    trainer = Trainer(recipe, out_dir)
    contender = {
        "step": lambda i: trainer.train_step(),
        "timing": trainer.timing,
        "optimizer": f"AdamW fused={getattr(trainer, 'fused_optimizer', False)}",
        "workers": trainer.num_workers,
        "close": trainer.close_data,
    }
    return contender, trainer


class _HFExamples(torch.utils.data.Dataset):
    """The HF + DataLoader input pipeline: example i -> (target ids, preprocessed image)."""

    def __init__(self, train, enc, tok):
        self.train, self.enc, self.tok = train, enc, tok

    def __getitem__(self, i: int):
        ex = self.train[i]
        target = self.tok(" " + ex.target, add_special_tokens=False).input_ids + [self.tok.eos_token_id]
        return target, self.enc.preprocess(ex.media["image"][0])


class _HFBatches:
    """Batch sampler: the trainer's micro-batch order (ResumableSampler), batch 0, 1, 2, ..."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        return (self.sampler.micro_batch(i) for i in itertools.count())


def make_plain_hf(recipe, model_dir: Path, args, *, loader: bool = False, workers: int = 0):
    """The hand-written baseline: inputs_embeds + labels into the HF model. Same examples, same
    encoder, same optimizer settings as the trainer (AdamW, fused on CUDA, weight decay 0,
    grad clip 1.0), so only the step's design differs. `loader`: its data preparation in a
    DataLoader (`workers` processes, pinned, non_blocking copies) instead of inline."""
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
    timing = Timing()
    close = None

    if loader:

        def collate(items):
            return [t for t, _ in items], enc.collate([x for _, x in items])

        dl = torch.utils.data.DataLoader(
            _HFExamples(train, enc, tok),
            batch_sampler=_HFBatches(sampler),
            collate_fn=collate,
            num_workers=workers,
            pin_memory=device.type == "cuda",
            persistent_workers=workers > 0,
            prefetch_factor=2 if workers > 0 else None,
            # fork (as the trainer's loader): the workers inherit the encoder, whose weights are on
            # the GPU, instead of unpickling it (the default from Python 3.14 is forkserver)
            multiprocessing_context="fork" if workers > 0 and sys.platform.startswith("linux") else None,
        )
        batches = iter(dl)

        @timing.wait
        def prepare(i: int):
            targets, batch = next(batches)
            batch = {
                k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()
            }
            return targets, batch

        def close():
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    else:

        @timing.wait
        def prepare(i: int):
            examples = [train[j] for j in sampler.micro_batch(i)]
            targets = [
                tok(" " + ex.target, add_special_tokens=False).input_ids + [tok.eos_token_id]
                for ex in examples
            ]
            return targets, enc.collate([enc.preprocess(ex.media["image"][0]) for ex in examples])

    @timing.step
    def step(i: int) -> float:
        targets, batch = prepare(i)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            rows = enc(batch)
            seqs, labels = [], []
            for target_ids, r in zip(targets, rows):
                target = torch.tensor(target_ids, device=device)
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

    return {
        "step": step,
        "timing": timing,
        "optimizer": f"AdamW fused={fused}",
        "workers": workers if loader else 0,
        "close": close,
    }


def llm_flops_per_step(trainer, micro_batches: int) -> dict:
    """The module docstring's FLOPs per step (frozen LLM, forward + activation-gradient backward),
    averaged over the first `micro_batches` micro-batches of the data order (token counts from the
    same tokenization the trainer uses; no image is preprocessed)."""
    from bridge.data.tokenize import tokenize_prompt, tokenize_target

    llm, tok = trainer.llm, trainer.tokenizer
    cfg = llm.config
    enc = trainer.encoders["image"]
    vocab_hidden = llm.get_input_embeddings().weight.numel()
    n_body = sum(p.numel() for p in llm.get_decoder().parameters()) - vocab_hidden
    layers, d_attn = cfg.num_hidden_layers, cfg.num_attention_heads * cfg.head_dim
    rows = {"image": lambda item: enc.num_rows(item)}
    total = 0.0
    tokens = targets = 0
    for m in range(micro_batches):
        for i in trainer.sampler.micro_batch(m):
            ex = trainer.train_set[i]
            t = len(tokenize_prompt(tok, ex.prompt, ex.media, rows).ids)
            g = len(tokenize_target(tok, ex.target))
            t += g
            tokens, targets = tokens + t, targets + g
            total += 4 * n_body * t + 4 * vocab_hidden * g + 12 * layers * d_attn * t * t
    return {
        "flops_per_step": total / micro_batches,
        "n_body": n_body,
        "lm_head": vocab_hidden,
        "tokens_per_sample": tokens / (micro_batches * trainer.recipe.train.batch_size),
        "targets_per_sample": targets / (micro_batches * trainer.recipe.train.batch_size),
    }


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
    waits = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            c = contenders[name]
            sync(device)
            c["timing"].reset()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                c["last_loss"] = c["step"](counters[name])
                counters[name] += 1
            sync(device)
            elapsed = time.perf_counter() - t0
            rates[name].append(args.steps * args.batch / elapsed)
            t = c["timing"]
            waits[name].append((t.data_wait_s / args.steps * 1e3, t.data_wait_s / max(t.step_s, 1e-12)))
    out = {}
    for name in names:
        k = sorted(range(len(rates[name])), key=lambda j: rates[name][j])[len(rates[name]) // 2]
        out[name] = {
            "samples_per_s": rates[name][k],
            "all_rounds": [round(x, 1) for x in rates[name]],
            "ms_per_step": args.batch / rates[name][k] * 1e3,
            "data_wait_ms_per_step": waits[name][k][0],
            "data_wait_pct": 100 * waits[name][k][1],
            "all_rounds_wait_pct": [round(100 * w[1], 2) for w in waits[name]],
            "last_loss": contenders[name]["last_loss"],
            "optimizer": contenders[name]["optimizer"],
            "workers": contenders[name]["workers"],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds (median reported)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="loader workers for Bridge and the HF + DataLoader loop (default: train.num_workers' auto)",
    )
    parser.add_argument("--prefetch-factor", type=int, default=2)
    parser.add_argument("--small", action="store_true", help="tiny LLM + tiny ViT (smoke test)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    from bridge.recipe import validate
    from bridge.tiny_models import build_tiny_model

    device = torch.device(args.device)
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
        bridge, trainer = make_bridge(recipe, Path(tmp) / "run", args)
        contenders["bridge trainer"] = bridge
        contenders["bridge + cache"], _ = make_bridge(cached_recipe, Path(tmp) / "run_cached", args)
        contenders["bridge + cache"]["extra_warmup"] = epoch_steps
        workers = trainer.num_workers
        contenders["plain HF loop"] = make_plain_hf(recipe, model_dir, args)
        contenders["plain HF + DataLoader"] = make_plain_hf(
            recipe, model_dir, args, loader=True, workers=workers
        )
        flops = llm_flops_per_step(trainer, micro_batches=4)
        matmul_rate = (
            measure_matmul_rate(device)
            if device.type == "cuda"
            else measure_matmul_rate(device, n=512, iters=3)
        )
        print(
            f"bf16 matmul rate {matmul_rate / 1e12:.3g} TFLOP/s; "
            f"LLM FLOPs/step {flops['flops_per_step'] / 1e12:.3g} T "
            f"({flops['tokens_per_sample']:.1f} tokens, {flops['targets_per_sample']:.1f} targets "
            f"per sample; N_body {flops['n_body'] / 1e6:.1f} M, LM head {flops['lm_head'] / 1e6:.1f} M)",
            flush=True,
        )
        try:
            res = interleaved(contenders, args, device)
        finally:
            for c in contenders.values():
                if c.get("close") is not None:
                    c["close"]()
    notes = {
        "bridge trainer": f"{workers} loader workers"
        + (", side-stream copies" if device.type == "cuda" else ""),
        "bridge + cache": "frozen tower outputs cached, repeat epochs",
        "plain HF loop": "inline data prep, inputs_embeds + labels, full-vocab logits",
        "plain HF + DataLoader": f"{workers} DataLoader workers"
        + (", pin_memory, non_blocking" if device.type == "cuda" else ""),
    }
    for r in res.values():
        r["mfu_pct"] = 100 * flops["flops_per_step"] / (r["ms_per_step"] / 1e3) / matmul_rate
    for name, r in res.items():
        print(
            f"{name:22s}: {r['samples_per_s']:8.1f} samples/s  {r['ms_per_step']:7.1f} ms/step  "
            f"data wait {r['data_wait_ms_per_step']:6.1f} ms/step = {r['data_wait_pct']:5.1f}% of step  "
            f"LLM MFU {r['mfu_pct']:5.2f}%  (rounds {r['all_rounds']}; {r['optimizer']}; "
            f"last loss {r['last_loss']:.3f}) {notes.get(name, '')}",
            flush=True,
        )
    bridge_rate = res["bridge trainer"]["samples_per_s"]
    cached_rate = res["bridge + cache"]["samples_per_s"]
    hf_rate = res["plain HF loop"]["samples_per_s"]
    hf_dl_rate = res["plain HF + DataLoader"]["samples_per_s"]
    ratio = bridge_rate / hf_rate
    print(
        f"ratio bridge / plain HF: {ratio:.2f}x (vs HF + DataLoader: {bridge_rate / hf_dl_rate:.2f}x); "
        f"with the tower cache on repeat epochs: {cached_rate / hf_rate:.2f}x "
        f"({cached_rate / hf_dl_rate:.2f}x) "
        f"(median of {args.rounds} interleaved rounds of {args.steps} steps)"
    )
    wait = res["bridge trainer"]["data_wait_pct"]
    verdict = ("met" if wait < 5 else "NOT met") if device.type == "cuda" else "a GPU target; not judged here"
    print(f"bridge data wait: {wait:.1f}% of the step (target < 5%: {verdict})")
    result = {
        "workload": "vision align, ViT-B-32 frozen + MLP, Qwen3-0.6B-shaped bf16 frozen, batch "
        f"{args.batch}" + (" (small)" if args.small else ""),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "steps": args.steps,
        "rounds": args.rounds,
        "num_workers": workers,
        "prefetch_factor": args.prefetch_factor,
        "optimizer": res["bridge trainer"]["optimizer"] + " (all loops)",
        "bridge_samples_per_s": round(bridge_rate, 1),
        "plain_hf_samples_per_s": round(hf_rate, 1),
        "plain_hf_dataloader_samples_per_s": round(hf_dl_rate, 1),
        "ratio": round(ratio, 3),
        "ratio_vs_hf_dataloader": round(bridge_rate / hf_dl_rate, 3),
        "bridge_cached_tower_samples_per_s": round(cached_rate, 1),
        "ratio_cached": round(cached_rate / hf_rate, 3),
        "data_wait_pct": {k: round(v["data_wait_pct"], 2) for k, v in res.items()},
        "data_wait_ms_per_step": {k: round(v["data_wait_ms_per_step"], 2) for k, v in res.items()},
        "mfu_pct": {k: round(v["mfu_pct"], 3) for k, v in res.items()},
        "llm_flops_per_step": flops["flops_per_step"],
        "matmul_rate_flops": matmul_rate,
        "all_rounds": {k: v["all_rounds"] for k, v in res.items()},
        "all_rounds_wait_pct": {k: v["all_rounds_wait_pct"] for k, v in res.items()},
    }
    print("| loop | samples/s | ms/step | data wait % of step | LLM MFU |")
    print("|---|---:|---:|---:|---:|")
    for name, r in res.items():
        print(
            f"| {name} | {r['samples_per_s']:.1f} | {r['ms_per_step']:.1f} | {r['data_wait_pct']:.1f} | "
            f"{r['mfu_pct']:.2f}% |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
