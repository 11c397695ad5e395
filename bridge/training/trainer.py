"""The training loop behind `bridge train`: one recipe in, OUTPUT/{metrics.jsonl, loss.png,
checkpoints/step_N, eval.json} out.

Data order is a pure function of (seed, step) (see sampler.py) and the LR a pure function of the
step, so resuming from step_N continues exactly where the run was: same step count, same next
samples. Under torchrun every rank runs this loop on its slice of each global batch; DDP (or
FSDP2 when the LLM is unfrozen, see fsdp.py) averages gradients; rank 0 alone writes files and
runs the evaluation.

What a run tells its user: "resumed from step N" first when it resumes; a held-out loss every
`eval.every` steps next to the training loss; at the end the elapsed time and where eval.json,
loss.png and the last checkpoint are. Ctrl-C stops with the step reached and the checkpoint a
rerun resumes from (`TrainingInterrupted`); rerunning a finished run says it is complete.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from bridge.data.sources import build_datasets
from bridge.recipe import (
    FROZEN_ON_RESUME,
    Node,
    default_output_dir,
    describe_change,
    dump_recipe,
    frozen_changes,
    load_yaml,
    recipe_changes,
)
from bridge.run_check import model_context
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
    union_across_ranks,
)
from bridge.training.evaluate import evaluate_checkpoint
from bridge.training.fit_context import FitToContext
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
from bridge.training.layer_options import apply_layer_options
from bridge.training.loader import BatchStream, MicroBatchBuilder, StepTiming, resolve_num_workers
from bridge.training.model import BridgeModel
from bridge.training.packed_attention import resolve_packing
from bridge.training.plots import plot_loss, read_metrics
from bridge.training.sampler import ResumableSampler
from bridge.training.schedule import build_scheduler

__all__ = ["Trainer", "TrainingInterrupted", "default_output_dir", "train"]


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: carries the step reached and the checkpoint a rerun resumes from."""

    def __init__(self, step: int, last_checkpoint: Path | None):
        self.step = step
        self.last_checkpoint = last_checkpoint
        if last_checkpoint is None:
            where = "there is no checkpoint yet; rerun the same command to start again"
        else:
            where = (
                f"the last checkpoint is step {last_checkpoint.name.removeprefix('step_')} "
                f"({last_checkpoint}); rerun the same command to resume"
            )
        super().__init__(f"interrupted at step {step}; {where}")


class ResumeMismatch(ValueError):
    """The recipe differs from the checkpoint's in keys a resume cannot change (without --force)."""


def _say(text: str) -> None:
    """A status line for the person at the terminal (stderr, so stdout stays the JSON summary)."""
    tqdm.write(text, file=sys.stderr)


@contextlib.contextmanager
def _quiet_hf_progress() -> Iterator[None]:
    """transformers' own bars (writing shards at a checkpoint, loading weights) would break the
    training bar's line; off while a run is going, restored after."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


class Trainer:
    def __init__(self, recipe: Node, output_dir: str | Path | None = None):
        self.recipe = recipe
        self.output_dir = Path(output_dir) if output_dir else default_output_dir(recipe)
        if recipe.train.cpu_threads > 0:
            torch.set_num_threads(recipe.train.cpu_threads)
        self.device = pick_device(recipe.train.device, local_rank_from_env())
        self.dist: DistInfo = init_distributed(
            self.device, single_rank_group=recipe.train.distributed == "fsdp"
        )
        torch.manual_seed(recipe.seed)
        if self.dist.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            ckpt_io.remove_stale_temp_dirs(self.output_dir)
        barrier(self.dist)

        self.train_set, self.eval_set = build_datasets(recipe.data, recipe.seed)
        #: data.skip_bad_rows: the rows the data sets left out when they loaded, and those passed over
        #: while training (found when read; each batch names them). Counted per rank.
        self.skipped_at_load = [*_skipped(self.train_set), *_skipped(self.eval_set)]
        self.skipped_seen: set[str] = set()
        if self.skipped_at_load and self.dist.is_main:
            _say(f"data.skip_bad_rows: skipped {len(self.skipped_at_load)} malformed row(s) (train: "
                 f"{len(_skipped(self.train_set))}, eval: {len(_skipped(self.eval_set))}); the first: "
                 f"{self.skipped_at_load[0][:300]}")
        words = dataset_vocab_words(self.train_set)
        self.base_llm_dir = prepare_llm_dir(recipe, self.output_dir, words, build=self.dist.is_main, say=_say)
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
        if recipe.data.truncate:
            self._fit_to_context()
        self.wrapper = resolve_wrapper(recipe.train.distributed, self.plan.llm_full, self.dist)
        if recipe.train.mixed_precision != "none" and self.wrapper != "fsdp":
            raise ValueError(
                f"train.mixed_precision={recipe.train.mixed_precision} needs FSDP2 (this run uses "
                f"{self.wrapper}); use train.precision=bf16 (autocast) instead"
            )
        #: collate_examples' packing options, and the attention that keeps packed samples apart
        self.collate_options = resolve_packing(recipe.train, self.model, self.llm, self.device)
        if self.wrapper == "fsdp":  # before the optimizer: sharding replaces the parameters
            shard_model(self.model, self.llm, self.device, self.dist.world_size, recipe.train.mixed_precision)
        apply_layer_options(
            self.llm,
            activation_checkpointing=recipe.train.activation_checkpointing,
            compile=self.device.type == "cuda" if recipe.train.compile is None else recipe.train.compile,
        )

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
        #: loader worker processes (train.num_workers; null: see loader.default_num_workers)
        self.num_workers = resolve_num_workers(tr.num_workers, self.device)
        self._batches: BatchStream | None = None
        #: step wall time and the part spent waiting for data, summed since the trainer was built
        #: (callers may reset it); see loader.py for what counts as waiting
        self.timing = StepTiming()
        self.step = 0
        self.resumed_from: Path | None = None
        #: "key: old -> new" lines against the resumed checkpoint's recipe (see check_resume)
        self.setting_changes: list[str] = []
        if tr.resume:
            last = ckpt_io.resumable_checkpoint(self.output_dir)
            if last is not None:
                self._load_checkpoint(last)
        self.train_module: torch.nn.Module = wrap_for_training(self.model, self.wrapper, self.device)

    def _fit_to_context(self) -> None:
        """data.truncate: the datasets' targets cut to fit the LLM's context (fit_context.py)."""
        context = model_context(self.llm.config.to_dict())
        if context is None:
            return
        num_rows = {m: enc.num_rows for m, enc in self.encoders.items()}
        self.train_set = FitToContext(self.train_set, self.tokenizer, num_rows, context)
        if self.eval_set is not None:
            self.eval_set = FitToContext(self.eval_set, self.tokenizer, num_rows, context)

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
        """Micro-batch `micro_step` built here and now, on the device (what the batch stream
        yields for it, built without the loader)."""
        indices = self.sampler.micro_batch(micro_step)
        examples = [self.train_set[i] for i in indices]
        cache = self.model.tower_cache
        return collate_examples(
            examples, self.tokenizer, self.encoders, keys=indices, cached=cache, **self.collate_options
        ).to(self.device)

    def _batch_stream(self, micro_step: int) -> BatchStream:
        """The stream whose next micro-batch is `micro_step`: the running one, or a new one (first
        step, after a resume, or when the step counter was moved)."""
        stream = self._batches
        if stream is not None and stream.next_micro == micro_step and micro_step < stream.end:
            return stream
        self.close_data()
        tr = self.recipe.train
        cache = self.model.tower_cache
        builder = MicroBatchBuilder(
            self.train_set,
            self.tokenizer,
            self.encoders,
            self.sampler,
            start=micro_step,
            cache_keys=frozenset(cache) if cache is not None else None,
            collate_options=self.collate_options,
        )
        self._batches = BatchStream(
            builder,
            micro_step,
            max(tr.max_steps * tr.grad_accum_steps, micro_step + tr.grad_accum_steps),
            self.device,
            num_workers=self.num_workers,
            prefetch_factor=tr.prefetch_factor,
            seed=self.recipe.seed,
            cache=cache,
            say=_say if self.dist.is_main else None,
        )
        return self._batches

    def close_data(self) -> None:
        """Stop the loader workers (the next train_step starts new ones)."""
        if self._batches is not None:
            self._batches.close()
            self._batches = None

    def train_step(self) -> float:
        """One optimizer step (grad accumulation inside); returns the step's loss averaged over
        its micro-batches and ranks.

        One host sync per step (reading the loss once, after the last backward and before the
        optimizer step, so a non-finite loss stops the run before it reaches the weights); the
        micro-batch losses are summed on the device. The micro-batches come from the batch stream
        (loader.py): once a micro-step's kernels are queued, the next micro-batch is fetched from
        the loader workers and copied to the device on a side stream while the GPU works."""
        t0 = time.perf_counter()
        tr = self.recipe.train
        accum = tr.grad_accum_steps
        if not self.model.training:
            self.set_train_mode()
        stream = self._batch_stream(self.step * accum)
        total = None
        for k in range(accum):
            batch = stream.next()
            if batch.skipped:
                self._passed_over(batch.skipped)
            sync = k == accum - 1 or not self.dist.enabled
            with gradient_sync(self.train_module, sync):
                with self._autocast():
                    loss = self.train_module(batch)
                (loss / accum).backward()
            del batch
            total = loss.detach() if total is None else total + loss.detach()
            stream.prefetch()
        value = float(total) / accum
        stream.settle()
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
        value = mean_across_ranks(value, self.dist, self.device)
        self.timing.steps += 1
        self.timing.step_s += time.perf_counter() - t0
        self.timing.data_wait_s += stream.take_wait()
        return value

    def skipped_rows(self) -> int:
        """Malformed rows left out so far (data.skip_bad_rows): at load (every rank loads the same), and
        passed over in batches by any rank (each rank reads its own slice: a collective, called by every
        rank at the same step)."""
        return len(self.skipped_at_load) + len(union_across_ranks(self.skipped_seen, self.dist))

    def _passed_over(self, rows: tuple[str, ...]) -> None:
        fresh = [r for r in rows if r not in self.skipped_seen]
        if fresh and self.dist.is_main and not self.skipped_seen:
            _say(f"data.skip_bad_rows: passing over a row that fails when read: {fresh[0][:300]}")
        self.skipped_seen.update(fresh)

    @torch.no_grad()
    def held_out_loss(self) -> float | None:
        """Mean loss over the first `eval.loss_items` held-out items (every rank computes the same
        slice, so a DDP / FSDP forward stays in step); None without an eval set."""
        if self.eval_set is None or len(self.eval_set) == 0:
            return None
        n = min(self.recipe.eval.loss_items, len(self.eval_set))
        size = self.recipe.train.batch_size
        self.train_module.eval()  # train_step switches back
        total = None
        for start in range(0, n, size):
            examples = [self.eval_set[i] for i in range(start, min(n, start + size))]
            batch = collate_examples(examples, self.tokenizer, self.encoders, **self.collate_options)
            batch = batch.to(self.device)
            with self._autocast():
                loss = self.train_module(batch).detach() * len(examples)
            total = loss if total is None else total + loss
        return float(total) / n

    def _write_metrics(self, path: Path, row: dict) -> None:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def _artifacts(self) -> dict[str, Any]:
        eval_json = self.output_dir / "eval.json"
        loss_png = self.output_dir / "loss.png"
        return {
            "eval_json": str(eval_json) if eval_json.is_file() else None,
            "loss_png": str(loss_png) if loss_png.is_file() else None,
        }

    def _already_complete(self, metrics_path: Path, t0: float) -> dict[str, Any]:
        """A rerun of a finished run: say so, train nothing, report what the run left."""
        last = self.resumed_from
        losses = [r["loss"] for r in read_metrics(metrics_path) if "loss" in r]
        if self.dist.is_main:
            _say(
                f"run already complete: step {self.step} of train.max_steps={self.recipe.train.max_steps} "
                f"({last}); nothing to train. Raise train.max_steps to train further, or pass a new "
                f"--output-dir for a fresh run."
            )
            if self.setting_changes:
                _say("settings changed since that checkpoint:\n  " + "\n  ".join(self.setting_changes))
        summary: dict[str, Any] = {
            "already_complete": True,
            "steps": self.step,
            "final_loss": losses[-1] if losses else None,
            "checkpoint": str(last),
            "output_dir": str(self.output_dir),
            "resumed_from": str(last),
        }
        eval_json = self.output_dir / "eval.json"
        if self.dist.is_main and eval_json.is_file():
            summary["eval"] = json.loads(eval_json.read_text())
        elif self.dist.is_main and self.recipe.eval.enabled and self.eval_set is not None:
            summary["eval"] = evaluate_checkpoint(  # verified when the run resumed from it
                last, self.eval_set, self.recipe.eval, self.device, eval_json, verify=False
            )
        barrier(self.dist)
        summary.update(self._artifacts(), elapsed_s=round(time.perf_counter() - t0, 2))
        return summary

    def run(self) -> dict[str, Any]:
        tr = self.recipe.train
        t0 = time.perf_counter()
        metrics_path = self.output_dir / "metrics.jsonl"
        if self.dist.is_main:
            dump_recipe(self.recipe, self.output_dir / "recipe.yaml")
            _truncate_metrics(metrics_path, self.step)
        if self.resumed_from is not None and self.step >= tr.max_steps:
            return self._already_complete(metrics_path, t0)
        if self.dist.is_main and self.resumed_from is not None:
            _say(f"resumed from step {self.step} ({self.resumed_from})")
            if self.setting_changes:
                _say("settings changed since that checkpoint:\n  " + "\n  ".join(self.setting_changes))
        bar = None
        if self.dist.is_main and tr.progress:
            bar = tqdm(total=tr.max_steps, initial=self.step, desc=f"train {self.recipe.name}", unit="step")
        global_batch = tr.batch_size * tr.grad_accum_steps * self.dist.world_size
        eval_every = self.recipe.eval.every
        steps_done = 0
        last_loss = math.nan
        logged = (self.timing.step_s, self.timing.data_wait_s)
        try:
            while self.step < tr.max_steps:
                lr = self.optimizer.param_groups[0]["lr"]
                last_loss = self.train_step()
                steps_done += 1
                log_now = self.step % tr.log_every == 0 or self.step == tr.max_steps
                skipped = self.skipped_rows() if log_now and self.recipe.data.get("skip_bad_rows") else None
                if self.dist.is_main and log_now:
                    elapsed = time.perf_counter() - t0
                    step_s = self.timing.step_s - logged[0]
                    wait_s = self.timing.data_wait_s - logged[1]
                    logged = (self.timing.step_s, self.timing.data_wait_s)
                    row = {
                        "step": self.step,
                        "loss": round(last_loss, 6),
                        "lr": lr,
                        "samples_per_s": round(steps_done * global_batch / max(elapsed, 1e-9), 2),
                        # share of the step time (since the last row) spent waiting for data
                        "data_wait_pct": round(100 * wait_s / max(step_s, 1e-9), 2),
                    }
                    if skipped is not None:
                        row["skipped_rows"] = skipped
                    self._write_metrics(metrics_path, row)
                if eval_every and self.step % eval_every == 0:
                    held_out = self.held_out_loss()
                    if held_out is not None and self.dist.is_main:
                        self._write_metrics(
                            metrics_path, {"step": self.step, "eval_loss": round(held_out, 6)}
                        )
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{last_loss:.4f}", lr=f"{lr:.2e}")
                if tr.checkpoint_every and self.step % tr.checkpoint_every == 0 and self.step < tr.max_steps:
                    self.save_checkpoint()
            if bar is not None:
                bar.close()
                bar = None
            self.close_data()
            final = self.save_checkpoint()
        except KeyboardInterrupt:
            if bar is not None:
                bar.close()
            raise TrainingInterrupted(self.step, ckpt_io.latest_checkpoint(self.output_dir)) from None
        finally:
            self.close_data()
        summary: dict[str, Any] = {
            "steps": self.step,
            "final_loss": last_loss if math.isfinite(last_loss) else None,
            "checkpoint": str(final),
            "output_dir": str(self.output_dir),
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
        }
        if self.recipe.data.get("skip_bad_rows"):
            summary["skipped_rows"] = self.skipped_rows()
        if self.dist.is_main:
            plot_loss(metrics_path, self.output_dir / "loss.png", title=self.recipe.name)
            if self.recipe.eval.enabled and self.eval_set is not None:
                summary["eval"] = evaluate_checkpoint(  # hashed into its manifest by this process
                    final, self.eval_set, self.recipe.eval, self.device, self.output_dir / "eval.json",
                    verify=False,
                )
        barrier(self.dist)
        summary.update(self._artifacts(), elapsed_s=round(time.perf_counter() - t0, 2))
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


def _skipped(dataset: Any) -> list[str]:
    """The rows a data set left out when it loaded (data.skip_bad_rows), "file:line: why" each."""
    rows = getattr(dataset, "skipped", None) if dataset is not None else None
    return list(rows) if isinstance(rows, list) else []


def merged_state_dict(llm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The (unsharded) LLM's state dict with every LoRA layer folded in (see
    checkpoint.merged_llm_state)."""
    return ckpt_io.merged_llm_state(llm, dict(llm.state_dict()))


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics past the step we resume from, so a resumed run's curve has no duplicates."""
    ckpt_io.truncate_metrics(path, step)


def check_resume(recipe: Node, output_dir: str | Path, force: bool = False) -> list[str]:
    """Before a run resumes: the keys that differ from the newest checkpoint's recipe, as lines
    "key: old -> new". A change of model, encoder architecture or data (the keys of
    FROZEN_ON_RESUME) raises ResumeMismatch unless `force`; other changes are only reported."""
    if not recipe.train.resume:
        return []
    last = ckpt_io.latest_checkpoint(output_dir)
    saved = last / "recipe.yaml" if last is not None else None
    if saved is None or not saved.is_file():
        return []
    old = load_yaml(saved.read_text()) or {}
    changes = recipe_changes(old, recipe.to_dict())
    lines = [describe_change(*c) for c in changes]
    frozen = frozen_changes(changes)
    if frozen and not force:
        raise ResumeMismatch(
            f"{output_dir} holds a run whose checkpoint {last.name} was trained with other settings "
            f"of {', '.join(p.rstrip('.') for p in FROZEN_ON_RESUME)}; resuming would mix them:\n  "
            + "\n  ".join(describe_change(*c) for c in changes if c[0] in frozen)
            + "\nUse another --output-dir, restore the settings, or pass --force to resume anyway."
        )
    return lines


def train(recipe: Node, output_dir: str | Path | None = None, force: bool = False) -> dict[str, Any]:
    """Run a recipe end to end (what `bridge train` calls). Resuming with changed settings prints
    them (and refuses model / encoder / data changes unless `force`) before anything is written."""
    t0 = time.perf_counter()
    out = Path(output_dir) if output_dir else default_output_dir(recipe)
    changes = check_resume(recipe, out, force=force)
    with _quiet_hf_progress():
        trainer = Trainer(recipe, out)
        trainer.setting_changes = changes
        try:
            summary = trainer.run()
        except BaseException:
            shutdown(trainer.dist, finished=False)
            raise
        shutdown(trainer.dist)
    summary["elapsed_s"] = round(time.perf_counter() - t0, 2)  # set-up and evaluation included
    return summary
