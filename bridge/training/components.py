"""Recipe -> the parts a run needs: the base LLM directory, the LLM, its tokenizer, the encoder,
and which of their parameters train in the chosen stage.

Shared by the trainer and by `Bridge.from_recipe`, so both see the same LLM and encoder.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from bridge.dtypes import DTYPES
from bridge.training.lora import apply_lora
from encoders.api import build_encoder


def dataset_vocab_words(dataset) -> list[str]:
    words = getattr(dataset, "vocab_words", None)
    return list(words()) if callable(words) else []


def prepare_llm_dir(recipe, output_dir: str | Path, vocab_words: list[str], build: bool = True) -> Path:
    """The local HF dir of the base LLM: `model.path`, or the tiny model built into
    OUTPUT/base_model (vocab_words defaults to the dataset's target words). `build=False` only
    computes the path (other ranks wait for rank 0 to build it)."""
    if recipe.model.path:
        return Path(recipe.model.path)
    target = Path(output_dir) / "base_model"
    if build and not (target / "config.json").is_file():
        from bridge.tiny_models import build_tiny_model

        kwargs = copy.deepcopy(dict(recipe.model.tiny))
        kwargs.setdefault("vocab_words", vocab_words)
        kwargs.setdefault("seed", recipe.seed)
        if "dtype" in kwargs:
            kwargs["dtype"] = DTYPES[kwargs["dtype"]]
        try:
            build_tiny_model(target, **kwargs)
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
