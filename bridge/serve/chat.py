"""Chat messages -> one engine prompt: media parts decoded, the model's chat template applied.

Each content part becomes text: a text part its text, a media part its modality's placeholder
token (`<image>`, `<audio>`, `<graph>`, `<embeds>`), joined with newlines as vLLM's "string"
content format does (a run's recipe template joins them as its `data.prompt` does, see
`chat_template.py`); the items go to `multi_modal_data`, so the engine's encoders encode them and
its encoder cache serves a repeated item (same content hash) without encoding it again. The
rendered conversation is tokenized as training tokenizes a prompt (`split_at_placeholders`: the text
between placeholders piece by piece, one id per placeholder), without special tokens (the template
owns BOS and the like) unless the template is the recipe's (training put the tokenizer's special
prefix first) or the request sets `add_special_tokens`.

Media sources: `image_url` with a `data:image/...;base64,` URL, or a local file (`file://` URL or
a path) only under `--allowed-local-media-path`; `input_audio` with base64 WAV; a `graph` part
holding a graph in the JSON graph format; `prompt_embeds` / `image_embeds` parts with vLLM's base64
tensor payload (rows already in the LLM's hidden space; needs `--enable-prompt-embeds`). Media parts
are counted, sized against the request's budget and decoded by `bridge.serve.media.RequestMedia`.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bridge.serve.chat_template import ChatTemplate
from bridge.serve.errors import ApiError, bounded
from bridge.serve.inputs import ServeLimits, check_prompt_bytes, check_text, decode_embeds
from bridge.serve.media import RequestMedia, b64_bytes
from bridge.serve.metrics import ServeMetrics
from bridge.serve.protocol import (
    AudioPart,
    ChatCompletionRequest,
    EmbedsPart,
    GraphPart,
    ImagePart,
    TextPart,
)
from runner.multimodal.encoder_protocol import PROMPT_EMBEDS_MODALITY
from runner.multimodal.placeholders import placeholder_token
from runner.multimodal.prompt_text import placeholder_fill_id, special_prefix

NO_TEMPLATE = ("this model's tokenizer has no chat template and it is not a Bridge run (whose recipe gives "
               "one); start the server with --chat-template FILE (a Jinja template) or use /v1/completions")
_MEDIA_PARTS = (ImagePart, AudioPart, GraphPart, EmbedsPart)


class ChatRenderer:
    """Builds engine prompts for one server (its tokenizer, template, encoders and limits)."""

    def __init__(self, tokenizer: Any, *, chat_template: ChatTemplate | None, encoders: dict[str, Any],
                 allowed_media_dir: Path | None, limits: ServeLimits, hidden_size: int, max_model_len: int,
                 metrics: ServeMetrics, sample_rates: Mapping[str, int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = chat_template  # chat_template.resolve_chat_template's choice
        self.encoders = encoders
        self.allowed_media_dir = allowed_media_dir.resolve() if allowed_media_dir else None
        self.limits = limits
        self.hidden_size = hidden_size
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.sample_rates = dict(sample_rates or {})  # the rate each audio encoder reads

    @property
    def has_template(self) -> bool:
        return self.tokenizer is not None and self.template is not None

    async def prompt(self, body: ChatCompletionRequest) -> dict[str, Any]:
        """The engine prompt of `body`: `prompt_token_ids`, and its media items when it has any."""
        if not self.has_template:
            raise ApiError(400, NO_TEMPLATE, param="messages")
        if body.continue_final_message and body.add_generation_prompt:
            raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")
        sep = self.template.part_separator
        media = RequestMedia(self.limits.media, self.sample_rates)
        media.count([f"messages[{i}].content[{j}]" for i, m in enumerate(body.messages)
                     if isinstance(m.content, list) for j, part in enumerate(m.content)
                     if isinstance(part, _MEDIA_PARTS)])
        conversation = []
        text_bytes = 0
        for i, message in enumerate(body.messages):
            content = message.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    texts.append(self._part(part, f"messages[{i}].content[{j}]", media))
                content = sep.join(texts)
            text = check_text(content or "", f"messages[{i}]")
            text_bytes = check_prompt_bytes(text, f"messages[{i}]", self.limits, before=text_bytes)
            conversation.append({"role": message.role, "content": text})
        items, uuids = await media.decode()
        ids = await asyncio.to_thread(self._render, conversation, body, list(items))
        prompt: dict[str, Any] = {"prompt_token_ids": ids}
        if items:
            prompt["multi_modal_data"] = items
            prompt["multi_modal_uuids"] = uuids
        return prompt

    def echo(self, body: ChatCompletionRequest) -> str:
        """vLLM's chat `echo`: the text the answer starts with, the last message's content when that
        message has the answer's role (the assistant's; the last message's own without a generation
        prompt), else nothing. Its text parts only: media are not text to repeat."""
        last = body.messages[-1]
        if not body.echo or (body.add_generation_prompt and last.role != "assistant"):
            return ""
        content = last.content
        if isinstance(content, list):
            content = self.template.part_separator.join(p.text for p in content if isinstance(p, TextPart))
        return content or ""

    def _render(self, conversation: list[dict], body: ChatCompletionRequest,
                modalities: list[str]) -> list[int]:
        kwargs = dict(body.chat_template_kwargs or {})
        for key in ("conversation", "tokenize", "chat_template", "add_generation_prompt",
                    "continue_final_message", "documents"):
            kwargs.pop(key, None)
        if body.documents is not None:
            kwargs["documents"] = body.documents
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, chat_template=self.template.source,
                **kwargs)
        except Exception as err:  # noqa: BLE001 - a template error is the caller's conversation's problem
            raise ApiError(400, f"the chat template failed on these messages: {type(err).__name__}: "
                           f"{bounded(err, 200)}", param="messages") from None
        ids = self.tokenize(text, modalities, add_special_tokens=bool(body.add_special_tokens))
        if not ids:
            raise ApiError(400, "the rendered conversation is empty", param="messages")
        return ids

    def tokenize(self, text: str, modalities: list[str], *, add_special_tokens: bool = False) -> list[int]:
        """Rendered text -> ids as training tokenizes a prompt: split at the placeholders of the request's
        modalities (one id each, found by the engine), the pieces between them encoded one by one; the
        tokenizer's special prefix first for the recipe's template or with `add_special_tokens`."""
        # runner.multimodal.prompt_text.split_at_placeholders without its memo (a caller's text is not
        # worth keeping, and a memo of many long ones would grow the server's memory)
        tok = self.tokenizer
        ids = special_prefix(tok) if self.template.special_prefix or add_special_tokens else []
        strings = sorted({placeholder_token(m, self.encoders.get(m)) for m in modalities}, key=len,
                         reverse=True)
        pos = 0
        if strings:
            for match in re.finditer("|".join(map(re.escape, strings)), text):
                if match.start() > pos:
                    ids.extend(tok.encode(text[pos:match.start()], add_special_tokens=False))
                ids.append(placeholder_fill_id(tok, match.group(0)))
                pos = match.end()
        if pos < len(text):
            ids.extend(tok.encode(text[pos:], add_special_tokens=False))
        return ids

    def _placeholder(self, modality: str, where: str) -> str:
        if modality != PROMPT_EMBEDS_MODALITY and modality not in self.encoders:
            known = sorted(self.encoders) or "none"
            raise ApiError(400, f"{where}: this model has no {modality} encoder (encoders: {known})",
                           param=where)
        return placeholder_token(modality, self.encoders.get(modality))

    def _part(self, part: Any, where: str, media: RequestMedia) -> str:
        """A part's text: its own, or its modality's placeholder once the item is sized and budgeted
        (decoded later, all together; a prompt-embeds payload now, bounded by its own byte cap)."""
        if isinstance(part, TextPart):
            return part.text
        if isinstance(part, ImagePart):
            token = self._placeholder("image", where)
            media.add_image(self._image_source(part.image_url.url, where), where)
            return token
        if isinstance(part, AudioPart):
            token = self._placeholder("audio", where)
            media.add_audio(b64_bytes(part.input_audio.data, where), where)
            return token
        if isinstance(part, GraphPart):
            token = self._placeholder("graph", where)
            media.add_graph(part.graph, where)
            return token
        if isinstance(part, EmbedsPart):
            if part.type == "prompt_embeds":
                if part.data is not None and part.prompt_embeds is not None:
                    raise ApiError(400, f"{where}: give the payload once, as 'data' (vLLM's key) or "
                                   "'prompt_embeds'", param=where)
                payload = part.data if part.data is not None else part.prompt_embeds
                if payload is None:
                    raise ApiError(400, f"{where}: a prompt_embeds part needs its 'data' field", param=where)
            else:
                payload = part.image_embeds
                if payload is None:
                    raise ApiError(400, f"{where}: an image_embeds part needs its 'image_embeds' field",
                                   param=where)
            tensor = decode_embeds(payload, where=where, hidden_size=self.hidden_size,
                                   max_model_len=self.max_model_len, limits=self.limits, metrics=self.metrics)
            token = self._placeholder(PROMPT_EMBEDS_MODALITY, where)
            media.add_ready(PROMPT_EMBEDS_MODALITY, tensor)
            return token
        raise ApiError(400, f"{where}: unsupported content part", param=where)

    def _image_source(self, url: str, where: str) -> bytes | Path:
        """A data URL's bytes, or a local file under the allowed path (opened lazily when sized)."""
        if url.startswith("data:"):
            header, sep, data = url.partition(",")
            if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
                raise ApiError(400, f"{where}: a data URL must look like data:image/png;base64,...",
                               param=where)
            return b64_bytes(data, where)
        if url.startswith(("http://", "https://")):
            raise ApiError(400, f"{where}: this server does not fetch URLs; send a data: URL", param=where)
        if self.allowed_media_dir is None:
            raise ApiError(400, f"{where}: local files are refused unless the server runs with "
                           "--allowed-local-media-path DIR", param=where)
        path = Path(url[len("file://"):] if url.startswith("file://") else url).resolve()
        if not path.is_relative_to(self.allowed_media_dir) or not path.is_file():
            raise ApiError(400, f"{where}: not a file under the allowed local media path", param=where)
        return path
