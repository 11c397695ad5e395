"""Recipe YAML: the schema, its documented defaults, validation and `key.sub=value` overrides.

A recipe is the one file a research team edits to train an encoder against an LLM. Mistakes in
it should fail at load time, all of them at once, each with its dotted key path, before anything
is written: an unknown key names the nearest valid key; a file that does not exist is named by
its resolved path; a value of the wrong type, outside its choices or outside a sane range says
what was expected; the encoder section is built once to find its mistakes too.

Relative paths in a recipe resolve against the recipe file's folder (as JSONL media paths resolve
against the JSONL file); relative paths given as command-line overrides resolve against the
current directory, where the shell user typed them.

The schema is plain data (`SCHEMA`): nested dicts of `Field`s. `encoder` is checked by
`encoders.encoder_config_problems`; `model.tiny` against `TINY_MODEL_KEYS` (the keyword arguments
of the tiny-model builder). `describe_schema()` renders every key with its default and doc
(`bridge defaults` prints it), so the defaults are documented in one place.
"""

from __future__ import annotations

import copy
import difflib
import errno
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bridge.atomic_files import write_text_atomic

# The encoders package (torch, torchvision, the built-in towers) is imported by the functions that
# build or look up parts, not here: `bridge --help` and `bridge defaults` read the schema without it.

_MISSING = object()


class _RecipeLoader(yaml.SafeLoader):
    """`yaml.safe_load` with YAML 1.2's floats. PyYAML follows YAML 1.1, where a float needs a dot
    and a signed exponent, so `3e-3`, `5E-5` and `1.5e3` would stay strings; whoever writes them in
    a recipe means numbers, as on the command line. Every other scalar resolves as before."""


_RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)


def load_yaml(text: str) -> Any:
    """Recipe YAML text -> Python data, numbers read as YAML 1.2 reads them (see `_RecipeLoader`)."""
    return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506  a SafeLoader subclass
#: bound on echoed values in messages (a recipe value may be huge)
_ECHO = 120
#: llm_hidden_size used to check an encoder section when the LLM's is unknown (a broken model key)
_PROBE_HIDDEN = 8
SYNTHETIC_SOURCES = ("shapes", "tones", "graphs")
#: sources read from the user's files (data.train / data.eval)
FILE_SOURCES = ("jsonl", "llava", "hf", "webdataset")
#: sources whose data.train / data.eval may be a brace or glob pattern of several files
PATTERN_SOURCES = ("hf", "webdataset")
#: data.columns keys: what a row's columns (hf) or a sample's files (webdataset) are read as
COLUMN_ROLES = ("image", "audio", "graph", "text", "prompt")


@dataclass(frozen=True)
class Field:
    """One leaf of the schema.

    `types` are the accepted Python types (None in `types` allows null); `choices` restricts
    values (`references` also allows a "package.module:ClassName" string); `lo`/`hi` bound
    numbers (`lo_open`: strictly greater than `lo`), and floats must be finite; `is_path` resolves
    a relative path against the recipe's folder and (with `must_exist`) checks it exists;
    `free_form` accepts any mapping (validated elsewhere).
    """

    default: Any
    doc: str
    types: tuple = (str,)
    choices: tuple | None = None
    is_path: bool = False
    free_form: bool = False
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    must_exist: bool = True
    references: bool = False
    #: a path that may be a brace / glob pattern (checked against data.source after the leaf check)
    pattern: bool = False


#: the largest micro-batch / accumulation / loss slice a recipe may ask for: far past any real run,
#: small enough that a typo (an extra three zeros) fails at once instead of growing memory for minutes
MAX_BATCH = 65536

#: model.tiny keys -> (types, lo, hi or choices): the tiny-model builder's keyword arguments
TINY_MODEL_KEYS: dict[str, tuple] = {
    "family": ((str,), ("llama", "qwen2", "qwen3", "qwen2_vl")),
    "seed": ((int,), 0, 2**63 - 1),
    "hidden_size": ((int,), 1, 65536),
    "num_layers": ((int,), 1, 512),
    "num_heads": ((int,), 1, 1024),
    "num_kv_heads": ((int,), 1, 1024),
    "head_dim": ((int,), 1, 4096),
    "intermediate_size": ((int,), 1, 1 << 20),
    "vocab_words": ((list,),),
    "max_position_embeddings": ((int,), 1, 1 << 22),
    "tie_word_embeddings": ((bool,),),
    "dtype": ((str,), ("float32", "bfloat16", "float16")),
}
#: the tiny-model builder's default hidden size (when model.tiny does not set one)
TINY_DEFAULT_HIDDEN = 64
#: encoder tower keys that hold file or directory paths (resolved like the recipe's own paths)
ENCODER_PATH_KEYS = ("pretrained", "path", "checkpoint")

_NUM = (int, float)
_OPT_BOOL = (bool, type(None))

SCHEMA: dict[str, Any] = {
    "name": Field("bridge-run", "Run name; the default output dir is runs/<name>."),
    "seed": Field(0, "Seeds model init, data generation and the data order.", (int,), lo=0, hi=2**63 - 1),
    "imports": Field(
        [],
        "Modules to import before anything is built (they register custom towers, projectors, "
        "preprocessors, datasets): module names, or .py paths relative to the recipe file.",
        (list,),
    ),
    "output_dir": Field(
        None,
        "Where metrics, checkpoints and eval go (CLI --output-dir wins; relative: to the recipe).",
        (str, type(None)),
        is_path=True,
        must_exist=False,
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
            "of the dataset's targets. Keys: " + ", ".join(sorted(TINY_MODEL_KEYS)) + ".",
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
        "The projector's output size defaults to the LLM's hidden size. A part's name may be a "
        "registered name or 'package.module:ClassName'.",
        (dict,),
        free_form=True,
    ),
    "data": {
        "source": Field(
            "jsonl",
            "jsonl (rows with a caption and media paths), llava (LLaVA's conversation JSON / JSONL), hf "
            "(a local Hugging Face datasets folder or parquet files), webdataset (local tar shards), a "
            "built-in synthetic set (shapes, tones, graphs), or 'package.module:ClassName' of a dataset "
            "class taking (num_items, seed=, split=, prompt=, **options).",
            (str,),
            (*FILE_SOURCES, *SYNTHETIC_SOURCES),
            references=True,
        ),
        "train": Field(
            None,
            "Training data (file sources): a JSONL / LLaVA JSON file; for hf a save_to_disk folder or a "
            "parquet file; for webdataset a tar shard. hf and webdataset take a brace pattern "
            "(shards/train-{00000..00099}.tar) or a glob (parquet/*.parquet) too.",
            (str, type(None)),
            is_path=True,
            pattern=True,
        ),
        "eval": Field(
            None, "Held-out data, in the same form as data.train.", (str, type(None)), is_path=True,
            pattern=True,
        ),
        "media_root": Field(
            None,
            "Directory media paths in rows are relative to (default: the data file's directory).",
            (str, type(None)),
            is_path=True,
        ),
        "prompt": Field(
            None,
            "Prompt template: text with placeholders (<image>, <audio>, <graph>) and optional {field} "
            "references to the row. For llava the format of each human turn ({value} is its text), used "
            "when the tokenizer has no chat template. null: '{value}' for llava, else '<image>'.",
            (str, type(None)),
        ),
        "target_field": Field(
            "text", "Row field holding the target text (webdataset: the field of KEY.json).", (str,)
        ),
        "columns": Field(
            {},
            "hf: the dataset's column for each role, e.g. {image: img, text: caption} (roles: "
            + ", ".join(COLUMN_ROLES)
            + "; default: the role's own name, text: data.target_field). webdataset: the file "
            "extension for a role, e.g. {image: jpg, text: caption.txt}.",
            (dict,),
            free_form=True,
        ),
        "skip_bad_rows": Field(
            False,
            "false: a malformed row stops the run before it starts, naming file:line (or shard:key). "
            "true: such rows are skipped and counted (skipped_rows in metrics.jsonl and the summary); a "
            "file that cannot be read still stops the run.",
            (bool,),
        ),
        "truncate": Field(
            False,
            "A target longer than the model's context: false refuses the run before it starts, naming "
            "file:line; true cuts each such target (at a token boundary, EOS kept) so that prompt and "
            "target fit the context, and says how many were cut.",
            (bool,),
        ),
        "num_train": Field(2000, "Synthetic sets: number of training items.", (int,), lo=0, hi=10**7),
        "num_eval": Field(200, "Synthetic sets: number of held-out items.", (int,), lo=0, hi=10**7),
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
            "rank": Field(8, "LoRA rank.", (int,), lo=1, hi=4096),
            "alpha": Field(16.0, "LoRA alpha (scale = alpha / rank).", _NUM, lo=0, hi=1e6, lo_open=True),
            "dropout": Field(0.0, "Dropout on the LoRA input.", _NUM, lo=0, hi=0.99),
            "targets": Field(
                ["q_proj", "v_proj"],
                "Linear module names to adapt ('all-linear' for every linear layer of the decoder).",
                (list, str),
            ),
        },
        "batch_size": Field(16, "Micro-batch size per rank.", (int,), lo=1, hi=MAX_BATCH),
        "grad_accum_steps": Field(1, "Micro-batches per optimizer step.", (int,), lo=1, hi=MAX_BATCH),
        "max_steps": Field(500, "Optimizer steps.", (int,), lo=1, hi=10**9),
        "lr": Field(1e-3, "Peak learning rate (AdamW).", _NUM, lo=0, hi=10, lo_open=True),
        "llm_lr": Field(
            None,
            "Learning rate of LLM weights / LoRA (null: lr).",
            (int, float, type(None)),
            lo=0,
            hi=10,
            lo_open=True,
        ),
        "weight_decay": Field(0.0, "AdamW weight decay.", _NUM, lo=0, hi=10),
        "betas": Field([0.9, 0.999], "AdamW betas.", (list,)),
        "grad_clip": Field(1.0, "Max global grad norm (0: off).", _NUM, lo=0, hi=1e9),
        "schedule": Field("cosine", "LR schedule after warmup.", (str,), ("cosine", "linear", "constant")),
        "warmup_steps": Field(0, "Linear warmup steps.", (int,), lo=0, hi=10**9),
        "min_lr_ratio": Field(0.0, "Final LR as a fraction of the peak (cosine/linear).", _NUM, lo=0, hi=1),
        "precision": Field(
            "fp32", "fp32, or bf16 autocast (trainable weights stay fp32).", (str,), ("fp32", "bf16")
        ),
        "device": Field("auto", "auto (cuda if present), cpu or cuda.", (str,), ("auto", "cpu", "cuda")),
        "distributed": Field(
            "auto",
            "Multi-rank wrapper (torchrun / --nproc): ddp replicates the model on every rank; fsdp "
            "shards weights, gradients and optimizer state (FSDP2, one unit per decoder layer). "
            "auto: fsdp when the LLM's full weights train (train.trainable.llm), else ddp. On one "
            "process only fsdp named explicitly wraps (FSDP2 on one device, the same code path).",
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
        "packing": Field(
            None,
            "Pack several samples into each row of a micro-batch (first-fit, longest first), their "
            "positions restarting and their attention kept apart, instead of padding every sample to "
            "the longest. null: on where the varlen FlashAttention kernel runs (CUDA with bf16 "
            "autocast or a bf16/fp16 LLM), off elsewhere (the CPU's fallback builds a rows x L x L "
            "mask). The loss is the same per sample either way.",
            _OPT_BOOL,
        ),
        "pack_length": Field(
            None,
            "Tokens per packed row (a sample longer than this is an error). null: the whole "
            "micro-batch in one row under the varlen kernel (no padding at all), rows of the "
            "longest sample under the mask fallback.",
            (int, type(None)),
            lo=1,
            hi=1 << 22,
        ),
        "activation_checkpointing": Field(
            False,
            "Recompute each decoder layer's activations during the backward instead of keeping them "
            "(one more forward per layer; what lets a full finetune at long sequences fit).",
            (bool,),
        ),
        "compile": Field(
            None,
            "torch.compile each decoder layer's forward (fuses the norms, rotary embedding and "
            "activation kernels). The first steps pay the compilation, and a new packed length once "
            "more. null: on when training on CUDA (where eager elementwise kernels are a large share "
            "of the step, see benchmarks/train_scale.py), off on the CPU.",
            (bool, type(None)),
        ),
        "cpu_threads": Field(
            0,
            "torch CPU threads (0: torch's default). Tiny models train several times faster with 1 "
            "thread, and far faster when other processes share the cores.",
            (int,),
            lo=0,
            hi=4096,
        ),
        "num_workers": Field(
            None,
            "DataLoader worker processes that draw, preprocess, tokenize and collate micro-batches "
            "ahead of the step (null: min(4, CPUs per rank - 1) on CUDA, 0 on the CPU; 0: in the "
            "training process). Batches are identical whatever the count.",
            (int, type(None)),
            lo=0,
            hi=256,
        ),
        "prefetch_factor": Field(
            2, "Micro-batches each loader worker keeps ready (train.num_workers > 0).", (int,), lo=1, hi=64
        ),
        "log_every": Field(10, "Write metrics every N optimizer steps.", (int,), lo=1, hi=10**9),
        "checkpoint_every": Field(
            0, "Checkpoint every N optimizer steps (0: only at the end).", (int,), lo=0, hi=10**9
        ),
        "keep_checkpoints": Field(
            0, "Keep only the newest N checkpoints (0: keep all).", (int,), lo=0, hi=10**6
        ),
        "resume": Field(
            True, "Resume from the newest checkpoint in the output dir if there is one.", (bool,)
        ),
        "progress": Field(True, "Show a progress bar.", (bool,)),
    },
    "eval": {
        "enabled": Field(True, "Evaluate at the end through runner.LLM with prompt embeds.", (bool,)),
        "num_items": Field(
            200, "Held-out items to evaluate (capped by the eval set).", (int,), lo=0, hi=10**7
        ),
        "max_tokens": Field(16, "Max new tokens per item.", (int,), lo=1, hi=65536),
        "num_samples": Field(
            10, "Sample generations stored in eval.json (every miss is stored too).", (int,), lo=0, hi=10**7
        ),
        "every": Field(
            0,
            "Held-out loss every N optimizer steps into metrics.jsonl and loss.png (0: off).",
            (int,),
            lo=0,
            hi=10**9,
        ),
        "loss_items": Field(
            64,
            "Held-out items (the first N of the eval set) the held-out loss averages over.",
            (int,),
            lo=1,
            hi=MAX_BATCH,
        ),
        "enforce_eager": Field(False, "Passed to runner.LLM (no CUDA graphs).", (bool,)),
        "batch_invariant": Field(
            False,
            "Passed to runner.LLM: each item's greedy output the same whatever else is generated with it "
            "(batch size, chunking); slower. Items' media are encoded one per call.",
            (bool,),
        ),
        "structured_outputs": Field(
            None,
            "Constrain the eval's generations (vLLM's StructuredOutputsParams): {choice: [cat, dog]}, "
            "{json: {...schema...}}, {regex: ...} or {grammar: ...}; answers are then scored parsed "
            "(a JSON answer as JSON), and eval.json adds `valid`, the fraction of complete answers.",
            (dict, type(None)),
            free_form=True,
        ),
        "backend": Field(
            None,
            "null: evaluate in-process. An http(s):// URL: generate on that vLLM-compatible server "
            "(vLLM --enable-prompt-embeds, or bridge serve) running the same base LLM; encoders stay here.",
            (str, type(None)),
        ),
    },
}


class RecipeError(ValueError):
    """A recipe that cannot run: every problem found, one line each, each naming its key path."""

    def __init__(self, problems: str | Sequence[str]):
        items = [problems] if isinstance(problems, str) else list(problems)
        self.problems: list[str] = [_clip(p, 400) for p in items]
        super().__init__("\n".join(self.problems))


class Node(dict):
    """A validated recipe section: a dict that also allows attribute access (`recipe.train.lr`)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as exc:
            raise AttributeError(key) from exc

    def to_dict(self) -> dict:
        return {k: (v.to_dict() if isinstance(v, Node) else copy.deepcopy(v)) for k, v in self.items()}


def _clip(text: str, limit: int = _ECHO) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _show(value: Any) -> str:
    return _clip(repr(value))


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


def _range_problem(
    path: str, value: Any, lo: float | None, hi: float | None, lo_open: bool = False
) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path}: must be a finite number, got {value}"
    if lo is not None and (value <= lo if lo_open else value < lo):
        return f"{path}: must be {'>' if lo_open else '>='} {lo:g}, got {_show(value)}"
    if hi is not None and value > hi:
        return f"{path}: must be <= {hi:g}, got {_show(value)}"
    return None


def resolve_path(value: str, base_dir: Path | None) -> Path:
    """A recipe path: `~` expanded, relative ones joined to `base_dir` (the recipe's folder)."""
    path = Path(os.path.expanduser(value))
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    try:
        return path.resolve()
    except (RuntimeError, OSError):  # a symlink loop: kept as written, the existence check names it
        return Path(os.path.abspath(path))


def _not_found(path: Path) -> str:
    """Why an existing path was expected at `path` and none is there."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"symlink loop (too many levels of symbolic links): {path}"
    return f"file or directory not found: {path}"


def _check_leaf(path: str, field: Field, value: Any, base_dir: Path | None, problems: list[str]) -> Any:
    if isinstance(value, bool) and bool not in field.types:
        problems.append(f"{path}: expected {_type_name(field.types)}, got bool {value!r}")
        return value
    if isinstance(value, int) and not isinstance(value, bool) and float in field.types:
        value = float(value)
    if not isinstance(value, field.types):
        problems.append(
            f"{path}: expected {_type_name(field.types)}, got {type(value).__name__} {_show(value)}"
        )
        return value
    if field.choices is not None and value not in field.choices:
        if not (field.references and isinstance(value, str) and ":" in value):
            extra = " or 'package.module:ClassName'" if field.references else ""
            problems.append(f"{path}: {_show(value)} is not one of {list(field.choices)}{extra}")
            return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        problem = _range_problem(path, value, field.lo, field.hi, field.lo_open)
        if problem:
            problems.append(problem)
    if field.is_path and value is not None:
        resolved = resolve_path(value, base_dir)
        if field.must_exist and not resolved.exists() and not (field.pattern and _is_pattern(value)):
            problems.append(f"{path}: {_not_found(resolved)}")
        value = str(resolved)
    return copy.deepcopy(value)


def _is_pattern(value: str) -> bool:
    from bridge.data.paths import is_pattern  # the data package's: one definition of a pattern

    return is_pattern(value)


def _validate_level(
    raw: Any, schema: Mapping, prefix: str, base_dir: Path | None, problems: list[str]
) -> Node:
    out = Node()
    if not isinstance(raw, Mapping):
        problems.append(f"{prefix.rstrip('.') or 'recipe'}: expected a mapping, got {type(raw).__name__}")
        raw = {}
    for key in raw:
        if key not in schema:
            hint = _nearest(str(key), prefix, schema)
            msg = f"unknown key '{prefix}{_clip(str(key), 60)}'"
            problems.append(msg + (f" (did you mean '{hint}'?)" if hint else ""))
    for key, spec in schema.items():
        path = prefix + key
        if isinstance(spec, dict):
            out[key] = _validate_level(raw.get(key) or {}, spec, path + ".", base_dir, problems)
        else:
            value = raw.get(key, _MISSING)
            if value is _MISSING:
                out[key] = copy.deepcopy(spec.default)
            else:
                out[key] = _check_leaf(path, spec, value, base_dir, problems)
    return out


def _check_tiny(tiny: Mapping, problems: list[str]) -> None:
    for key, value in tiny.items():
        path = f"model.tiny.{_clip(str(key), 60)}"
        if key not in TINY_MODEL_KEYS:
            close = difflib.get_close_matches(str(key), list(TINY_MODEL_KEYS), n=1)
            hint = f" (did you mean 'model.tiny.{close[0]}'?)" if close else ""
            problems.append(f"unknown key '{path}'{hint}; valid: {', '.join(sorted(TINY_MODEL_KEYS))}")
            continue
        types, *rest = TINY_MODEL_KEYS[key]
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            problems.append(
                f"{path}: expected {_type_name(types)}, got {type(value).__name__} {_show(value)}"
            )
        elif rest and isinstance(rest[0], tuple):
            if value not in rest[0]:
                problems.append(f"{path}: {_show(value)} is not one of {list(rest[0])}")
        elif rest:
            problem = _range_problem(path, value, rest[0], rest[1])
            if problem:
                problems.append(problem)
        elif key == "vocab_words" and not all(isinstance(w, str) for w in value):
            problems.append(f"{path}: expected a list of strings")


def _llm_hidden_size(r: Node, problems: list[str]) -> int | None:
    """The LLM's hidden size from model.tiny or model.path's config.json (None when unknown)."""
    if isinstance(r.model.tiny, Mapping):
        hidden = r.model.tiny.get("hidden_size", TINY_DEFAULT_HIDDEN)
        return hidden if isinstance(hidden, int) and not isinstance(hidden, bool) and hidden > 0 else None
    if r.model.path is None or not Path(r.model.path).exists():
        return None
    config = Path(r.model.path) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        problems.append(f"model.path: cannot read {config}: {_clip(str(exc))}")
        return None
    if not isinstance(data, dict):
        problems.append(f"model.path: {config} is not a JSON object")
        return None
    from runner.hf_config import text_config  # here: the recipe module is on the CLI's fast paths

    hidden = text_config(data).get("hidden_size")
    if not isinstance(hidden, int):
        problems.append(f"model.path: {config} has no integer hidden_size")
        return None
    return hidden


def _resolve_encoder_paths(encoder: Any, base_dir: Path | None) -> Any:
    """Relative file paths in the tower config (`pretrained`, `path`, `checkpoint`) -> absolute,
    against the recipe's folder."""
    if not isinstance(encoder, Mapping) or not isinstance(encoder.get("tower"), Mapping):
        return encoder
    encoder = copy.deepcopy(dict(encoder))
    tower = encoder["tower"]
    for key in ENCODER_PATH_KEYS:
        if isinstance(tower.get(key), str) and tower[key]:
            tower[key] = str(resolve_path(tower[key], base_dir))
    return encoder


def _encoder_modality(cfg: Mapping) -> str | None:
    if isinstance(cfg.get("modality"), str):
        return cfg["modality"]
    tower = cfg.get("tower")
    if isinstance(tower, Mapping):
        try:
            from encoders.api import TOWERS
            from encoders.registry import lookup

            return getattr(lookup(TOWERS, "tower", tower.get("name")), "modality", None)
        except ValueError:
            return None
    return None


def _check_encoder(r: Node, problems: list[str]) -> None:
    if not isinstance(r.encoder, Mapping):
        return
    from bridge.data.example import PLACEHOLDERS
    from encoders.api import encoder_config_problems

    known = _llm_hidden_size(r, problems)
    cfg = copy.deepcopy(dict(r.encoder))
    given = cfg.get("llm_hidden_size")
    if given is not None and known is not None and given != known:
        problems.append(f"encoder.llm_hidden_size: is {_show(given)} but the LLM's hidden size is {known}")
    cfg.setdefault("llm_hidden_size", known or _PROBE_HIDDEN)
    cfg.setdefault("imports", list(r.imports))
    problems.extend(f"encoder.{p}" for p in encoder_config_problems(cfg))
    modality = _encoder_modality(cfg)
    placeholder = {m: p for p, m in PLACEHOLDERS.items()}.get(modality or "")
    if r.data.source == "llava":  # the rows' human turns hold the placeholders
        return
    if placeholder and isinstance(r.data.prompt, str) and placeholder not in r.data.prompt:
        problems.append(
            f"data.prompt: {_show(r.data.prompt)} has no {placeholder} placeholder for the {modality} "
            f"encoder (the encoder's rows go where it stands)"
        )


def _check_data(r: Node, problems: list[str]) -> None:
    """data.train / eval against the source (patterns, existence), data.columns, and the prompt's
    per-source default and meaning."""
    data = r.data
    source = data.source
    if data.prompt is None:
        data["prompt"] = "{value}" if source == "llava" else "<image>"
    if source in FILE_SOURCES and data.train is None:
        problems.append(f"data.train: required when data.source is {source}")
    for key in ("train", "eval"):
        value = data[key]
        if not isinstance(value, str) or os.path.exists(value) or not _is_pattern(value):
            continue  # the leaf check named a missing plain path
        if source not in PATTERN_SOURCES:
            problems.append(f"data.{key}: file or directory not found: {value} (brace and glob patterns "
                            f"are for data.source {' and '.join(PATTERN_SOURCES)})")
            continue
        from bridge.data.paths import expand_data_paths

        try:
            expand_data_paths(value)
        except ValueError as exc:
            problems.append(f"data.{key}: {exc}")
    columns = data.columns
    if isinstance(columns, Mapping) and columns:
        if source not in PATTERN_SOURCES:
            problems.append(f"data.columns: only data.source {' and '.join(PATTERN_SOURCES)} read columns")
        for role, name in columns.items():
            if role not in COLUMN_ROLES:
                close = difflib.get_close_matches(str(role), COLUMN_ROLES, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                problems.append(f"data.columns: unknown role {_show(role)}{hint}; roles: "
                                f"{', '.join(COLUMN_ROLES)}")
            elif not isinstance(name, str) or not name:
                problems.append(f"data.columns.{role}: expected a column name, got {_show(name)}")
    if source == "llava" and isinstance(data.prompt, str):
        from bridge.data.conversation import format_user_turn
        from bridge.data.example import PLACEHOLDER_RE

        try:
            format_user_turn(data.prompt, "")
        except ValueError as exc:
            problems.append(f"data.prompt: {exc}")
        if PLACEHOLDER_RE.search(data.prompt):
            problems.append(f"data.prompt: {_show(data.prompt)} formats each human turn of a llava row, "
                            "whose own text holds its <image> placeholders; leave them out of the format")


def _check_semantics(r: Node, problems: list[str]) -> None:
    """Cross-field rules that a per-key schema cannot express."""
    if (r.model.path is None) == (r.model.tiny is None):
        problems.append("model: set exactly one of model.path (a local HF model dir) or model.tiny")
    if isinstance(r.model.tiny, Mapping):  # another type is already reported by the schema check
        _check_tiny(r.model.tiny, problems)
    if r.encoder is None:
        problems.append("encoder: missing (the encoder config for encoders.api.build_encoder)")
    _check_data(r, problems)
    betas = r.train.betas
    if (
        not isinstance(betas, list)
        or len(betas) != 2
        or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas)
    ):
        problems.append(f"train.betas: expected two numbers in [0, 1), got {_show(betas)}")
    if r.train.lora.enabled and r.train.trainable.llm:
        problems.append("train.lora.enabled and train.trainable.llm are exclusive: LoRA adapts a frozen LLM")
    if r.eval.backend is not None and (not isinstance(r.eval.backend, str)
                                       or not r.eval.backend.startswith(("http://", "https://"))):
        problems.append(f"eval.backend: expected null or an http(s):// URL, got {_show(r.eval.backend)}")
    if isinstance(r.eval.structured_outputs, Mapping):
        problems.extend(_structured_outputs_problems(r.eval.structured_outputs))
    if r.stage == "align" and (r.train.trainable.llm or r.train.lora.enabled):
        problems.append("stage align keeps the LLM frozen: use stage finetune to train the LLM or LoRA")
    targets = r.train.lora.targets
    if not (isinstance(targets, str)
            or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        problems.append(f"train.lora.targets: expected module names, got {_show(targets)}")


def _structured_outputs_problems(value: Mapping) -> list[str]:
    """`eval.structured_outputs`: its fields, then its schema, regex or grammar (converted the way the
    engine compiles it, without a tokenizer)."""
    from runner.engine.structured_outputs import check_structured_outputs  # here: the CLI's fast paths
    from runner.sampling_params import StructuredOutputsParams

    where = "eval.structured_outputs"
    known = set(StructuredOutputsParams.__dataclass_fields__)
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        return [f"unknown key '{where}.{_clip(unknown[0], 60)}'; valid: {', '.join(sorted(known))}"]
    try:
        params = StructuredOutputsParams(**value)
        check_structured_outputs(params)
    except ValueError as exc:
        return [f"eval.{_clip(str(exc), 300)}" if str(exc).startswith("structured_outputs")
                else f"{where}: {_clip(str(exc), 300)}"]
    return []


def _import_user_modules(r: Node, base_dir: Path | None, problems: list[str]) -> None:
    if not isinstance(r.imports, list) or not all(isinstance(spec, str) for spec in r.imports):
        problems.append(f"imports: expected module names or .py paths, got {_show(r.imports)}")
        return
    if not r.imports:
        return
    from encoders.api import import_modules

    resolved = []
    for i, spec in enumerate(r.imports):
        try:
            resolved += import_modules([spec], base_dir=base_dir, where=f"imports[{i}]")
        except ValueError as exc:
            problems.append(str(exc))
    r["imports"] = resolved


def validate(raw: Mapping, base_dir: str | Path | None = None, check_encoder: bool = True) -> Node:
    """Check a raw recipe mapping against the schema, fill in defaults and import `imports`.

    Relative paths resolve against `base_dir` (the recipe file's folder; default: the current
    directory). Every problem found is collected; a RecipeError lists them all, one per line.
    `check_encoder=False` skips building the encoder section (the slow part of the check)."""
    base = Path(base_dir).resolve() if base_dir is not None else None
    problems: list[str] = []
    if isinstance(raw, Mapping) and "encoder" in raw:
        raw = {**raw, "encoder": _resolve_encoder_paths(raw["encoder"], base)}
    recipe = _validate_level(raw, SCHEMA, "", base, problems)
    _check_semantics(recipe, problems)
    _import_user_modules(recipe, base, problems)
    if check_encoder and not any(p.startswith("imports") for p in problems):
        _check_encoder(recipe, problems)
    if problems:
        raise RecipeError(problems)
    return recipe


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=3e-4` -> (["train", "lr"], 3e-4); the value is read as YAML (so types are kept)."""
    if "=" not in text:
        raise RecipeError(f"override {_show(text)}: expected key.sub=value")
    key, _, value = text.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"override {_show(text)}: empty key segment")
    try:
        parsed = load_yaml(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise RecipeError(f"override {_show(text)}: value is not valid YAML: {_clip(str(exc))}") from exc
    return parts, parsed


def _is_path_key(parts: Sequence[str]) -> bool:
    node: Any = SCHEMA
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
    else:
        return isinstance(node, Field) and node.is_path
    return len(parts) == 3 and parts[0] == "encoder" and parts[1] == "tower" and parts[2] in ENCODER_PATH_KEYS


def _absolute(value: Any) -> Any:
    return str(resolve_path(value, None)) if isinstance(value, str) and value else value


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Apply `key.sub=value` overrides to a raw recipe mapping (a copy); validation comes after.

    A relative path given here resolves against the current directory (where it was typed)."""
    out = copy.deepcopy(raw)
    for text in overrides:
        parts, value = parse_override(text)
        if _is_path_key(parts):
            value = _absolute(value)
        elif parts == ["imports"] and isinstance(value, list):
            value = [_absolute(v) if isinstance(v, str) and v.endswith(".py") else v for v in value]
        node = out
        for i, part in enumerate(parts[:-1]):
            nxt = node.get(part)
            if nxt is None:
                nxt = node[part] = {}
            if not isinstance(nxt, dict):
                raise RecipeError(f"override {_show(text)}: '{'.'.join(parts[: i + 1])}' is not a mapping")
            node = nxt
        node[parts[-1]] = value
    return out


def _read_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        raise RecipeError(f"recipe file not found: {p.resolve()}")
    try:
        data = load_yaml(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"{p}: not valid YAML: {_clip(str(exc), 300)}") from exc
    if not isinstance(data, dict):
        raise RecipeError(f"{p}: a recipe is a mapping at the top level")
    return data


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] = (), check_encoder: bool = True) -> Node:
    """Read, override and validate a recipe YAML file (relative paths: against its folder)."""
    return validate(
        apply_overrides(_read_yaml(path), overrides),
        base_dir=Path(path).resolve().parent,
        check_encoder=check_encoder,
    )


def dump_recipe(recipe: Mapping, path: str | os.PathLike) -> None:
    data = recipe.to_dict() if isinstance(recipe, Node) else dict(recipe)
    write_text_atomic(path, yaml.safe_dump(data, sort_keys=False))


def default_output_dir(recipe: Mapping) -> Path:
    """recipe.output_dir, else runs/<name> under the current directory."""
    return Path(recipe["output_dir"]) if recipe.get("output_dir") else Path("runs") / recipe["name"]


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


# ----------------------------------------------------------------------------- resuming
#: key prefixes a resumed run may not change (the checkpoint's weights and data order depend on
#: them) without --force; every other change is reported and allowed
FROZEN_ON_RESUME = ("model.", "encoder.", "data.", "imports", "seed")
#: encoder keys that are training flags, not architecture: changing them on resume is fine
_ENCODER_FLAGS = ("encoder.freeze_tower", "encoder.freeze_projector")


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def _schema_default(key: str) -> Any:
    node: Any = SCHEMA
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node.default if isinstance(node, Field) else _MISSING


def recipe_changes(old: Mapping, new: Mapping) -> list[tuple[str, Any, Any]]:
    """(key path, old value, new value) for every leaf that differs, sorted by key. A key the old
    recipe lacks and the new one holds at its default is no change: the old recipe was written
    before the key existed, and ran as the default runs."""
    a, b = _flatten(old), _flatten(new)
    return [
        (k, a.get(k, _MISSING), b.get(k, _MISSING)) for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and not (k not in a and b.get(k) == _schema_default(k))
    ]


def frozen_changes(changes: Sequence[tuple[str, Any, Any]]) -> list[str]:
    """The changed keys a resume refuses without --force (model, encoder architecture, data)."""
    return [
        k
        for k, _, _ in changes
        if any(k == p.rstrip(".") or k.startswith(p) for p in FROZEN_ON_RESUME)
        and not any(k == f or k.startswith(f + ".") for f in _ENCODER_FLAGS)
    ]


def describe_change(key: str, old: Any, new: Any) -> str:
    show = lambda v: "(unset)" if v is _MISSING else _show(v)  # noqa: E731
    return f"{key}: {show(old)} -> {show(new)}"
