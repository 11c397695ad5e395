"""The training loop behind `bridge train`: one recipe in, OUTPUT/{metrics.jsonl, loss.png,
checkpoints/step_N, eval.json} out.

Data order is a pure function of (seed, step) (see sampler.py) and the LR a pure function of the
step, so resuming from step_N continues exactly where the run was: same step count, same next
samples. Under torchrun every rank runs this loop on its slice of each global batch; DDP (or
FSDP2 when the LLM is unfrozen, see fsdp.py) averages gradients; rank 0 alone writes files and
runs the evaluation.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from bridge.data.sources import build_datasets
from bridge.recipe import Node, dump_recipe
from bridge.training import checkpoint as ckpt_io
from bridge.training.batching import collate_examples
from bridge.training.components import (
    apply_stage,
    build_recipe_encoder,
    dataset_vocab_words,
    load_llm,
    prepare_llm_dir,
    stage_plan,
)
from bridge.training.distributed import (
    DistInfo,
    barrier,
    init_distributed,
    local_rank_from_env,
    mean_across_ranks,
    pick_device,
    shutdown,
)
from bridge.training.fsdp import (
    FullState,
    gather_full_state,
    gradient_sync,
    load_full_model_state,
    load_optimizer_state,
    resolve_wrapper,
    shard_model,
    wrap_for_training,
)
from bridge.training.model import BridgeModel
from bridge.training.plots import plot_loss
from bridge.training.sampler import ResumableSampler
from bridge.training.schedule import build_scheduler


def default_output_dir(recipe: Node) -> Path:
    return Path(recipe.output_dir) if recipe.output_dir else Path("runs") / recipe.name


class Trainer:
    def __init__(self, recipe: Node, output_dir: str | Path | None = None):
        self.recipe = recipe
        self.output_dir = Path(output_dir) if output_dir else default_output_dir(recipe)
        if recipe.train.cpu_threads > 0:
            torch.set_num_threads(recipe.train.cpu_threads)
        self.device = pick_device(recipe.train.device, local_rank_from_env())
        self.dist: DistInfo = init_distributed(self.device)
        torch.manual_seed(recipe.seed)
        if self.dist.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            ckpt_io.remove_stale_temp_dirs(self.output_dir)
        barrier(self.dist)

        self.train_set, self.eval_set = build_datasets(recipe.data, recipe.seed)
        words = dataset_vocab_words(self.train_set)
        self.base_llm_dir = prepare_llm_dir(recipe, self.output_dir, words, build=self.dist.is_main)
        barrier(self.dist)
        self.llm, self.tokenizer = load_llm(self.base_llm_dir, recipe.model.dtype)
        encoder = build_recipe_encoder(recipe, self.llm.config.hidden_size)
        self.modality = encoder.modality
        self.plan = stage_plan(recipe)
        apply_stage(self.plan, encoder, self.llm, recipe.train.lora)
        self.model = BridgeModel({encoder.modality: encoder}, self.llm).to(self.device)
        if recipe.train.cache_tower_outputs:
            if self.plan.tower or encoder.is_realtime:
                raise ValueError(
                    "train.cache_tower_outputs needs a frozen, non-streaming tower "
                    "(train.trainable.tower false)"
                )
            self.model.tower_cache = {}
        self.encoders = {encoder.modality: encoder}
        self.wrapper = resolve_wrapper(recipe.train.distributed, self.plan.llm_full, self.dist)
        if recipe.train.mixed_precision != "none" and self.wrapper != "fsdp":
            raise ValueError(
                f"train.mixed_precision={recipe.train.mixed_precision} needs FSDP2 (this run uses "
                f"{self.wrapper}); use train.precision=bf16 (autocast) instead"
            )
        if self.wrapper == "fsdp":  # before the optimizer: sharding replaces the parameters
            shard_model(self.model, self.llm, self.device, self.dist.world_size, recipe.train.mixed_precision)

        tr = recipe.train
        enc_params = [p for p in self.model.encoders.parameters() if p.requires_grad]
        llm_params = [p for p in self.llm.parameters() if p.requires_grad]
        groups = [
            g
            for g in (
                {"params": enc_params, "lr": tr.lr},
                {"params": llm_params, "lr": tr.llm_lr if tr.llm_lr is not None else tr.lr},
            )
            if g["params"]
        ]
        #: fused AdamW on CUDA (one kernel for all parameters instead of a few per tensor list)
        self.fused_optimizer = self.device.type == "cuda"
        self.optimizer = torch.optim.AdamW(
            groups,
            betas=tuple(tr.betas),
            weight_decay=tr.weight_decay,
            **({"fused": True} if self.fused_optimizer else {}),
        )
        self.scheduler = build_scheduler(
            self.optimizer,
            warmup_steps=tr.warmup_steps,
            max_steps=tr.max_steps,
            kind=tr.schedule,
            min_lr_ratio=tr.min_lr_ratio,
        )
        self.sampler = ResumableSampler(
            len(self.train_set),
            tr.batch_size,
            seed=recipe.seed,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
        )
        self.step = 0
        self.resumed_from: Path | None = None
        if tr.resume:
            last = ckpt_io.resumable_checkpoint(self.output_dir)
            if last is not None:
                self._load_checkpoint(last)
        self.train_module: torch.nn.Module = wrap_for_training(self.model, self.wrapper, self.device)

    # ------------------------------------------------------------------ counts
    def trainable_counts(self) -> dict[str, int]:
        enc = self.encoders[self.modality]
        count = lambda ps: sum(p.numel() for p in ps if p.requires_grad)  # noqa: E731
        return {
            "tower": count(enc.tower.parameters()),
            "projector": count(enc.projector.parameters()),
            "llm": count(self.llm.parameters()),
        }

    # ------------------------------------------------------------------ loop
    def set_train_mode(self) -> None:
        """Train mode for what trains; a fully frozen LLM stays in eval mode (once, not per step)."""
        self.train_module.train()
        if not any(p.requires_grad for p in self.llm.parameters()):
            self.llm.eval()

    def _autocast(self):
        if self.recipe.train.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _micro_batch(self, micro_step: int):
        indices = self.sampler.micro_batch(micro_step)
        examples = [self.train_set[i] for i in indices]
        cache = self.model.tower_cache
        return collate_examples(examples, self.tokenizer, self.encoders, keys=indices, cached=cache).to(
            self.device
        )

    def train_step(self) -> float:
        """One optimizer step (grad accumulation inside); returns the step's loss averaged over
        its micro-batches and ranks.

        One host sync per step (reading the loss once, after the last backward and before the
        optimizer step, so a non-finite loss stops the run before it reaches the weights); the
        micro-batch losses are summed on the device."""
        tr = self.recipe.train
        accum = tr.grad_accum_steps
        if not self.model.training:
            self.set_train_mode()
        total = None
        for k in range(accum):
            batch = self._micro_batch(self.step * accum + k)
            sync = k == accum - 1 or not self.dist.enabled
            with gradient_sync(self.train_module, sync):
                with self._autocast():
                    loss = self.train_module(batch)
                (loss / accum).backward()
            total = loss.detach() if total is None else total + loss.detach()
        value = float(total) / accum
        if not math.isfinite(value):
            raise FloatingPointError(
                f"loss is {value} at step {self.step}; lower train.lr or use precision fp32"
            )
        if tr.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(
                [p for g in self.optimizer.param_groups for p in g["params"]], tr.grad_clip
            )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return mean_across_ranks(value, self.dist, self.device)

    def run(self) -> dict[str, Any]:
        tr = self.recipe.train
        metrics_path = self.output_dir / "metrics.jsonl"
        if self.dist.is_main:
            dump_recipe(self.recipe, self.output_dir / "recipe.yaml")
            _truncate_metrics(metrics_path, self.step)
        bar = None
        if self.dist.is_main and tr.progress:
            from tqdm import tqdm

            bar = tqdm(total=tr.max_steps, initial=self.step, desc=f"train {self.recipe.name}", unit="step")
        global_batch = tr.batch_size * tr.grad_accum_steps * self.dist.world_size
        t0 = time.perf_counter()
        steps_done = 0
        last_loss = math.nan
        while self.step < tr.max_steps:
            lr = self.optimizer.param_groups[0]["lr"]
            last_loss = self.train_step()
            steps_done += 1
            if self.dist.is_main and (self.step % tr.log_every == 0 or self.step == tr.max_steps):
                elapsed = time.perf_counter() - t0
                row = {
                    "step": self.step,
                    "loss": round(last_loss, 6),
                    "lr": lr,
                    "samples_per_s": round(steps_done * global_batch / max(elapsed, 1e-9), 2),
                }
                with metrics_path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{last_loss:.4f}", lr=f"{lr:.2e}")
            if tr.checkpoint_every and self.step % tr.checkpoint_every == 0 and self.step < tr.max_steps:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        final = self.save_checkpoint()
        summary: dict[str, Any] = {
            "steps": self.step,
            "final_loss": last_loss,
            "checkpoint": str(final),
            "output_dir": str(self.output_dir),
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
        }
        if self.dist.is_main:
            plot_loss(metrics_path, self.output_dir / "loss.png", title=self.recipe.name)
            if self.recipe.eval.enabled and self.eval_set is not None:
                from bridge.training.evaluate import evaluate_checkpoint

                summary["eval"] = evaluate_checkpoint(
                    final, self.eval_set, self.recipe.eval, self.device, self.output_dir / "eval.json"
                )
        barrier(self.dist)
        return summary

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        final = ckpt_io.checkpoint_root(self.output_dir) / f"step_{self.step}"
        full = gather_full_state(self.model, self.optimizer)  # every rank: a collective under FSDP
        if self.dist.is_main:
            final = ckpt_io.write_checkpoint(
                self.output_dir,
                self.step,
                lambda tmp: self._fill_checkpoint(tmp, full),
                keep=self.recipe.train.keep_checkpoints,
            )
        barrier(self.dist)
        return final

    def _fill_checkpoint(self, tmp: Path, full: FullState) -> dict:
        """Rank 0 writes the checkpoint from full tensors (`full`), never from the modules' own
        (possibly sharded) parameters."""
        dump_recipe(self.recipe, tmp / "recipe.yaml")
        for modality, enc in self.encoders.items():
            enc_state = ckpt_io.sub_state(full.model, f"encoders.{modality}.")
            ckpt_io.save_encoder_state(enc, enc_state, tmp / "encoder" / modality)
        llm_state = ckpt_io.sub_state(full.model, "llm.")
        trainable = {n: llm_state[n] for n, p in self.llm.named_parameters() if p.requires_grad}
        if trainable:
            ckpt_io.save_tensors(tmp / "llm_trainable.safetensors", trainable)
        llm_dir = str(self.base_llm_dir.resolve())
        if self.plan.llm_changes:
            self.llm.save_pretrained(tmp / "llm", state_dict=ckpt_io.merged_llm_state(self.llm, llm_state))
            self.tokenizer.save_pretrained(tmp / "llm")
            llm_dir = "llm"
        scheduler = self.scheduler.state_dict()
        ckpt_io.save_trainer_state(tmp / ckpt_io.TRAINER_STATE_NAME, full.optimizer, scheduler)
        return {
            "stage": self.recipe.stage,
            "llm_dir": llm_dir,
            "base_llm_dir": str(self.base_llm_dir.resolve()),
            "modalities": sorted(self.encoders),
            "llm_dtype": self.recipe.model.dtype,
            "world_size": self.dist.world_size,
            "wrapper": self.wrapper,
        }

    def _load_checkpoint(self, path: Path) -> None:
        from encoders.api import describe_mismatch

        meta = ckpt_io.read_meta(path)
        full: dict[str, torch.Tensor] = {}  # BridgeModel names -> full tensors, checked first
        for modality, enc in self.encoders.items():
            state = ckpt_io.load_tensors(path / "encoder" / modality / "model.safetensors")
            problems = describe_mismatch(enc.state_dict(), state)  # global shapes, sharded or not
            if problems:
                raise ValueError(f"weights in {path} do not match the model:\n  - " + "\n  - ".join(problems))
            full.update({f"encoders.{modality}.{k}": v for k, v in state.items()})
        trainable_file = path / "llm_trainable.safetensors"
        if trainable_file.is_file():
            state = ckpt_io.load_tensors(trainable_file)
            own = dict(self.llm.named_parameters())
            unknown = sorted(set(state) - set(own))
            if unknown:
                raise ValueError(
                    f"{trainable_file}: tensors the LLM does not have: {unknown[:5]} (was the "
                    f"checkpoint made with another stage or LoRA config?)"
                )
            full.update({f"llm.{k}": v for k, v in state.items()})
        load_full_model_state(self.model, full)  # every rank: a sharded model keeps its shard
        trainer_state = ckpt_io.load_trainer_state(path / ckpt_io.TRAINER_STATE_NAME)
        load_optimizer_state(self.model, self.optimizer, trainer_state["optimizer"])
        self.scheduler.load_state_dict(trainer_state["scheduler"])
        torch.set_rng_state(trainer_state["torch_rng"].cpu())
        self.step = int(meta["step"])
        self.resumed_from = path


def merged_state_dict(llm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The (unsharded) LLM's state dict with every LoRA layer folded in (see
    checkpoint.merged_llm_state)."""
    return ckpt_io.merged_llm_state(llm, dict(llm.state_dict()))


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics past the step we resume from, so a resumed run's curve has no duplicates."""
    ckpt_io.truncate_metrics(path, step)


def train(recipe: Node, output_dir: str | Path | None = None) -> dict[str, Any]:
    """Run a recipe end to end (what `bridge train` calls)."""
    trainer = Trainer(recipe, output_dir)
    try:
        return trainer.run()
    finally:
        shutdown(trainer.dist)
