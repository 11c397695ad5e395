"""The peer of benchmarks/train_scale.py: a careful plain PyTorch + transformers training loop.

What an engineer who knows PyTorch writes by hand for the same recipe: a map-style Dataset that
decodes and preprocesses each file with the tower's own transform and tokenizes with the HF
tokenizer; a DataLoader with the same worker count, pinned memory, persistent workers and
non-blocking copies; the frozen tower under no_grad; bf16 autocast; the model's SDPA attention with
right padding and the attention mask; the encoder rows written into the token embeddings and the
LM head applied to the target positions only, both through host-computed flat indices (no host
sync); fused AdamW; for a trained LLM fp32 master weights and HF gradient checkpointing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

PLACEHOLDERS = {"image": "<image>", "audio": "<audio>"}


class PeerTiming:
    def __init__(self):
        self.steps, self.step_s, self.data_wait_s = 0, 0.0, 0.0

    def reset(self) -> None:
        self.steps, self.step_s, self.data_wait_s = 0, 0.0, 0.0


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows, media_root: Path, prompt: str, modality: str, encoder, tokenizer):
        self.rows, self.media_root, self.prompt = rows, media_root, prompt
        self.modality, self.encoder, self.tok = modality, encoder, tokenizer

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        row = self.rows[i]
        path = str(self.media_root / row[self.modality])
        before, after = row.get("prompt", self.prompt).split(PLACEHOLDERS[self.modality])
        pre = self.tok(before, add_special_tokens=True).input_ids
        post = self.tok(after, add_special_tokens=False).input_ids
        target = self.tok(" " + row["text"], add_special_tokens=False).input_ids + [self.tok.eos_token_id]
        return pre, post, target, self.encoder.num_rows(path), self.encoder.tower.preprocess(path)


class _Collate:
    def __init__(self, tower, pad: int):
        self.tower, self.pad = tower, pad

    def __call__(self, items):
        seqs = [(pre, n, post + target, len(pre) + n + len(post)) for pre, post, target, n, _ in items]
        length = max(len(pre) + n + len(rest) for pre, n, rest, _ in seqs)
        ids, mask, row_pos, tgt_pos, tgt_ids = [], [], [], [], []
        for b, ((pre, n, rest, n_prompt), (_, _, target, _, _)) in enumerate(zip(seqs, items)):
            seq = pre + [self.pad] * n + rest
            fill = length - len(seq)
            ids.append(seq + [self.pad] * fill)
            mask.append([1] * len(seq) + [0] * fill)
            row_pos.extend(b * length + len(pre) + k for k in range(n))
            tgt_pos.extend(b * length + t for t in range(n_prompt - 1, len(seq) - 1))
            tgt_ids.extend(target)
        as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
        return {
            "ids": as_long(ids),
            "mask": as_long(mask),
            "row_pos": as_long(row_pos),
            "tgt_pos": as_long(tgt_pos),
            "tgt_ids": as_long(tgt_ids),
            "media": self.tower.collate([x for *_, x in items]),
        }


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


class PeerLoop:
    """`step()` runs one optimizer step on the next batch; `timing` as Trainer.timing."""

    def __init__(self, recipe, trainer, device: torch.device, full_llm: bool):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from bridge.training.components import encoder_config
        from encoders.api import build_encoder

        self.device = device
        cuda = device.type == "cuda"
        tok = AutoTokenizer.from_pretrained(recipe.model.path)
        dtype = torch.float32 if full_llm or not cuda else torch.bfloat16
        llm = AutoModelForCausalLM.from_pretrained(recipe.model.path, dtype=dtype, attn_implementation="sdpa")
        llm.config.use_cache = False
        if full_llm:
            llm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            llm.train()
        else:
            llm.requires_grad_(False).eval()
        self.llm = llm.to(device)
        torch.manual_seed(recipe.seed)
        enc = build_encoder(encoder_config(recipe, llm.config.hidden_size)).to(device)
        enc.tower.requires_grad_(False).eval()
        self.encoder, self.tower, self.projector = enc, enc.tower, enc.projector
        params = list(self.projector.parameters()) + [p for p in llm.parameters() if p.requires_grad]
        self.params = params
        self.opt = torch.optim.AdamW(params, lr=recipe.train.lr, **({"fused": True} if cuda else {}))
        self.clip = recipe.train.grad_clip
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
        data = recipe.data
        rows = [json.loads(line) for line in Path(data.train).read_text().splitlines() if line.strip()]
        dataset = _Rows(rows, Path(data.media_root), data.prompt, enc.modality, enc, tok)
        order = [trainer.sampler.micro_batch(m) for m in range(len(rows) // recipe.train.batch_size)]
        workers = trainer.num_workers
        self.loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=order,
            collate_fn=_Collate(self.tower, tok.pad_token_id or 0),
            num_workers=workers,
            pin_memory=cuda,
            persistent_workers=workers > 0,
            prefetch_factor=2 if workers > 0 else None,
            multiprocessing_context="fork" if workers > 0 else None,
        )
        self.batches = iter(self.loader)
        self.timing = PeerTiming()

    def step(self) -> torch.Tensor:
        t0 = time.perf_counter()
        batch = _to(next(self.batches), self.device)
        self.timing.data_wait_s += time.perf_counter() - t0
        embed = self.llm.get_input_embeddings()
        with self.autocast:
            with torch.no_grad():
                media = {
                    k: (v.float() if torch.is_floating_point(v) else v) for k, v in batch["media"].items()
                }
                feats, lengths = self.tower(media)
            rows, _ = self.projector(feats, lengths)
            tokens = embed(batch["ids"])
            b, length, hidden = tokens.shape
            rows = rows[:, : rows.shape[1]].reshape(-1, hidden)  # every item's rows are all real here
            flat = tokens.reshape(b * length, hidden).index_copy(0, batch["row_pos"], rows.to(tokens.dtype))
            out = self.llm.model(inputs_embeds=flat.view(b, length, hidden), attention_mask=batch["mask"])
            picked = out.last_hidden_state.reshape(-1, hidden).index_select(0, batch["tgt_pos"])
            logits = self.llm.lm_head(picked).float()
            loss = F.cross_entropy(logits, batch["tgt_ids"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.timing.step_s += time.perf_counter() - t0
        self.timing.steps += 1
        return loss.detach()

    def close(self) -> None:
        shutdown = getattr(self.batches, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
