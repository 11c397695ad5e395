"""JSONL rows with text and media paths -> Examples.

One JSON object per line. The target is `row[target_field]` (default "text"); media paths are
under the modality's key, a string or a list of strings, relative to `media_root` (default: the
JSONL file's folder). A row may carry its own "prompt"; otherwise the recipe's template is
rendered with the row's fields. Example line:

    {"image": "imgs/001.png", "text": "a red circle"}
    {"audio": "clips/7.wav", "prompt": "<audio> transcribe:", "text": "hello"}
    {"graph": "graphs/3.json", "text": "a ring of 6 atoms"}

Media files are read lazily, on access: images with PIL (RGB), audio as the WAV path (the audio
tower reads and resamples it), graphs as JSON in the encoders' graph format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bridge.data.example import PLACEHOLDERS, Example, render_prompt

MEDIA_KEYS = tuple(PLACEHOLDERS.values())


def load_media(modality: str, path: Path) -> Any:
    if not path.is_file():
        raise ValueError(f"media file not found: {path}")
    if modality == "image":
        from PIL import Image

        with Image.open(path) as img:
            return img.convert("RGB")
    if modality == "audio":
        return str(path)  # audio towers read WAV paths themselves (and resample to their rate)
    if modality == "graph":
        return json.loads(path.read_text())
    raise ValueError(f"unknown media modality {modality!r}")


class JsonlDataset:
    def __init__(
        self,
        path: str | Path,
        *,
        prompt: str,
        target_field: str = "text",
        media_root: str | Path | None = None,
    ):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"data file not found: {self.path}")
        self.prompt = prompt
        self.target_field = target_field
        self.media_root = Path(media_root) if media_root else self.path.parent
        self.rows: list[dict] = []
        for lineno, line in enumerate(self.path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{self.path}:{lineno}: not valid JSON: {exc}") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{self.path}:{lineno}: each line must be a JSON object")
            if not isinstance(row.get(target_field), str):
                raise ValueError(f"{self.path}:{lineno}: missing string field {target_field!r}")
            for mod in MEDIA_KEYS:
                for rel in self._paths(row, mod):
                    if not (self.media_root / rel).is_file():
                        raise ValueError(
                            f"{self.path}:{lineno}: {mod} file not found: {self.media_root / rel}"
                        )
            self.rows.append(row)
        if not self.rows:
            raise ValueError(f"{self.path}: no rows")

    @staticmethod
    def _paths(row: dict, modality: str) -> list[str]:
        value = row.get(modality)
        if value is None:
            return []
        return [value] if isinstance(value, str) else list(value)

    def __len__(self) -> int:
        return len(self.rows)

    def vocab_words(self) -> list[str]:
        from bridge.data.example import target_words

        return target_words(r[self.target_field] for r in self.rows)

    def __getitem__(self, index: int) -> Example:
        row = self.rows[index]
        prompt = row.get("prompt") or render_prompt(self.prompt, row)
        media = {
            mod: [load_media(mod, self.media_root / p) for p in self._paths(row, mod)] for mod in MEDIA_KEYS
        }
        return Example(prompt, row[self.target_field], {m: v for m, v in media.items() if v})
