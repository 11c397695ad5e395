"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Every request body is a model here, so `/openapi.json` describes exactly what the server accepts
(schema-driven fuzzers read it). Field names, defaults and shapes follow OpenAI's API with vLLM's
extensions (`prompt_embeds`, `top_k`, `min_tokens`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos`, `prompt_logprobs`, `include_stop_str_in_output`, `return_token_ids`,
`structured_outputs`, `response_format`, ...). Fields a model here does not declare are kept
(`extra="allow"`) so that `bridge.serve.request_fields` can refuse vLLM's fields this server does not
implement (a 400 naming the field) and log the unknown ones once by name, as vLLM logs the fields it
ignores: nothing a client sends is dropped without a word. Inside `structured_outputs` and
`response_format` unknown keys are refused, since a misspelt constraint would silently leave the output
unconstrained. Values are range-checked again by `runner.SamplingParams`; pydantic checks types
(strict: `"1"` is not an int, `1` is not a str).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = StrictInt | StrictFloat


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's seed range


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of `json` (a JSON schema), `regex`, `choice`, `grammar`
    (EBNF or Lark), `json_object: true`."""

    json_schema: dict[str, Any] | StrictStr | None = Field(default=None, alias="json",
                                                          description="a JSON schema (object or JSON text)")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False


class JsonSchemaFormat(_Strict):
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Body):
    """The sampling fields completions and chat share."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = Field(default=None, ge=0)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    seed: StrictInt | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(default=0, ge=0)
    n: StrictInt = Field(default=1, ge=1)
    presence_penalty: Number = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: Number = Field(default=1.0, gt=0)
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    prompt_logprobs: StrictInt | None = Field(
        default=None, ge=-1, description="vLLM's: logprobs of each prompt token (and the top k); -1: all")
    return_token_ids: StrictBool | None = Field(
        default=None, description="vLLM's: also return the prompt's and each choice's token ids")
    return_tokens_as_token_ids: StrictBool | None = Field(
        default=None, description="vLLM's: tokens in logprobs spelt 'token_id:N'")
    add_special_tokens: StrictBool | None = Field(
        default=None, description="vLLM's: the tokenizer's special tokens (BOS) before the prompt "
        "(default: true for completions; false for chat, whose template writes its own)")
    structured_outputs: StructuredOutputs | None = None
    response_format: ResponseFormat | None = None


TokenIds = list[StrictInt]


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. Give `prompt`, `prompt_embeds` or both (vLLM: the embeds prompts come
    first, then the text/token prompts; choice `index` = prompt_index * n + sample_index)."""

    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds] | None = None
    prompt_embeds: StrictStr | list[StrictStr] | None = Field(
        default=None, description="base64 of torch.save of a (n, hidden) tensor (vLLM's format), or a list")
    max_tokens: StrictInt | None = Field(default=None, ge=0,
                                         description="0 only with echo (the prompt alone)")
    logprobs: StrictInt | None = Field(default=None, ge=0)
    echo: StrictBool = False


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Body):
    url: StrictStr
    detail: StrictStr | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(_Body):
    data: StrictStr = Field(description="base64 of a WAV file")
    format: Literal["wav"] = "wav"


class AudioPart(_Body):
    type: Literal["input_audio"]
    input_audio: InputAudio


class GraphPart(_Body):
    type: Literal["graph"]
    graph: dict[str, Any] = Field(description="a graph in the README's JSON graph format")


class EmbedsPart(_Body):
    """vLLM's embeddings-as-content: rows already in the LLM's hidden space (base64 torch.save). vLLM
    spells a prompt-embeds part `{"type": "prompt_embeds", "data": ...}` and an image-embeds part
    `{"type": "image_embeds", "image_embeds": ...}`; a prompt-embeds part may also carry its payload
    under `prompt_embeds` (Bridge's earlier spelling)."""

    type: Literal["prompt_embeds", "image_embeds"]
    data: StrictStr | None = None
    prompt_embeds: StrictStr | None = None
    image_embeds: StrictStr | None = None


ContentPart = Annotated[TextPart | ImagePart | AudioPart | GraphPart | EmbedsPart,
                        Field(discriminator="type")]


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    documents: list[dict[str, StrictStr]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    echo: StrictBool = Field(default=False, description="vLLM's: the answer starts with the last message's "
                             "content when that message is the assistant's")


# ----------------------------------------------------------------------------- responses


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's `Logprob`: one token's entry in `prompt_logprobs` (`rank` is None when the token is
    outside the top k the request asked for)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # keyed by token id; the first position is None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's fields)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's field)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's fields, at the top as vLLM puts them
    prompt_token_ids: list[int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "bridge"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
