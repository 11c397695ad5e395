"""What a request asked to see beyond the generated text (vLLM's extensions), and their JSON shapes.

- `return_token_ids`: each choice's generated `token_ids`, and the prompt's `prompt_token_ids` (a
  completion choice carries its prompt's; a chat answer carries them at the top, as vLLM does).
- `prompt_logprobs`: per prompt position, `{token_id: {"logprob", "rank", "decoded_token"}}` for the
  prompt's token and the top k; the first position is null (nothing predicts it).
- completions' `echo`: each choice's text starts with its prompt's text, and with `logprobs` its
  logprobs start with the prompt's (the first null); with `max_tokens: 0` the prompt alone is shown.
- chat's `echo`: the answer starts with the last message's content when that message has its role.
- `return_tokens_as_token_ids`: logprobs spell each token `token_id:N` (`generation.TokenText`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bridge.serve.protocol import PromptLogprob, PromptLogprobs


@dataclass
class ResponseOptions:
    """The extras one request asked for (see the module docstring)."""

    return_token_ids: bool = False
    prompt_logprobs: bool = False
    echo: Sequence[str] | None = None  # completions: per prompt, the text its choices start with
    echo_logprobs: bool = False  # completions: the prompt's logprobs lead each choice's logprobs
    prompt_only: bool = False  # completions' echo with max_tokens 0: nothing generated is shown
    chat_echo: str = ""  # chat: the text the answer starts with


def prompt_logprobs_json(entries: Sequence[dict[int, float] | None] | None, prompt_ids: Sequence[int] | None,
                         k: int, token_text: Callable[[int], str]) -> PromptLogprobs | None:
    """The engine's prompt logprobs (`[None, {token_id: logprob}, ...]`, each the top `k` and the prompt's
    token) in vLLM's response shape. A rank is known for the top k (their order); the prompt's token,
    when it is not among them (k + 1 entries), has rank None: the engine does not count the tokens above
    it."""
    if entries is None:
        return None
    out: PromptLogprobs = []
    for pos, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        actual = prompt_ids[pos] if prompt_ids is not None and pos < len(prompt_ids) else None
        outside = len(entry) > k  # the prompt's token came on top of the k best
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        row: dict[str, PromptLogprob] = {}
        rank = 0
        for t, v in ranked:
            unranked = outside and t == actual
            rank += not unranked
            row[str(t)] = PromptLogprob(logprob=_finite(v), rank=None if unranked else rank,
                                        decoded_token=token_text(t))
        out.append(row)
    return out


def _finite(value: float) -> float:
    value = float(value)
    return value if value == value and abs(value) != float("inf") else -9999.0


__all__ = ["ResponseOptions", "prompt_logprobs_json"]
