"""From request bodies to engine prompts and `SamplingParams` (everything before the engine loop).

Prompt-embeds payloads are decoded here, with `bridge.load_prompt_embeds` (weights-only loading,
the archive inspected and sparse tensors' declared size checked before anything is densified) in
the event loop (see `decode_embeds` for why not a thread); the decode time goes to `/metrics`.
Text prompts are tokenized here too, in a worker thread, never in the engine's tick: a prompt whose
UTF-8 size is over `max_prompt_bytes` is refused before it is tokenized (`check_prompt_bytes`), and the
engine gets token ids. Every problem is an `ApiError(400)` naming the field.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from bridge.sampling_fields import PASSTHROUGH_FIELDS
from bridge.serve.errors import ApiError
from bridge.serve.ingest import DecodedEmbeds
from bridge.serve.metrics import ServeMetrics
from bridge.serve.protocol import ChatCompletionRequest, CompletionRequest
from bridge.serve.structured import structured_outputs
from bridge.wire import load_prompt_embeds
from encoders.media_budget import MediaLimits
from runner.sampling_params import SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
EMBEDS_FLAG_MESSAGE = ("prompt_embeds are disabled on this server; start it with --enable-prompt-embeds "
                       "to accept them")


@dataclass
class ServeLimits:
    """Per-request limits (CLI flags)."""

    max_prompts: int = 256
    max_n: int = 16
    max_prompt_embeds_bytes: int = 256 * 2**20
    enable_prompt_embeds: bool = False
    media: MediaLimits = field(default_factory=MediaLimits)
    max_prompt_bytes: int | None = None  # None: no limit (a server sets it from the context, see below)


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the UTF-8 bytes of text one token of `tokenizer` stands for: its longest vocabulary
    entry, in bytes of the entry's own spelling (byte-level BPE spells a byte as one character of one or
    two bytes, SentencePiece a space as three, so the spelling is never shorter than the text)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary view: assume a generous bound
        return 64
    return max((len(str(token).encode("utf-8", "replace")) for token in vocab), default=1)


def default_max_prompt_bytes(tokenizer: Any, max_model_len: int) -> int:
    """The smallest text size no prompt that fits the context exceeds: the context times the longest token."""
    return max_model_len * longest_token_bytes(tokenizer)


def check_prompt_bytes(text: str, where: str, limits: ServeLimits, *, before: int = 0) -> int:
    """`before` plus the UTF-8 size of `text`, or a 400 when that is over `limits.max_prompt_bytes`
    (checked before the text is tokenized: at that size it cannot fit the context)."""
    cap = limits.max_prompt_bytes
    if cap is None:
        return before
    # a character is at least one byte: a text of more characters than the cap is refused uncounted
    at_least = len(text) > cap
    total = before + (len(text) if at_least else len(text.encode("utf-8", "surrogatepass")))
    if total > cap:
        size = f"at least {total}" if at_least else str(total)
        raise ApiError(400, f"{where}: {size} bytes of prompt text are over this server's limit of {cap} "
                       "bytes (--max-prompt-bytes; by default the context length times the tokenizer's "
                       "longest token, so no longer prompt can fit)", param=where)
    return total


def check_text(text: str, where: str) -> str:
    """A string from the caller that the tokenizer can take: valid Unicode (JSON can smuggle in lone
    surrogates, which no UTF-8 tokenizer accepts)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{where}: the text is not valid Unicode (a lone surrogate?)",
                       param=where) from None
    return text


def sampling_params(body: CompletionRequest | ChatCompletionRequest, *, max_tokens: int, logprobs: int | None,
                    seed: int | None, prompt_logprobs: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """The engine's params for one sample of `body` (ValueError from SamplingParams -> 400);
    `structured`: its checked output constraint (`bridge.serve.structured`)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=-1 if body.top_k is None else body.top_k,
            seed=seed, stop=body.stop, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            structured_outputs=structured, **{name: getattr(body, name) for name in PASSTHROUGH_FIELDS},
        )
    except ValueError as exc:
        raise ApiError(400, str(exc), param=_field_of(str(exc))) from None


def _field_of(message: str) -> str | None:
    """The field a SamplingParams message names first (`"min_tokens must be ..."` -> "min_tokens")."""
    head = message.split(" ", 1)[0].split("[", 1)[0]
    return head if head.isidentifier() else None


def check_prompt_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The request's `prompt_logprobs` as the engine takes it, checked as vLLM checks it: not with a
    stream (vLLM sends no prompt logprobs in chunks), at most `MAX_LOGPROBS` (-1, "the whole
    vocabulary", is over it, as it is on a vLLM server with its default cap)."""
    k = body.prompt_logprobs
    if k is None:
        return None
    if body.stream:
        raise ApiError(400, "prompt_logprobs are not available when stream=true", param="prompt_logprobs")
    if k == -1 or k > MAX_LOGPROBS:
        raise ApiError(400, f"prompt_logprobs must be at most {MAX_LOGPROBS}, got {k}",
                       param="prompt_logprobs")
    return k


def samples_params(body: CompletionRequest | ChatCompletionRequest, *, max_tokens: int, logprobs: int | None,
                   limits: ServeLimits, prompt_logprobs: int | None = None) -> list[SamplingParams]:
    """One params per sample (n of them). With a seed, sample j uses seed + j, as vLLM does for n > 1,
    so the n samples differ yet the request is reproducible."""
    for i, stop in enumerate([body.stop] if isinstance(body.stop, str) else body.stop or []):
        check_text(stop, f"stop[{i}]")
    if body.n > limits.max_n:
        raise ApiError(400, f"n must be at most {limits.max_n}, got {body.n}", param="n")
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise ApiError(400, f"logprobs must be at most {MAX_LOGPROBS}, got {logprobs}", param="logprobs")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options can only be given with stream=true", param="stream_options")
    seeds = [None if body.seed is None else body.seed + j for j in range(body.n)]
    structured = structured_outputs(body)
    return [sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, seed=s,
                            prompt_logprobs=prompt_logprobs, structured=structured) for s in seeds]


def decode_embeds(payload: str, *, where: str, hidden_size: int, max_model_len: int,
                  limits: ServeLimits, metrics: ServeMetrics) -> torch.Tensor:
    """One base64 `torch.save` payload -> a `(n, hidden)` CPU tensor, or a 400 naming `where`."""
    if not limits.enable_prompt_embeds:
        raise ApiError(400, EMBEDS_FLAG_MESSAGE, param=where)
    start = time.perf_counter()
    try:
        # NaN/Inf: the engine checks every prompt when it admits the request (on the device on a
        # GPU) and the 400 names the prompt; checking here too cost more than the decode itself.
        # In the event loop, not a thread: the decode holds the GIL either way, and in a thread it
        # waits out the interpreter's switch interval behind the loop's own JSON parsing.
        tensor = load_prompt_embeds(payload, hidden_size=hidden_size,
                                    max_bytes=limits.max_prompt_embeds_bytes, max_rows=max_model_len,
                                    check_finite=False)
    except ValueError as exc:
        raise ApiError(400, f"{where}: {exc}", param=where) from None
    finally:
        metrics.decode_seconds.observe(time.perf_counter() - start)
    return tensor


def predecoded_embeds(decoded: DecodedEmbeds, *, where: str, metrics: ServeMetrics) -> torch.Tensor:
    """A payload the ingest pool already decoded with the same checks: its tensor or its 400."""
    metrics.decode_seconds.observe(decoded.seconds)
    if decoded.tensor is None:
        raise ApiError(400, f"{where}: {decoded.error}", param=where)
    return decoded.tensor


async def completion_prompts(body: CompletionRequest, *, hidden_size: int, max_model_len: int,
                             limits: ServeLimits, metrics: ServeMetrics,
                             decoded: list[DecodedEmbeds] | None = None, tokenizer: Any = None) -> list[Any]:
    """The engine prompts of a completions request: embeds prompts first, then text / token prompts.
    `decoded`: the body's payloads as the ingest pool decoded them (ingest.py), in order. With a
    `tokenizer`, text prompts become token ids here (in a worker thread), as the engine would make them."""
    if body.prompt is None and body.prompt_embeds is None:
        raise ApiError(400, "give 'prompt' or 'prompt_embeds'", param="prompt")
    prompts: list[Any] = []
    embeds = body.prompt_embeds
    if embeds is not None:
        payloads = [embeds] if isinstance(embeds, str) else embeds
        if not payloads:
            raise ApiError(400, "prompt_embeds is an empty list", param="prompt_embeds")
        if len(payloads) > limits.max_prompts:
            raise ApiError(400, f"at most {limits.max_prompts} prompts per request, got {len(payloads)}",
                           param="prompt_embeds")
        if not limits.enable_prompt_embeds:
            raise ApiError(400, EMBEDS_FLAG_MESSAGE, param="prompt_embeds")
        if decoded is not None and len(decoded) != len(payloads):
            decoded = None  # cannot happen (the pool decodes all or none); decode here if it does
        for i, payload in enumerate(payloads):
            where = "prompt_embeds" if isinstance(embeds, str) else f"prompt_embeds[{i}]"
            if decoded is not None:
                prompts.append({"prompt_embeds": predecoded_embeds(decoded[i], where=where, metrics=metrics)})
                continue
            tensor = decode_embeds(payload, where=where, hidden_size=hidden_size,
                                   max_model_len=max_model_len, limits=limits, metrics=metrics)
            prompts.append({"prompt_embeds": tensor})
    prompt = body.prompt
    if embeds is not None and prompt == "":
        prompt = None  # vLLM's users send prompt="" with prompt_embeds (the openai client needs a prompt)
    if prompt is not None:
        items, single = prompt_items(prompt)
        if not items:
            raise ApiError(400, "prompt is an empty list", param="prompt")
        if len(prompts) + len(items) > limits.max_prompts:
            raise ApiError(400, f"at most {limits.max_prompts} prompts per request, got "
                           f"{len(prompts) + len(items)}", param="prompt")
        texts: list[tuple[int, str, str]] = []  # (index in prompts, field, text)
        for i, item in enumerate(items):
            where = "prompt" if single else f"prompt[{i}]"
            if isinstance(item, str):
                check_prompt_bytes(check_text(item, where), where, limits)
                texts.append((len(prompts), where, item))
                prompts.append(item)
            else:
                prompts.append({"prompt_token_ids": _within_context(list(item), where, max_model_len)})
        if texts and tokenizer is not None:
            special = body.add_special_tokens is not False  # vLLM's default for completions: true
            encoded = await asyncio.to_thread(
                lambda: [list(tokenizer.encode(t, add_special_tokens=special)) for _, _, t in texts])
            for (k, where, _), ids in zip(texts, encoded):
                prompts[k] = {"prompt_token_ids": _within_context(ids, where, max_model_len)}
    return prompts


def prompt_items(prompt: Any) -> tuple[list[Any], bool]:
    """A completions `prompt` as its list of prompts, and whether it was one prompt (a string or one
    list of token ids) rather than a list of them."""
    single = isinstance(prompt, str) or bool(prompt and all(isinstance(t, int) for t in prompt))
    return ([prompt] if single else list(prompt)), single


async def echo_texts(body: CompletionRequest, tokenizer: Any) -> list[str]:
    """Completions' `echo`: the text each prompt's choices start with: a text prompt's own text, a
    token-id prompt's ids decoded; none with `return_token_ids`, as vLLM does (the ids are returned)."""
    if body.prompt is None:
        return []
    items, single = prompt_items(body.prompt)
    if body.return_token_ids:
        return [""] * len(items)
    if tokenizer is None and not all(isinstance(item, str) for item in items):
        raise ApiError(400, "echo of a token-id prompt needs the model's tokenizer, and this server has none",
                       param="echo")
    return await asyncio.to_thread(lambda: [item if isinstance(item, str) else tokenizer.decode(list(item))
                                            for item in items])


def _within_context(ids: list[int], where: str, max_model_len: int) -> list[int]:
    if len(ids) > max_model_len:
        raise ApiError(400, f"{where}: {len(ids)} tokens exceed this model's maximum context length of "
                       f"{max_model_len} tokens", param=where)
    return ids
