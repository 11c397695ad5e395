"""The sampling fields that cross the wire unchanged, listed once for both directions: `bridge serve`
reads them from a request body into `SamplingParams`, and the remote backend writes them from
`SamplingParams` into a vLLM request body. Each is a `SamplingParams` attribute and a vLLM request
field of the same name and meaning; the fields that need a translation (`temperature`, `top_p` and
`top_k` with OpenAI's null defaults, `max_tokens`, `seed` per sample, `stop`, `logprobs`) are handled
by each side."""

from __future__ import annotations

PASSTHROUGH_FIELDS: tuple[str, ...] = (
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
