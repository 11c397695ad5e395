"""Is the server running this Bridge's base LLM? Checked once, before any embedding is sent.

Two checks. The name: `/v1/models` lists each served model's `id` (what `--served-model-name`
set) and `root` (the path or hub id it was started from); one of them must name the base LLM, by
full path or by its last component (a hub id `org/Model` and a local copy `.../Model` agree). The
hidden size, which no name proves: a one-row zero `prompt_embeds` probe of that width, which a
server on another LLM refuses (vLLM and `bridge serve` both check the width).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bridge.backends.errors import RemoteModelMismatch
from bridge.messages import bounded


@dataclass(frozen=True)
class ModelExpectation:
    """What the server must serve: names the base LLM goes by, and its hidden size."""

    names: tuple[str, ...]
    hidden_size: int


def llm_names(llm_dir: str | Path, extra: Iterable[str | Path] = ()) -> tuple[str, ...]:
    """Names of a local LLM directory: its path, the config's `_name_or_path`, and `extra` (for a
    checkpoint: the checkpoint and run directories, which `bridge serve RUN` reports as its root)."""
    names = [str(Path(llm_dir).resolve()), *(str(e) for e in extra)]
    config = Path(llm_dir) / "config.json"
    try:
        name_or_path = json.loads(config.read_text()).get("_name_or_path")
    except (OSError, ValueError):
        name_or_path = None
    if isinstance(name_or_path, str) and name_or_path:
        names.append(name_or_path)
    return tuple(dict.fromkeys(n.rstrip("/") for n in names if n))


def _keys(name: str) -> set[str]:
    name = name.rstrip("/")
    last = name.rsplit("/", 1)[-1]
    return {name, last} if last else {name}


def names_match(served: Iterable[str], expected: Iterable[str]) -> bool:
    want = set().union(*(_keys(n) for n in expected)) if expected else set()
    return any(_keys(s) & want for s in served if s)


def served_cards(data: object, url: str) -> list[Mapping]:
    cards = data.get("data") if isinstance(data, Mapping) else None
    if not isinstance(cards, list) or not all(isinstance(c, Mapping) and isinstance(c.get("id"), str)
                                              for c in cards):
        raise RemoteModelMismatch(f"{url}/v1/models did not answer with a model list: "
                                  f"{bounded(json.dumps(data), 200)}")
    if not cards:
        raise RemoteModelMismatch(f"{url}/v1/models lists no model")
    return list(cards)


def pick_model(cards: Sequence[Mapping], *, requested: str | None, expected: ModelExpectation | None,
               check_name: bool, url: str) -> str:
    """The served model id to send requests to; RemoteModelMismatch when it is not the base LLM."""
    described = ", ".join(f"{c['id']!r} (root {c.get('root')!r})" for c in cards[:5])
    if requested is not None:
        chosen = [c for c in cards if c["id"] == requested]
        if not chosen:
            raise RemoteModelMismatch(
                f"{url} does not serve the model {bounded(requested, 100)!r}; it serves {described}"
            )
    elif expected is not None and check_name:
        chosen = [c for c in cards if names_match((c["id"], c.get("root") or ""), expected.names)]
    else:
        chosen = list(cards[:1])
    if check_name and expected is not None:
        matching = [c for c in chosen if names_match((c["id"], c.get("root") or ""), expected.names)]
        if not matching:
            raise RemoteModelMismatch(
                f"{url} serves {described}, not this Bridge's base LLM (known as "
                f"{', '.join(repr(n) for n in expected.names[:3])}); start the server on the same base LLM, "
                "or pass check_model=False if it is the same model under another name (the hidden size is "
                "still checked)"
            )
        chosen = matching
    return chosen[0]["id"]
