"""Chat messages -> one engine prompt: media parts decoded, the model's chat template applied.

Each content part becomes text: a text part its text, a media part its modality's placeholder
token (`<image>`, `<audio>`, `<graph>`, `<embeds>`), joined with newlines as vLLM's "string"
content format does; the items go to `multi_modal_data`, so the engine's encoders encode them and
its encoder cache serves a repeated item (same content hash) without encoding it again. The
rendered conversation is tokenized without special tokens (the template owns BOS and the like).

Media sources: `image_url` with a `data:image/...;base64,` URL, or a local file (`file://` URL or
a path) only under `--allowed-local-media-path`; `input_audio` with base64 WAV; a `graph` part
holding a graph in the JSON graph format; `prompt_embeds` / `image_embeds` parts with vLLM's base64
tensor payload (rows already in the LLM's hidden space; needs `--enable-prompt-embeds`).
"""

from __future__ import annotations

import asyncio
import binascii
import io
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pybase64
import torch
from PIL import Image

from bridge.serve.errors import ApiError, bounded
from bridge.serve.inputs import ServeLimits, check_text, decode_embeds
from bridge.serve.metrics import ServeMetrics
from bridge.serve.protocol import (
    AudioPart,
    ChatCompletionRequest,
    EmbedsPart,
    GraphPart,
    ImagePart,
    TextPart,
)
from encoders.graph_format import graph_from_dict
from runner.multimodal.encoder_protocol import PROMPT_EMBEDS_MODALITY
from runner.multimodal.placeholders import placeholder_token

MAX_IMAGE_PIXELS = 64 * 2**20
MAX_MEDIA_ITEMS = 64
NO_TEMPLATE = ("this model's tokenizer has no chat template; start the server with --chat-template FILE "
               "(a Jinja template) or use /v1/completions")


def _b64(data: str, where: str) -> bytes:
    try:
        return pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: not valid base64", param=where) from None


def decode_image(raw: bytes, where: str) -> Image.Image:
    """Bytes of an image file -> an RGB PIL image (pixel count capped before decoding)."""
    try:
        with Image.open(io.BytesIO(raw)) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise ApiError(400, f"{where}: image of {img.width}x{img.height} pixels is over the cap of "
                               f"{MAX_IMAGE_PIXELS} pixels", param=where)
            return img.convert("RGB")
    except ApiError:
        raise
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ApiError(400, f"{where}: cannot decode the image ({type(err).__name__})", param=where) from None


def decode_wav(raw: bytes, where: str) -> tuple[torch.Tensor, int]:
    """Bytes of a PCM WAV file -> ((channels, samples) float32 in [-1, 1], sample rate)."""
    try:
        with wave.open(io.BytesIO(raw), "rb") as f:
            channels, width, rate = f.getnchannels(), f.getsampwidth(), f.getframerate()
            data = f.readframes(f.getnframes())
    except (wave.Error, EOFError, ValueError) as err:
        raise ApiError(400, f"{where}: not a readable PCM WAV file ({bounded(err, 100)})",
                       param=where) from None
    dtypes = {1: np.uint8, 2: "<i2", 4: "<i4"}
    if width not in dtypes or channels < 1 or rate < 1:
        raise ApiError(400, f"{where}: unsupported WAV (width {width * 8} bits, {channels} channels, "
                       f"rate {rate})", param=where)
    samples = np.frombuffer(data[: len(data) - len(data) % (width * channels)], dtype=dtypes[width])
    scale = {1: 128.0, 2: 32768.0, 4: 2147483648.0}[width]
    wav = samples.astype(np.float32)
    wav = (wav - 128.0) / scale if width == 1 else wav / scale
    if wav.size == 0:
        raise ApiError(400, f"{where}: the WAV holds no samples", param=where)
    return torch.from_numpy(wav.reshape(-1, channels).T.copy()), rate


class ChatRenderer:
    """Builds engine prompts for one server (its tokenizer, template, encoders and limits)."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None, encoders: dict[str, Any],
                 allowed_media_dir: Path | None, limits: ServeLimits, hidden_size: int, max_model_len: int,
                 metrics: ServeMetrics) -> None:
        self.tokenizer = tokenizer
        self.template = chat_template
        self.encoders = encoders
        self.allowed_media_dir = allowed_media_dir.resolve() if allowed_media_dir else None
        self.limits = limits
        self.hidden_size = hidden_size
        self.max_model_len = max_model_len
        self.metrics = metrics

    @property
    def has_template(self) -> bool:
        own = getattr(self.tokenizer, "chat_template", None)
        return self.tokenizer is not None and bool(self.template or own)

    async def prompt(self, body: ChatCompletionRequest) -> dict[str, Any]:
        if not self.has_template:
            raise ApiError(400, NO_TEMPLATE, param="messages")
        media: dict[str, list[Any]] = {}
        conversation = []
        for i, message in enumerate(body.messages):
            content = message.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    texts.append(await self._part(part, f"messages[{i}].content[{j}]", media))
                content = "\n".join(texts)
            text = check_text(content or "", f"messages[{i}]")
            conversation.append({"role": message.role, "content": text})
        if sum(map(len, media.values())) > MAX_MEDIA_ITEMS:
            raise ApiError(400, f"at most {MAX_MEDIA_ITEMS} media items per request", param="messages")
        ids = await asyncio.to_thread(self._render, conversation, body)
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if media:
            prompt["multi_modal_data"] = media
        return prompt

    def _render(self, conversation: list[dict], body: ChatCompletionRequest) -> list[int]:
        kwargs = dict(body.chat_template_kwargs or {})
        for key in ("conversation", "tokenize", "chat_template", "add_generation_prompt"):
            kwargs.pop(key, None)
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                chat_template=self.template, **kwargs)
        except Exception as err:  # noqa: BLE001 - a template error is the caller's conversation's problem
            raise ApiError(400, f"the chat template failed on these messages: {type(err).__name__}: "
                           f"{bounded(err, 200)}", param="messages") from None
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise ApiError(400, "the rendered conversation is empty", param="messages")
        return ids

    def _placeholder(self, modality: str, where: str) -> str:
        if modality != PROMPT_EMBEDS_MODALITY and modality not in self.encoders:
            known = sorted(self.encoders) or "none"
            raise ApiError(400, f"{where}: this model has no {modality} encoder (encoders: {known})",
                           param=where)
        return placeholder_token(modality, self.encoders.get(modality))

    async def _part(self, part: Any, where: str, media: dict[str, list[Any]]) -> str:
        if isinstance(part, TextPart):
            return part.text
        if isinstance(part, ImagePart):
            token = self._placeholder("image", where)
            image = await asyncio.to_thread(self._image, part.image_url.url, where)
            media.setdefault("image", []).append(image)
            return token
        if isinstance(part, AudioPart):
            token = self._placeholder("audio", where)
            raw = _b64(part.input_audio.data, where)
            media.setdefault("audio", []).append(decode_wav(raw, where))
            return token
        if isinstance(part, GraphPart):
            token = self._placeholder("graph", where)
            try:
                graph = graph_from_dict(part.graph, source=where)
            except (ValueError, TypeError) as err:
                raise ApiError(400, bounded(err, 300), param=where) from None
            media.setdefault("graph", []).append(graph)
            return token
        if isinstance(part, EmbedsPart):
            payload = part.prompt_embeds if part.type == "prompt_embeds" else part.image_embeds
            if payload is None:
                raise ApiError(400, f"{where}: a {part.type} part needs its '{part.type}' field", param=where)
            tensor = decode_embeds(payload, where=where, hidden_size=self.hidden_size,
                                   max_model_len=self.max_model_len, limits=self.limits, metrics=self.metrics)
            token = self._placeholder(PROMPT_EMBEDS_MODALITY, where)
            media.setdefault(PROMPT_EMBEDS_MODALITY, []).append(tensor)
            return token
        raise ApiError(400, f"{where}: unsupported content part", param=where)

    def _image(self, url: str, where: str) -> Image.Image:
        if url.startswith("data:"):
            header, sep, data = url.partition(",")
            if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
                raise ApiError(400, f"{where}: a data URL must look like data:image/png;base64,...",
                               param=where)
            return decode_image(_b64(data, where), where)
        if url.startswith(("http://", "https://")):
            raise ApiError(400, f"{where}: this server does not fetch URLs; send a data: URL", param=where)
        if self.allowed_media_dir is None:
            raise ApiError(400, f"{where}: local files are refused unless the server runs with "
                           "--allowed-local-media-path DIR", param=where)
        path = Path(url[len("file://"):] if url.startswith("file://") else url).resolve()
        if not path.is_relative_to(self.allowed_media_dir) or not path.is_file():
            raise ApiError(400, f"{where}: not a file under the allowed local media path", param=where)
        return decode_image(path.read_bytes(), where)
