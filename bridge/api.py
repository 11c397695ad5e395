"""`Bridge`: encoders and the runner in one process.

    from bridge import Bridge
    b = Bridge.from_checkpoint("runs/shapes/checkpoints/step_300")
    outs = b.generate([{"prompt": "<image>", "image": pil_image}], max_tokens=8)
    outs[0].outputs[0].text

A prompt dict names its text "prompt", as the runner's prompt dicts do ("text" is accepted as an
alias). The inference API never imports the training package at import time: reading a
checkpoint's metadata and building a recipe's parts import their modules when called.

`generate` runs each encoder in-process on its device, then builds one `(n, hidden)` prompt
embeddings tensor per prompt: the LLM's token embeddings at text positions and the encoder rows
at placeholder positions, with `prompt_is_token_ids` (True at text positions) and
`prompt_token_ids`. Those device tensors go straight to `runner.LLM.generate` as
`prompt_embeds`: no serialization, no host round trip (docs/ARCHITECTURE.md, "Bridge (the hall)").
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from bridge.data.conversation import example_prompt
from bridge.data.example import PLACEHOLDERS, Example
from bridge.data.prompt_embeds import scatter_rows
from bridge.data.sources import build_datasets
from bridge.data.tokenize import TokenizedPrompt, tokenize_prompt
from bridge.dtypes import DTYPES
from bridge.recipe import default_output_dir, load_recipe
from encoders.api import load_encoder
from encoders.media_budget import MediaBudget, MediaLimits
from runner.hf_config import text_config
from runner.worker.progress_bars import hf_progress_bars_off

_MEDIA_KEYS = tuple(PLACEHOLDERS.values())
#: the prompt text's key (the runner's name) and its accepted alias
_TEXT_KEYS = ("prompt", "text")


def load_input_embeddings(model_dir: str | Path) -> torch.Tensor:
    """The token-embedding matrix of a local HF model dir, read from its safetensors alone (the
    runner holds the model; loading the whole thing again just for this would double memory)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        candidates = {k: model_dir / f for k, f in weight_map.items()}
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{model_dir}: no safetensors weights")
        candidates = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                candidates.update({k: f for k in handle.keys()})
    keys = sorted((k for k in candidates if k.endswith("embed_tokens.weight")), key=len)
    if not keys:
        raise ValueError(f"{model_dir}: no '*embed_tokens.weight' tensor in its safetensors")
    with safe_open(str(candidates[keys[0]]), framework="pt") as handle:
        return handle.get_tensor(keys[0])


def _as_example(prompt: Any) -> Example:
    if isinstance(prompt, Example):
        return prompt
    if isinstance(prompt, str):
        return Example(prompt, "", {})
    if not isinstance(prompt, Mapping):
        raise ValueError(
            f"each prompt is a string or a dict with a 'prompt' string (and media under "
            f"'image' / 'audio' / 'graph'), got {type(prompt).__name__}"
        )
    given = [k for k in _TEXT_KEYS if k in prompt]
    if len(given) != 1 or not isinstance(prompt[given[0]], str):
        raise ValueError(
            "each prompt dict needs one 'prompt' string ('text' is accepted as an alias, not both), "
            "with media under 'image' / 'audio' / 'graph'"
        )
    unknown = sorted(str(k)[:40] for k in set(prompt) - {*_TEXT_KEYS, *_MEDIA_KEYS})
    if unknown:
        raise ValueError(
            f"unknown prompt keys {unknown[:10]}; valid: prompt (or text), {', '.join(_MEDIA_KEYS)}"
        )
    media = {}
    for mod in _MEDIA_KEYS:
        if prompt.get(mod) is not None:
            value = prompt[mod]
            several = isinstance(value, (list, tuple)) and not _is_one_item(value)
            media[mod] = list(value) if several else [value]
    return Example(prompt[given[0]], "", media)


def _is_one_item(value: tuple | list) -> bool:
    """`(waveform, sample_rate)` is one audio item (the encoders' own form), not a list of two."""
    return (isinstance(value, tuple) and len(value) == 2 and hasattr(value[0], "shape")
            and isinstance(value[1], int) and not isinstance(value[1], bool))


class Bridge:
    """Encoders (one per modality) + a runner.LLM over a local HF model directory.

    `hidden_size` is the LLM's embedding width: the width of every row of `prompt_embeds`."""

    def __init__(
        self,
        llm_dir: str | Path,
        encoders: Mapping[str, Any],
        *,
        dtype: str = "float32",
        device: str | torch.device | None = None,
        enforce_eager: bool = False,
        backend: Any = None,
        model_names: Sequence[str | Path] = (),
        media_limits: MediaLimits | None = None,
        batch_invariant: bool = False,
    ):
        """`backend`: None / "local" (the in-process runner.LLM), an http(s) URL of a vLLM-compatible
        server (bridge.backends.RemoteBackend), or a backend object. `model_names`: other names the
        base LLM goes by, for the remote server's model check. `media_limits` (the attribute of the
        same name): what one prompt's media may add up to, checked from headers before decoding.
        `batch_invariant`: the local LLM's `batch_invariant` option, and each media item encoded on its
        own, so a prompt's greedy output does not depend on the prompts generated with it."""
        from transformers import AutoTokenizer

        self.llm_dir = Path(llm_dir)
        if not (self.llm_dir / "config.json").is_file():
            raise ValueError(f"LLM directory {self.llm_dir} has no config.json")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.device = (
            torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.dtype = dtype
        self.enforce_eager = enforce_eager
        self.batch_invariant = batch_invariant
        self.media_limits = media_limits or MediaLimits()
        self.encoders = {m: enc.to(self.device).eval() for m, enc in encoders.items()}
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.llm_dir))
        self._embed_table = load_input_embeddings(self.llm_dir).to(self.device, DTYPES[dtype])
        #: the LLM's hidden size (the width of prompt-embeds rows)
        self.hidden_size: int = int(self._embed_table.shape[1])
        self._engine = None
        self._model_names = tuple(str(n) for n in model_names)
        self._backends: dict[str, Any] = {}
        self.backend = self._backend_for(backend)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_checkpoint(
        cls,
        directory: str | Path,
        device: str | torch.device | None = None,
        enforce_eager: bool = False,
        backend: Any = None,
        verify: bool = True,
        batch_invariant: bool = False,
    ) -> Bridge:
        """A trained checkpoint (OUTPUT/checkpoints/step_N, or OUTPUT itself for its newest).

        Its files are checked against its manifest.json first (a ValueError names each file that
        differs); `verify=False` loads it unchecked. Custom parts the run used (its recipe's
        `imports`) are imported again from the paths the checkpoint recorded.
        `backend="http://host:8000"` generates on a vLLM-compatible server running its base LLM."""
        # the checkpoint layout belongs to the trainer; imported here, not at module top, so that
        # `import bridge.api` does not load the training package
        from bridge.training import checkpoint as ckpt_io

        directory = ckpt_io.open_checkpoint(directory, verify=verify)
        meta = ckpt_io.read_meta(directory)
        llm_dir = directory / meta["llm_dir"] if meta["llm_dir"] == "llm" else Path(meta["llm_dir"])
        with hf_progress_bars_off():  # a pretrained tower's "Loading weights" bar: a library call is quiet
            encoders = {m: load_encoder(directory / "encoder" / m) for m in meta["modalities"]}
        return cls(
            llm_dir,
            encoders,
            dtype=meta.get("llm_dtype", "float32"),
            device=device,
            enforce_eager=enforce_eager,
            backend=backend,
            model_names=(directory.resolve(), directory.resolve().parents[1], meta.get("base_llm_dir", "")),
            batch_invariant=batch_invariant,
        )

    @classmethod
    def from_recipe(
        cls,
        path: str | Path,
        overrides: Sequence[str] = (),
        output_dir: str | Path | None = None,
        device: str | torch.device | None = None,
    ) -> Bridge:
        """The recipe's LLM and a freshly initialised, untrained encoder (random projector weights,
        so generations are noise until trained): for trying the plumbing before training. A tiny
        model is built into OUTPUT/base_model as `bridge train` would."""
        # the recipe's parts are built by the training package's builders (shared with the
        # trainer); imported when called so that `import bridge.api` does not load training
        from bridge.training.components import build_recipe_encoder, dataset_vocab_words, prepare_llm_dir

        recipe = load_recipe(path, overrides)
        out = Path(output_dir) if output_dir else default_output_dir(recipe)
        words: list[str] = []
        if recipe.model.tiny is not None:
            words = dataset_vocab_words(build_datasets(recipe.data, recipe.seed)[0])
        with hf_progress_bars_off():  # writing a tiny base model, loading a pretrained tower: no bars
            llm_dir = prepare_llm_dir(recipe, out, words)
        hidden = text_config(json.loads((llm_dir / "config.json").read_text())).get("hidden_size")
        with hf_progress_bars_off():
            encoder = build_recipe_encoder(recipe, int(hidden))
        return cls(
            llm_dir,
            {encoder.modality: encoder},
            dtype=recipe.model.dtype,
            device=device,
            enforce_eager=recipe.eval.enforce_eager,
            batch_invariant=recipe.eval.batch_invariant,
        )

    # ------------------------------------------------------------------ engine
    @property
    def engine(self):
        """The runner.LLM, created on first use."""
        if self._engine is None:
            from runner.llm import LLM

            self._engine = LLM(
                str(self.llm_dir),
                enable_prompt_embeds=True,
                dtype=DTYPES[self.dtype],
                device=str(self.device),
                enforce_eager=self.enforce_eager,
                batch_invariant=self.batch_invariant,
            )
        return self._engine

    def _backend_for(self, spec: Any):
        """A backend from its spec (one RemoteBackend per URL, kept); the local engine for None."""
        from bridge.backends import LocalBackend, resolve_backend

        if spec is None or spec == "local":
            return self._backends.setdefault("local", LocalBackend(lambda: self.engine))
        key = spec if isinstance(spec, str) else id(spec)
        if key not in self._backends:
            self._backends[key] = resolve_backend(spec, tokenizer=self.tokenizer)
        return self._backends[key]

    def _checked(self, backend):
        from bridge.backends import ModelExpectation, llm_names

        hidden = int(self._embed_table.shape[1])
        backend.verify(ModelExpectation(llm_names(self.llm_dir, self._model_names), hidden))
        return backend

    # ------------------------------------------------------------------ requests
    def tokenize(self, example: Example) -> TokenizedPrompt:
        """The prompt's ids (a conversation Example: its turns before the last answer, rendered as
        training renders them)."""
        return tokenize_prompt(
            self.tokenizer,
            example_prompt(self.tokenizer, example),
            example.media,
            {m: enc.num_rows for m, enc in self.encoders.items()},
        )

    def check_media(self, example: Example, where: str = "prompt") -> None:
        """Refuse a prompt whose media add up to more than `media_limits` (pixels, samples at the
        encoder's rate and as stored, graph nodes and edges, items), read from headers and declared
        sizes before anything is decoded; a sample rate the encoder cannot resample to is refused too."""
        budget = MediaBudget(self.media_limits, scope="prompt",
                             knob=lambda name: f"Bridge.media_limits.{name}")
        for modality, items in example.media.items():
            rate = getattr(getattr(self.encoders.get(modality), "tower", None), "sample_rate", None)
            for k, item in enumerate(items):
                budget.add(modality, item, f"{where}: {modality} item {k}",
                           target_rate=rate if isinstance(rate, int) else None)

    @torch.no_grad()
    def build_requests(self, prompts: Sequence[Any], encode_batch_size: int | None = None) -> list[dict]:
        """Prompt dicts -> runner requests {"prompt_embeds", "prompt_is_token_ids", "prompt_token_ids"},
        tensors on this Bridge's device. Encoders run batched across prompts, `encode_batch_size` items
        a call (default 64; 1 with `batch_invariant`: an encoder's kernels depend on its batch too)."""
        if encode_batch_size is None:
            encode_batch_size = 1 if self.batch_invariant else 64
        examples = [_as_example(p) for p in prompts]
        for i, ex in enumerate(examples):
            self.check_media(ex, f"prompt {i}")
        tokenized = [self.tokenize(ex) for ex in examples]
        rows: dict[str, list[torch.Tensor]] = {}
        for mod, enc in self.encoders.items():
            items = [item for ex in examples for item in ex.media.get(mod, [])]
            rows[mod] = [
                r
                for i in range(0, len(items), encode_batch_size)
                for r in enc.encode(items[i : i + encode_batch_size])
            ]
        cursor = {m: 0 for m in rows}
        requests = []
        for ex, tp in zip(examples, tokenized):
            mine = []
            for span in sorted(tp.spans, key=lambda s: s.start):
                r = rows[span.modality][cursor[span.modality] + span.item_index]
                if r.shape[0] != span.length:
                    raise ValueError(
                        f"the {span.modality} encoder produced {r.shape[0]} rows, num_rows said {span.length}"
                    )
                mine.append(r.to(self.device))
            for mod in cursor:
                cursor[mod] += len(ex.media.get(mod, []))
            ids = torch.tensor(tp.ids, device=self.device)
            is_token = torch.tensor(tp.is_token, device=self.device)
            embeds = self._embed_table[ids.masked_fill(~is_token, 0)]
            requests.append(
                {
                    "prompt_embeds": scatter_rows(embeds, is_token, mine),
                    "prompt_is_token_ids": is_token,
                    "prompt_token_ids": list(tp.ids),
                }
            )
        return requests

    def generate(
        self,
        prompts: Sequence[Any],
        max_tokens: int = 32,
        temperature: float = 0.0,
        sampling_params=None,
        backend: Any = None,
        use_tqdm: bool = False,
        **sampling_kwargs,
    ):
        """Generate for prompt dicts {"prompt": "... <image> ...", "image": item_or_list, ...}; returns
        the runner's RequestOutputs (`.outputs[0].text`, `.outputs[0].token_ids`). `backend` (a URL
        or backend object) overrides this Bridge's for the call; a remote one is checked once
        (same base LLM, same hidden size) before any embedding is sent. Prints nothing unless
        `use_tqdm=True` (a progress bar of finished prompts on stderr)."""
        from runner.sampling_params import SamplingParams

        if sampling_params is None:
            sampling_params = SamplingParams(
                max_tokens=max_tokens, temperature=temperature, **sampling_kwargs
            )
        chosen = self._checked(self.backend if backend is None else self._backend_for(backend))
        requests = self.build_requests(prompts)
        if use_tqdm:  # a backend object of the caller's own need not know the keyword otherwise
            return chosen.generate(requests, sampling_params, use_tqdm=True)
        return chosen.generate(requests, sampling_params)
