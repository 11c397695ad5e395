"""Encoder = preprocessing + tower + projector, emitting ``(n, hidden)`` rows for a target LLM.

It meets the runner's encoder protocol structurally (``modality``, ``is_realtime``, ``num_rows``,
``content_hash``, ``encode``) without importing the runner, and it is also the differentiable module
the trainer optimises (``forward``/``embed``). Building goes through the registries so a recipe can
name every part.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from encoders import builtins  # noqa: F401 - the built-in parts registered before this module looks one up
from encoders.checkpoint import WEIGHTS_NAME, load_state_dict_checked, read_encoder_config, save_encoder
from encoders.hashing import content_hash as _content_hash
from encoders.parts import Batch, Projector, Tower, check_keys, move_batch
from encoders.registry import PREPROCESSORS, PROJECTORS, TOWERS, lookup, require_name
from encoders.user_modules import import_modules

MODALITIES = ("image", "audio", "graph")
ENCODER_KEYS = {
    "modality",
    "tower",
    "projector",
    "llm_hidden_size",
    "streaming",
    "freeze_tower",
    "freeze_projector",
    "imports",
}

#: what every tower class must define itself (the base class only raises NotImplementedError)
TOWER_METHODS = ("from_config", "export_config", "preprocess", "collate", "output_rows", "forward")


def _missing_methods(cls: Any, names: tuple[str, ...]) -> list[str]:
    """Methods of ``names`` that ``cls`` leaves to the Tower base class (or lacks entirely)."""
    missing = []
    for name in names:
        own = getattr(cls, name, None)
        base = getattr(Tower, name, None)
        if own is None or (
            base is not None and getattr(own, "__func__", own) is getattr(base, "__func__", base)
        ):
            missing.append(name)
    return missing


def _class_name(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"


def check_tower_class(cls: Any) -> None:
    """A tower class must define every method the Encoder calls; say which one is missing, by
    class and name, before anything is built (not as a NotImplementedError mid-training)."""
    if not isinstance(cls, type):
        raise ValueError(f"tower {cls!r} is not a class")
    missing = _missing_methods(cls, TOWER_METHODS)
    if missing:
        raise ValueError(
            f"tower class {_class_name(cls)} does not define {', '.join(missing)} "
            f"(every tower needs {', '.join(TOWER_METHODS)}; see encoders.Tower)"
        )


def _check_built_tower(tower: Any, cls: Any) -> None:
    if not isinstance(tower, nn.Module):
        raise ValueError(
            f"{_class_name(cls)}.from_config returned {type(tower).__name__}, not a Tower module"
        )
    modality = getattr(tower, "modality", None)
    if modality not in MODALITIES:
        raise ValueError(
            f"tower {_class_name(cls)}: modality must be one of {list(MODALITIES)}, got {modality!r}"
        )
    width = getattr(tower, "out_dim", None)
    if not isinstance(width, int) or isinstance(width, bool) or width <= 0:
        raise ValueError(f"tower {_class_name(cls)}: out_dim must be a positive int, got {width!r}")


def build_tower(cfg: dict) -> Tower:
    """Build a tower from ``{"name": <registered tower>, ...tower keys}``."""
    name = require_name(cfg, "tower")
    cls = lookup(TOWERS, "tower", name)
    check_tower_class(cls)
    tower = cls.from_config({k: v for k, v in cfg.items() if k != "name"})
    _check_built_tower(tower, cls)
    return tower


def build_projector(cfg: dict, in_dim: int, out_dim: int) -> Projector:
    """Build a projector from ``{"name": <registered projector>, ...keys}`` mapping in_dim -> out_dim."""
    name = require_name(cfg, "projector")
    return lookup(PROJECTORS, "projector", name).from_config(
        {k: v for k, v in cfg.items() if k != "name"}, int(in_dim), int(out_dim)
    )


def build_preprocessor(cfg: dict) -> Any:
    """Build a stand-alone preprocessor (e.g. ``{"name": "log_mel", "n_mels": 80}``) for data pipelines."""
    name = require_name(cfg, "preprocessor")
    return lookup(PREPROCESSORS, "preprocessor", name).from_config(
        {k: v for k, v in cfg.items() if k != "name"}
    )


def build_encoder(cfg: dict) -> Encoder:
    """Build an Encoder from a recipe's encoder section (see ``Encoder`` for the keys)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"encoder config must be a dict, got {type(cfg).__name__}")
    check_keys(cfg, ENCODER_KEYS, "encoder")
    for key in ("tower", "projector", "llm_hidden_size"):
        if key not in cfg:
            raise ValueError(f"encoder config is missing required key {key!r}")
    hidden = cfg["llm_hidden_size"]
    if not isinstance(hidden, int) or isinstance(hidden, bool) or hidden <= 0:
        raise ValueError(f"encoder llm_hidden_size must be a positive int, got {hidden!r}")
    import_modules(cfg.get("imports") or [], where="encoder.imports")
    tower = build_tower(cfg["tower"])
    modality = cfg.get("modality", tower.modality)
    if modality not in MODALITIES:
        raise ValueError(f"encoder modality must be one of {list(MODALITIES)}, got {modality!r}")
    if modality != tower.modality:
        raise ValueError(
            f"encoder modality {modality!r} does not match tower {cfg['tower'].get('name')!r}, "
            f"which encodes {tower.modality!r}"
        )
    projector = build_projector(cfg["projector"], tower.out_dim, hidden)
    return Encoder(cfg, tower, projector)


def encoder_config_problems(cfg: Any) -> list[str]:
    """Every problem of an encoder config, one line each, prefixed with the key it is under
    (``tower: ...``, ``projector: ...``): what a recipe check reports all at once before a run.

    Builds the parts to find out (a pretrained file is read), so this costs one encoder build."""
    if not isinstance(cfg, dict):
        return [f"expected a mapping, got {type(cfg).__name__}"]
    problems: list[str] = []
    unknown = sorted(set(cfg) - ENCODER_KEYS)
    if unknown:
        problems.append(f"unknown key(s) {unknown}; valid keys: {sorted(ENCODER_KEYS)}")
    for key in ("tower", "projector", "llm_hidden_size"):
        if key not in cfg:
            problems.append(f"{key}: missing (required)")
    try:
        import_modules(cfg.get("imports") or [], where="imports")
    except ValueError as exc:
        return problems + [str(exc)]
    tower = None
    if "tower" in cfg:
        try:
            tower = build_tower(cfg["tower"])
        except (ValueError, TypeError, OSError) as exc:
            problems.append(f"tower: {exc}")
    hidden = cfg.get("llm_hidden_size")
    if "projector" in cfg:
        try:
            if tower is not None and isinstance(hidden, int) and hidden > 0:
                build_projector(cfg["projector"], tower.out_dim, hidden)
            else:
                lookup(PROJECTORS, "projector", require_name(cfg["projector"], "projector"))
        except (ValueError, TypeError) as exc:
            problems.append(f"projector: {exc}")
    if problems or tower is None:
        return problems
    try:
        build_encoder(cfg)
    except (ValueError, TypeError) as exc:
        problems.append(str(exc))
    return problems


class Encoder(nn.Module):
    """A trainable encoder for one modality.

    Config keys (a recipe's ``encoder:`` section)::

        modality:          "image" | "audio" | "graph" (optional; must match the tower)
        tower:             {"name": <TOWERS key>, ...}   see each tower's docstring
        projector:         {"name": <PROJECTORS key>, ...}
        llm_hidden_size:   int, the LLM's embedding width (rows come out this wide)
        streaming:         {"chunk_samples": int} (audio only) -> realtime: each chunk is encoded on
                           its own into a fixed number of rows (``rows_per_chunk``)
        freeze_tower:      bool, default False (True: tower weights get no gradient, stays in eval mode)
        freeze_projector:  bool, default False

    Inference (runner protocol): ``encode(items)`` -> list of ``(num_rows(item), llm_hidden_size)``
    tensors on this module's device, no autograd. Training: ``collate([preprocess(x) ...])`` in the
    data loader, then ``forward(batch)`` (differentiable) -> list of ``(n_i, hidden)``.
    """

    def __init__(self, config: dict, tower: Tower, projector: Projector):
        super().__init__()
        self.tower = tower
        self.projector = projector
        self.modality: str = tower.modality
        self.hidden_size: int = int(config["llm_hidden_size"])
        streaming = config.get("streaming")
        self.chunk_samples: int | None = None
        if streaming:
            if not isinstance(streaming, dict) or set(streaming) - {"chunk_samples"}:
                raise ValueError(f"encoder streaming must be {{'chunk_samples': int}}, got {streaming!r}")
            if not hasattr(tower, "split_chunks"):
                raise ValueError(
                    f"streaming needs a tower that can split items into chunks; "
                    f"{type(tower).__name__} ({tower.modality}) cannot"
                )
            chunk = streaming.get("chunk_samples")
            if not isinstance(chunk, int) or chunk <= 0:
                raise ValueError(f"streaming.chunk_samples must be a positive int, got {chunk!r}")
            self.chunk_samples = chunk
        self.is_realtime: bool = self.chunk_samples is not None
        exported = dict(tower.export_config())
        given_name = config["tower"].get("name") if isinstance(config.get("tower"), dict) else None
        if exported.get("name") is None or (
            isinstance(given_name, str) and ":" in given_name and exported["name"] not in TOWERS
        ):
            exported["name"] = given_name
        self.config: dict = {
            "modality": self.modality,
            "imports": list(config.get("imports") or []),
            "tower": exported,
            "projector": copy.deepcopy(config["projector"]),
            "llm_hidden_size": self.hidden_size,
            "streaming": {"chunk_samples": self.chunk_samples} if self.is_realtime else None,
            "freeze_tower": bool(config.get("freeze_tower", False)),
            "freeze_projector": bool(config.get("freeze_projector", False)),
        }
        self.set_trainable(
            tower=not self.config["freeze_tower"], projector=not self.config["freeze_projector"]
        )

    # ----------------------------------------------------------------- trainable parts
    def set_trainable(self, tower: bool | None = None, projector: bool | None = None) -> None:
        """Switch gradients on/off per part (the align stage freezes the tower, trains the projector)."""
        if tower is not None:
            self.tower.requires_grad_(tower)
            self.config["freeze_tower"] = not tower
        if projector is not None:
            self.projector.requires_grad_(projector)
            self.config["freeze_projector"] = not projector
        self.train(self.training)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def train(self, mode: bool = True) -> Encoder:
        """Frozen parts stay in eval mode (no dropout / batch-norm updates) even while training."""
        super().train(mode)
        if self.config["freeze_tower"]:
            self.tower.eval()
        if self.config["freeze_projector"]:
            self.projector.eval()
        return self

    @property
    def device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        for p in self.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.float32

    # ----------------------------------------------------------------- rows and identity
    @property
    def rows_per_chunk(self) -> int:
        """Rows one streaming chunk produces (realtime encoders only)."""
        if not self.is_realtime:
            raise ValueError("rows_per_chunk is defined only for a streaming (realtime) encoder")
        return self.projector.output_rows(self.tower.chunk_rows(self.chunk_samples))

    def num_rows(self, item: Any) -> int:
        """Rows ``encode([item])[0]`` will have; cheap (no forward), so placeholders expand first."""
        if self.is_realtime:
            return self.tower.num_chunks(item, self.chunk_samples) * self.rows_per_chunk
        return self.projector.output_rows(self.tower.output_rows(item))

    def content_hash(self, item: Any) -> str:
        """sha256 hex of the item's raw content (pixels, samples, graph arrays): the cache key."""
        return _content_hash(self.modality, item)

    # ----------------------------------------------------------------- data path
    def _pieces(self, item: Any) -> list[Any]:
        return self.tower.split_chunks(item, self.chunk_samples) if self.is_realtime else [item]

    def preprocess(self, item: Any) -> Any:
        """CPU preprocessing of one raw item (safe to call in data-loader workers)."""
        return [self.tower.preprocess(piece) for piece in self._pieces(item)]

    def collate(self, processed: list[Any]) -> Batch:
        """Batch preprocessed items for ``forward``."""
        if not processed:
            raise ValueError("collate needs at least one preprocessed item")
        flat = [piece for pieces in processed for piece in pieces]
        batch = self.tower.collate(flat)
        batch["_pieces_per_item"] = [len(pieces) for pieces in processed]
        return batch

    def tower_features(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tower only, over all pieces: ``(P, T, tower.out_dim)`` and lengths (None = all T)."""
        tensors = move_batch(
            {k: v for k, v in batch.items() if k != "_pieces_per_item"}, self.device, self.dtype
        )
        feats, lengths = self.tower(tensors)
        if feats.dim() != 3 or feats.shape[-1] != self.tower.out_dim:
            raise ValueError(
                f"tower {self.config['tower'].get('name')!r} ({type(self.tower).__name__}) returned "
                f"features of shape {tuple(feats.shape)}: expected (items, rows, out_dim="
                f"{self.tower.out_dim}), got width {feats.shape[-1] if feats.dim() else 'none'}; "
                f"set out_dim to the width forward returns"
            )
        return feats, lengths

    def forward_padded(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tower + projector over all pieces: ``(P, T, hidden)`` and lengths (None = all T)."""
        return self.projector(*self.tower_features(batch))

    @staticmethod
    def _split(
        out: torch.Tensor, lengths: torch.Tensor | None, counts: list[int] | None
    ) -> list[torch.Tensor]:
        rows = [out[i] if lengths is None else out[i, : int(lengths[i])] for i in range(out.shape[0])]
        result, start = [], 0
        for count in counts or [1] * len(rows):
            group = rows[start : start + count]
            result.append(group[0] if count == 1 else torch.cat(group, dim=0))
            start += count
        return result

    def forward(self, batch: Batch) -> list[torch.Tensor]:
        """Differentiable: one ``(n_i, hidden)`` tensor per item of the batch."""
        out, lengths = self.forward_padded(batch)
        return self._split(out, lengths, batch.get("_pieces_per_item"))

    # frozen-tower caching: tower rows once per item, then only the projector each step
    def tower_rows(self, batch: Batch) -> list[torch.Tensor]:
        """Per-item tower features ``(t_i, tower.out_dim)`` (not for streaming encoders, whose
        projector must see each chunk separately). With a frozen tower a trainer may cache these
        by ``content_hash`` and call ``project_rows`` every step."""
        if self.is_realtime:
            raise ValueError("tower_rows/project_rows are not available for streaming (realtime) encoders")
        feats, lengths = self.tower_features(batch)
        return self._split(feats, lengths, None)

    def project_rows(self, rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Projector over per-item tower features (from ``tower_rows``) -> ``(n_i, hidden)`` each."""
        if self.is_realtime:
            raise ValueError("tower_rows/project_rows are not available for streaming (realtime) encoders")
        if not rows:
            return []
        feats = torch.nn.utils.rnn.pad_sequence([r.to(self.device) for r in rows], batch_first=True)
        lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long, device=self.device)
        return self._split(*self.projector(feats, lengths), None)

    def embed(self, items: list[Any]) -> list[torch.Tensor]:
        """Differentiable end to end from raw items (preprocess + collate + forward)."""
        return self.forward(self.collate([self.preprocess(item) for item in items]))

    @torch.no_grad()
    def encode(self, items: list[Any]) -> list[torch.Tensor]:
        """Runner protocol: batched inference -> ``(num_rows(item), hidden)`` tensors on ``self.device``."""
        if not items:
            return []
        was_training = self.training
        self.eval()
        try:
            return [t.contiguous() for t in self.embed(list(items))]
        finally:
            self.train(was_training)

    @torch.no_grad()
    def encode_stream(self, chunk: Any) -> torch.Tensor:
        """Realtime: encode one chunk of at most ``chunk_samples`` samples -> ``(rows_per_chunk, hidden)``."""
        if not self.is_realtime:
            raise ValueError(
                "encode_stream needs a streaming encoder (config 'streaming': {'chunk_samples': N})"
            )
        n = self.tower.num_samples(chunk)
        if n > self.chunk_samples:
            raise ValueError(
                f"stream chunk has {n} samples at the model rate, more than chunk_samples="
                f"{self.chunk_samples}; split it or use encode()"
            )
        return self.encode([chunk])[0]

    # ----------------------------------------------------------------- persistence
    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (all weights) into ``directory``."""
        return save_encoder(self, directory)

    @classmethod
    def load(cls, directory: str | Path, device: str | torch.device | None = None) -> Encoder:
        """Rebuild from ``config.json`` and load weights, checking every name and shape."""
        return load_encoder(directory, device=device)

    def extra_repr(self) -> str:
        return (
            f"modality={self.modality!r}, hidden_size={self.hidden_size}, realtime={self.is_realtime}, "
            f"params={self.num_parameters()}"
        )


def load_encoder(directory: str | Path, device: str | torch.device | None = None) -> Encoder:
    """Rebuild an Encoder saved by ``save_encoder`` and load its weights (names and shapes checked).

    The modules the encoder was built with (config ``imports``: a recipe's custom towers and
    projectors) are imported first; a failure names the module and the config file."""
    directory = Path(directory)
    config = read_encoder_config(directory)
    weights = directory / WEIGHTS_NAME
    if not weights.is_file():
        raise ValueError(f"encoder checkpoint {directory} has no {WEIGHTS_NAME}")
    config["imports"] = import_modules(
        config.get("imports") or [], base_dir=directory, where=f"{directory / 'config.json'}: imports"
    )
    encoder = build_encoder(config)
    try:
        state = load_file(str(weights))
    except Exception as e:  # noqa: BLE001  safetensors raises its own error types on bad bytes
        why = str(e)[:200]
        raise ValueError(f"{weights}: not a valid safetensors file (truncated or damaged?): {why}") from None
    load_state_dict_checked(encoder, state, source=str(weights))
    if device is not None:
        encoder.to(device)
    return encoder
