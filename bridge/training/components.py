"""Recipe -> the parts a run needs: the base LLM directory, the LLM, its tokenizer, the encoder,
and which of their parameters train in the chosen stage.

Shared by the trainer and by `Bridge.from_recipe`, so both see the same LLM and encoder.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bridge.atomic_files import remove_stale_temps, replacing_dir
from bridge.dtypes import DTYPES
from bridge.training.lora import apply_lora
from encoders.api import build_encoder


def dataset_vocab_words(dataset) -> list[str]:
    words = getattr(dataset, "vocab_words", None)
    return list(words()) if callable(words) else []


def model_dir_problem(path: Path) -> str | None:
    """Why `path` is not a complete model folder (None when it is): config.json, tokenizer files
    and weights present and whole (`check_model_files` reads their headers)."""
    from runner.worker.model_files import check_model_files

    if not path.is_dir():
        return "missing"
    try:
        check_model_files(str(path))
    except ValueError as exc:
        return str(exc)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (path / name).is_file():
            return f"{path / name}: missing"
    if not any(path.glob("*.safetensors")):
        return f"{path}: no *.safetensors weights"
    return None


def prepare_llm_dir(recipe, output_dir: str | Path, vocab_words: list[str], build: bool = True,
                    say: Callable[[str], None] | None = None) -> Path:
    """The local HF dir of the base LLM: `model.path`, or the tiny model built into
    OUTPUT/base_model (vocab_words defaults to the dataset's target words). `build=False` only
    computes the path (other ranks wait for rank 0 to build it).

    The tiny model is written into a temp folder renamed into place when complete, so a run killed
    while writing it leaves no base_model. One left half-written by an older Bridge (a 0-byte
    config.json, missing weights) is rebuilt, not reused: the same seed and words give the same
    weights, so checkpoints made on the first one still fit. `say` reports the rebuild."""
    if recipe.model.path:
        return Path(recipe.model.path)
    target = Path(output_dir) / "base_model"
    if not build:
        return target
    remove_stale_temps(target)
    problem = model_dir_problem(target)
    if problem is None:
        return target
    if problem != "missing" and say is not None:
        say(f"rebuilding {target}: it is incomplete ({problem[:300]}); a run was stopped while writing it")
    from bridge.tiny_models import build_tiny_model

    kwargs = copy.deepcopy(dict(recipe.model.tiny))
    kwargs.setdefault("vocab_words", vocab_words)
    kwargs.setdefault("seed", recipe.seed)
    if "dtype" in kwargs:
        kwargs["dtype"] = DTYPES[kwargs["dtype"]]
    try:
        with replacing_dir(target) as tmp:
            build_tiny_model(tmp, **kwargs)
    except TypeError as exc:
        raise ValueError(f"model.tiny: {exc}") from exc
    return target


def load_llm(llm_dir: str | Path, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llm_dir))
    llm = AutoModelForCausalLM.from_pretrained(str(llm_dir), dtype=DTYPES[dtype])
    return llm, tokenizer


def encoder_config(recipe, hidden_size: int) -> dict:
    cfg = copy.deepcopy(dict(recipe.encoder))
    cfg.setdefault("imports", list(recipe.get("imports") or []))  # recorded in the checkpoint
    given = cfg.setdefault("llm_hidden_size", hidden_size)
    if given != hidden_size:
        raise ValueError(f"encoder.llm_hidden_size is {given} but the LLM's hidden size is {hidden_size}")
    return cfg


def build_recipe_encoder(recipe, hidden_size: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        return build_encoder(encoder_config(recipe, hidden_size))


@dataclass
class StagePlan:
    """What trains: resolved from the stage and the per-part flags."""

    tower: bool
    projector: bool
    llm_full: bool
    lora: bool

    @property
    def llm_changes(self) -> bool:
        return self.llm_full or self.lora


def stage_plan(recipe) -> StagePlan:
    t = recipe.train.trainable
    llm_full = bool(t.llm) if t.llm is not None else False
    lora = recipe.train.lora.enabled
    if lora is None:
        lora = recipe.stage == "finetune" and not llm_full
    return StagePlan(
        tower=bool(t.tower) if t.tower is not None else False,
        projector=bool(t.projector) if t.projector is not None else True,
        llm_full=llm_full,
        lora=bool(lora),
    )


def apply_stage(plan: StagePlan, encoder, llm, lora_cfg) -> None:
    """Set requires_grad per part; wrap LoRA layers; upcast trainable LLM weights to fp32 (AdamW
    on bf16 weights loses small updates)."""
    encoder.set_trainable(tower=plan.tower, projector=plan.projector)
    llm.requires_grad_(plan.llm_full)
    if plan.llm_full:
        llm.float()
    if plan.lora:
        apply_lora(llm, lora_cfg.targets, lora_cfg.rank, float(lora_cfg.alpha), float(lora_cfg.dropout))
    if not any(p.requires_grad for p in list(encoder.parameters()) + list(llm.parameters())):
        raise ValueError("nothing to train: train.trainable leaves every part frozen and LoRA is off")
