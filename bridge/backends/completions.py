"""vLLM's `/v1/completions` body for one prompt-embeds request, and its response back into the
runner's `RequestOutput`.

The body uses only fields of vLLM's `CompletionRequest` (vllm/entrypoints/openai/protocol.py), so a
real vLLM server started with `--enable-prompt-embeds` accepts it: `prompt_embeds` is base64 of
`torch.save` of a `(n, hidden)` tensor, the sampling fields carry `SamplingParams` one to one.
`return_token_ids` (vLLM >= 0.10.2) asks for the sampled token ids next to the text; a server that
does not know the field ignores it (vLLM logs unknown fields and goes on), and then the ids are
re-derived from the text with the local tokenizer (exact for most text, not for special tokens).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from bridge.backends.errors import RemoteError
from bridge.messages import bounded
from bridge.sampling_fields import PASSTHROUGH_FIELDS
from runner.outputs import CompletionOutput, RequestOutput
from runner.sampling_params import SamplingParams

TOKEN_ID_PREFIX = "token_id:"  # how vLLM spells a token with return_tokens_as_token_ids


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """The vLLM completion fields that reproduce `params` (None-valued ones left out)."""
    if params.prompt_logprobs is not None:
        raise ValueError("sampling_params.prompt_logprobs: a remote server gives no prompt logprobs for "
                         "prompt embeddings; leave it None")
    fields: dict[str, Any] = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "n": 1,
        "return_token_ids": True,
    }
    for name in PASSTHROUGH_FIELDS:
        value = getattr(params, name)
        fields[name] = list(value) if isinstance(value, (tuple, list)) else value
    if params.seed is not None:
        fields["seed"] = params.seed
    if params.stop_strings:
        fields["stop"] = list(params.stop_strings)
    if params.logprobs is not None:
        fields["logprobs"] = params.logprobs
        fields["return_tokens_as_token_ids"] = True
    if params.structured_outputs is not None:  # vLLM's field (>= 0.10.2), bridge serve's too
        fields["structured_outputs"] = params.structured_outputs.to_dict()
    return fields


def completion_body(
    prompt_embeds: str, params: SamplingParams, *, model: str | None, stream: bool = False
) -> dict[str, Any]:
    """The JSON body of one request (`prompt_embeds` already base64 text)."""
    body: dict[str, Any] = {"prompt_embeds": prompt_embeds, **sampling_fields(params)}
    if model is not None:
        body["model"] = model
    if stream:
        body["stream"] = True
    return body


def _json_safe_ascii(text: str) -> bool:
    """True when `text` can stand in a JSON string as is (base64 always can)."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def encode_body(body: Mapping[str, Any]) -> bytes:
    """JSON bytes of a body (tens of MB for big embeddings: called off the event loop).

    The base64 payload is spliced in rather than run through `json.dumps`, whose escape scan of a
    6 MB string costs about as much as torch.save and base64 together."""
    embeds = body.get("prompt_embeds")
    if not isinstance(embeds, str) or not _json_safe_ascii(embeds):
        return json.dumps(body, separators=(",", ":")).encode("ascii")
    rest = json.dumps({k: v for k, v in body.items() if k != "prompt_embeds"}, separators=(",", ":"))
    head = '{"prompt_embeds":"'
    return (head + embeds + ('",' + rest[1:] if rest != "{}" else '"}')).encode("ascii")


def _token_id(token: str, where: str) -> int:
    if not token.startswith(TOKEN_ID_PREFIX):
        raise RemoteError(f"{where}: expected a token as '{TOKEN_ID_PREFIX}N' (return_tokens_as_token_ids), "
                          f"got {bounded(token, 60)!r}; this server cannot report logprobs by token id")
    return int(token[len(TOKEN_ID_PREFIX):])


def parse_logprobs(logprobs: Mapping[str, Any] | None) -> list[dict[int, float]] | None:
    """vLLM's completion logprobs (tokens as 'token_id:N') -> the runner's [{token_id: logprob}]."""
    if not logprobs:
        return None
    rows: list[dict[int, float]] = []
    tops = logprobs.get("top_logprobs") or [None] * len(logprobs.get("tokens", []))
    for token, value, top in zip(logprobs.get("tokens", []), logprobs.get("token_logprobs", []), tops):
        row = {_token_id(k, "logprobs.top_logprobs"): float(v) for k, v in (top or {}).items()}
        row[_token_id(token, "logprobs.tokens")] = float(value)
        rows.append(row)
    return rows


def token_ids_of(choice: Mapping[str, Any], tokenizer) -> list[int]:
    """The sampled ids: the server's `token_ids` when it sent them, else the text re-tokenized."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return list(ids)
    if tokenizer is None:
        raise RemoteError("the server returned no token_ids (return_token_ids) and no tokenizer was given "
                          "to re-tokenize the text")
    return list(tokenizer.encode(choice.get("text") or "", add_special_tokens=False))


def parse_completion(
    data: Any, *, request_id: str, prompt_token_ids: list[int], tokenizer=None
) -> RequestOutput:
    """A non-streaming `/v1/completions` response (one choice) -> `RequestOutput`."""
    try:
        choice = data["choices"][0]
        text = choice["text"]
    except (KeyError, IndexError, TypeError):
        raise RemoteError(f"not a completions response: {bounded(json.dumps(data), 200)}") from None
    logprobs = parse_logprobs(choice.get("logprobs"))
    ids = token_ids_of(choice, tokenizer)
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=ids,
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        logprobs=logprobs,
        cumulative_logprob=sum(r[t] for r, t in zip(logprobs, ids)) if logprobs else None,
    )
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt_token_ids),
                         outputs=[completion], finished=True)
