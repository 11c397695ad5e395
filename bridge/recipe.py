"""Recipe YAML: the schema, its documented defaults, validation and `key.sub=value` overrides.

A recipe is the one file a research team edits to train an encoder against an LLM. Mistakes in
it should fail at load time with a message that says exactly where, not ten minutes into a run:
an unknown key names its dotted path and the nearest valid key; a file that does not exist is
named; a value of the wrong type or outside its choices says what was expected.

The schema is plain data (`SCHEMA`): nested dicts of `Field`s. Two sections are free-form on
purpose because another layer owns their validation: `encoder` (handed as-is to
`encoders.api.build_encoder`) and `model.tiny` (keyword arguments of
`bridge.tiny_models.build_tiny_model`). `describe_schema()` renders every key with its default
and doc (`bridge defaults` prints it), so the defaults are documented in one place.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

_MISSING = object()


@dataclass(frozen=True)
class Field:
    """One leaf of the schema.

    `types` are the accepted Python types (None in `types` allows null); `choices` restricts
    values; `is_path` makes validation check that the named file or directory exists;
    `free_form` accepts any mapping (validated downstream).
    """

    default: Any
    doc: str
    types: tuple = (str,)
    choices: tuple | None = None
    is_path: bool = False
    free_form: bool = False


_NUM = (int, float)
_OPT_BOOL = (bool, type(None))

SCHEMA: dict[str, Any] = {
    "name": Field("bridge-run", "Run name; the default output dir is runs/<name>."),
    "seed": Field(0, "Seeds model init, data generation and the data order.", (int,)),
    "output_dir": Field(
        None, "Where metrics, checkpoints and eval go (CLI --output-dir wins).", (str, type(None))
    ),
    "stage": Field(
        "align",
        "align: LLM frozen, projector trained. finetune: projector + LoRA on the "
        "LLM (or the whole LLM with train.trainable.llm=true).",
        (str,),
        ("align", "finetune"),
    ),
    "model": {
        "path": Field(
            None,
            "Local Hugging Face model directory (config.json, safetensors, tokenizer).",
            (str, type(None)),
            is_path=True,
        ),
        "tiny": Field(
            None,
            "Instead of `path`: keyword arguments of bridge.tiny_models.build_tiny_model; "
            "the tiny LLM is built into OUTPUT/base_model. vocab_words defaults to the words "
            "of the dataset's targets.",
            (dict, type(None)),
            free_form=True,
        ),
        "dtype": Field(
            "float32",
            "dtype the LLM is loaded in (trainable params stay float32).",
            (str,),
            ("float32", "bfloat16", "float16"),
        ),
    },
    "encoder": Field(
        None,
        "Encoder config handed to encoders.api.build_encoder (tower + projector). "
        "The projector's output size defaults to the LLM's hidden size.",
        (dict,),
        free_form=True,
    ),
    "data": {
        "source": Field(
            "jsonl",
            "jsonl, or a built-in synthetic set: shapes, tones, graphs.",
            (str,),
            ("jsonl", "shapes", "tones", "graphs"),
        ),
        "train": Field(None, "JSONL training rows (source=jsonl).", (str, type(None)), is_path=True),
        "eval": Field(None, "JSONL held-out rows (source=jsonl).", (str, type(None)), is_path=True),
        "media_root": Field(
            None,
            "Directory media paths in JSONL rows are relative to (default: the JSONL file's directory).",
            (str, type(None)),
            is_path=True,
        ),
        "prompt": Field(
            "<image>",
            "Prompt template: text with placeholders (<image>, <audio>, <graph>) "
            "and optional {field} references to the row.",
            (str,),
        ),
        "target_field": Field("text", "Row field holding the target text.", (str,)),
        "num_train": Field(2000, "Synthetic sets: number of training items.", (int,)),
        "num_eval": Field(200, "Synthetic sets: number of held-out items.", (int,)),
        "options": Field({}, "Synthetic sets: generator options (e.g. image_size).", (dict,), free_form=True),
    },
    "train": {
        "trainable": {
            "tower": Field(None, "Train the encoder tower (null: stage default, false).", _OPT_BOOL),
            "projector": Field(None, "Train the projector (null: stage default, true).", _OPT_BOOL),
            "llm": Field(
                None,
                "Train all LLM weights (null: stage default, false; finetune then uses LoRA).",
                _OPT_BOOL,
            ),
        },
        "lora": {
            "enabled": Field(
                None, "LoRA on the LLM (null: on for finetune unless trainable.llm).", _OPT_BOOL
            ),
            "rank": Field(8, "LoRA rank.", (int,)),
            "alpha": Field(16.0, "LoRA alpha (scale = alpha / rank).", _NUM),
            "dropout": Field(0.0, "Dropout on the LoRA input.", _NUM),
            "targets": Field(
                ["q_proj", "v_proj"],
                "Linear module names to adapt ('all-linear' for every linear layer of the decoder).",
                (list, str),
            ),
        },
        "batch_size": Field(16, "Micro-batch size per rank.", (int,)),
        "grad_accum_steps": Field(1, "Micro-batches per optimizer step.", (int,)),
        "max_steps": Field(500, "Optimizer steps.", (int,)),
        "lr": Field(1e-3, "Peak learning rate (AdamW).", _NUM),
        "llm_lr": Field(None, "Learning rate of LLM weights / LoRA (null: lr).", (int, float, type(None))),
        "weight_decay": Field(0.0, "AdamW weight decay.", _NUM),
        "betas": Field([0.9, 0.999], "AdamW betas.", (list,)),
        "grad_clip": Field(1.0, "Max global grad norm (0: off).", _NUM),
        "schedule": Field("cosine", "LR schedule after warmup.", (str,), ("cosine", "linear", "constant")),
        "warmup_steps": Field(0, "Linear warmup steps.", (int,)),
        "min_lr_ratio": Field(0.0, "Final LR as a fraction of the peak (cosine/linear).", _NUM),
        "precision": Field(
            "fp32", "fp32, or bf16 autocast (trainable weights stay fp32).", (str,), ("fp32", "bf16")
        ),
        "device": Field("auto", "auto (cuda if present), cpu or cuda.", (str,), ("auto", "cpu", "cuda")),
        "distributed": Field(
            "auto",
            "Multi-rank wrapper (torchrun / --nproc): ddp replicates the model on every rank; fsdp "
            "shards weights, gradients and optimizer state (FSDP2, one unit per decoder layer). "
            "auto: fsdp when the LLM's full weights train (train.trainable.llm), else ddp.",
            (str,),
            ("auto", "ddp", "fsdp"),
        ),
        "mixed_precision": Field(
            "none",
            "FSDP2 only (train.distributed fsdp): bf16 all-gathers and computes the decoder layers in "
            "bf16 while the sharded fp32 weights train and gradients reduce in fp32.",
            (str,),
            ("none", "bf16"),
        ),
        "cache_tower_outputs": Field(
            False,
            "Keep a frozen tower's outputs per training item in device memory and run only the "
            "projector when an item comes back: epochs after the first skip preprocessing and the "
            "tower. Memory: items x rows x tower width. Needs a frozen, non-streaming tower.",
            (bool,),
        ),
        "cpu_threads": Field(
            0,
            "torch CPU threads (0: torch's default). Tiny models train several times faster with 1 "
            "thread, and far faster when other processes share the cores.",
            (int,),
        ),
        "log_every": Field(10, "Write metrics every N optimizer steps.", (int,)),
        "checkpoint_every": Field(0, "Checkpoint every N optimizer steps (0: only at the end).", (int,)),
        "keep_checkpoints": Field(0, "Keep only the newest N checkpoints (0: keep all).", (int,)),
        "resume": Field(
            True, "Resume from the newest checkpoint in the output dir if there is one.", (bool,)
        ),
        "progress": Field(True, "Show a progress bar.", (bool,)),
    },
    "eval": {
        "enabled": Field(True, "Evaluate at the end through runner.LLM with prompt embeds.", (bool,)),
        "num_items": Field(200, "Held-out items to evaluate (capped by the eval set).", (int,)),
        "max_tokens": Field(16, "Max new tokens per item.", (int,)),
        "num_samples": Field(10, "Sample generations stored in eval.json.", (int,)),
        "enforce_eager": Field(False, "Passed to runner.LLM (no CUDA graphs).", (bool,)),
        "backend": Field(
            None,
            "null: evaluate in-process. An http(s):// URL: generate on that vLLM-compatible server "
            "(vLLM --enable-prompt-embeds, or bridge serve) running the same base LLM; encoders stay here.",
            (str, type(None)),
        ),
    },
}


class RecipeError(ValueError):
    """A recipe that cannot run, with the dotted path of the offending key in the message."""


class Node(dict):
    """A validated recipe section: a dict that also allows attribute access (`recipe.train.lr`)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as exc:
            raise AttributeError(key) from exc

    def to_dict(self) -> dict:
        return {k: (v.to_dict() if isinstance(v, Node) else copy.deepcopy(v)) for k, v in self.items()}


def _all_paths(schema: Mapping, prefix: str = "") -> list[str]:
    out = []
    for key, val in schema.items():
        path = f"{prefix}{key}"
        out.append(path)
        if isinstance(val, dict):
            out.extend(_all_paths(val, path + "."))
    return out


def _nearest(key: str, prefix: str, schema_level: Mapping) -> str | None:
    """Nearest valid key: a close sibling first, else a close dotted path anywhere in the schema."""
    close = difflib.get_close_matches(key, list(schema_level), n=1, cutoff=0.5)
    if close:
        return prefix + close[0]
    paths = _all_paths(SCHEMA)
    leaf_hits = [p for p in paths if difflib.get_close_matches(key, [p.rsplit(".", 1)[-1]], cutoff=0.75)]
    if leaf_hits:
        return min(leaf_hits, key=len)
    close = difflib.get_close_matches(prefix + key, paths, n=1, cutoff=0.5)
    return close[0] if close else None


def _type_name(types: tuple) -> str:
    names = {
        int: "int",
        float: "float",
        str: "string",
        bool: "bool",
        list: "list",
        dict: "mapping",
        type(None): "null",
    }
    return " or ".join(names.get(t, t.__name__) for t in types)


def _check_leaf(path: str, field: Field, value: Any) -> Any:
    if isinstance(value, bool) and bool not in field.types:
        raise RecipeError(f"{path}: expected {_type_name(field.types)}, got bool {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and float in field.types:
        value = float(value)
    if not isinstance(value, field.types):
        raise RecipeError(f"{path}: expected {_type_name(field.types)}, got {type(value).__name__} {value!r}")
    if field.choices is not None and value not in field.choices:
        raise RecipeError(f"{path}: {value!r} is not one of {list(field.choices)}")
    if field.is_path and value is not None and not Path(os.path.expanduser(value)).exists():
        raise RecipeError(f"{path}: file or directory not found: {value}")
    if field.is_path and value is not None:
        value = str(Path(os.path.expanduser(value)).resolve())
    return copy.deepcopy(value)


def _validate_level(raw: Mapping, schema: Mapping, prefix: str) -> Node:
    if not isinstance(raw, Mapping):
        raise RecipeError(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {type(raw).__name__}")
    for key in raw:
        if key not in schema:
            hint = _nearest(str(key), prefix, schema)
            msg = f"unknown key '{prefix}{key}'"
            raise RecipeError(msg + (f" (did you mean '{hint}'?)" if hint else ""))
    out = Node()
    for key, spec in schema.items():
        path = prefix + key
        if isinstance(spec, dict):
            out[key] = _validate_level(raw.get(key) or {}, spec, path + ".")
        else:
            value = raw.get(key, _MISSING)
            out[key] = copy.deepcopy(spec.default) if value is _MISSING else _check_leaf(path, spec, value)
    return out


def _check_semantics(r: Node) -> None:
    """Cross-field rules that a per-key schema cannot express."""
    if (r.model.path is None) == (r.model.tiny is None):
        raise RecipeError("model: set exactly one of model.path (a local HF model dir) or model.tiny")
    if r.encoder is None:
        raise RecipeError("encoder: missing (the encoder config for encoders.api.build_encoder)")
    if r.data.source == "jsonl" and r.data.train is None:
        raise RecipeError("data.train: required when data.source is jsonl")
    positive = {
        "train.batch_size": r.train.batch_size,
        "train.grad_accum_steps": r.train.grad_accum_steps,
        "train.max_steps": r.train.max_steps,
        "train.lora.rank": r.train.lora.rank,
        "eval.max_tokens": r.eval.max_tokens,
        "train.log_every": r.train.log_every,
    }
    for path, value in positive.items():
        if value < 1:
            raise RecipeError(f"{path}: must be >= 1, got {value}")
    for path, value in {
        "train.checkpoint_every": r.train.checkpoint_every,
        "train.warmup_steps": r.train.warmup_steps,
        "data.num_train": r.data.num_train,
        "data.num_eval": r.data.num_eval,
        "eval.num_items": r.eval.num_items,
        "train.keep_checkpoints": r.train.keep_checkpoints,
        "train.cpu_threads": r.train.cpu_threads,
    }.items():
        if value < 0:
            raise RecipeError(f"{path}: must be >= 0, got {value}")
    if r.train.lr <= 0:
        raise RecipeError(f"train.lr: must be > 0, got {r.train.lr}")
    if len(r.train.betas) != 2 or not all(isinstance(b, (int, float)) for b in r.train.betas):
        raise RecipeError(f"train.betas: expected two numbers, got {r.train.betas!r}")
    if not 0 <= r.train.min_lr_ratio <= 1:
        raise RecipeError(f"train.min_lr_ratio: must be in [0, 1], got {r.train.min_lr_ratio}")
    if r.train.lora.enabled and r.train.trainable.llm:
        raise RecipeError(
            "train.lora.enabled and train.trainable.llm are exclusive: LoRA adapts a frozen LLM"
        )
    if r.eval.backend is not None and not r.eval.backend.startswith(("http://", "https://")):
        raise RecipeError(f"eval.backend: expected null or an http(s):// URL, got {r.eval.backend[:200]!r}")
    if r.stage == "align" and (r.train.trainable.llm or r.train.lora.enabled):
        raise RecipeError("stage align keeps the LLM frozen: use stage finetune to train the LLM or LoRA")


def validate(raw: Mapping) -> Node:
    """Check a raw recipe mapping against the schema and fill in defaults."""
    recipe = _validate_level(raw, SCHEMA, "")
    _check_semantics(recipe)
    return recipe


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=3e-4` -> (["train", "lr"], 3e-4); the value is read as YAML (so types are kept)."""
    if "=" not in text:
        raise RecipeError(f"override {text!r}: expected key.sub=value")
    key, _, value = text.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"override {text!r}: empty key segment")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise RecipeError(f"override {text!r}: value is not valid YAML: {exc}") from exc
    # YAML 1.1 reads "1e-3" as a string; a number is what anyone writing it means.
    if isinstance(parsed, str):
        try:
            parsed = float(parsed) if any(c in parsed for c in ".eE") else parsed
        except ValueError:
            pass
    return parts, parsed


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Apply `key.sub=value` overrides to a raw recipe mapping (a copy); validation comes after."""
    out = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise RecipeError(f"override {text!r}: '{'.'.join(parts[: i + 1])}' is not a mapping")
            node = nxt
        node[parts[-1]] = value
    return out


def _read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping at the top level")
    return data


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Node:
    """Read, override and validate a recipe YAML file."""
    return validate(apply_overrides(_read_yaml(path), overrides))


def dump_recipe(recipe: Mapping, path: str | os.PathLike) -> None:
    data = recipe.to_dict() if isinstance(recipe, Node) else dict(recipe)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


def describe_schema(schema: Mapping | None = None, prefix: str = "") -> str:
    """Every key with its default and doc, one per line (what `bridge defaults` prints)."""
    lines = []
    for key, spec in (schema or SCHEMA).items():
        if isinstance(spec, dict):
            lines.append(describe_schema(spec, f"{prefix}{key}."))
        else:
            choices = f" [{'|'.join(spec.choices)}]" if spec.choices else ""
            lines.append(f"{prefix}{key} = {spec.default!r}{choices}  # {spec.doc}")
    return "\n".join(lines)
