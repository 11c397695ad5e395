"""Structured outputs through `bridge serve`: vLLM's `structured_outputs` and OpenAI's `response_format`
on completions and chat, against the same constraint offline; a bad constraint is a 400 naming the
field, and nothing reaches the engine."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from serve_helpers import API_KEY

from bridge.backends.completions import sampling_fields
from runner.sampling_params import SamplingParams, StructuredOutputsParams

# One property: OpenAI's response_format cannot turn off free whitespace between JSON tokens, which a random
# model takes often, so a small object is what finishes well within the server's context.
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
          "required": ["color"], "additionalProperties": False}
CHOICES = ["cat", "dog", "bird"]


@pytest.fixture(scope="module")
def client(text_server):
    return openai.OpenAI(base_url=text_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _offline(llm, prompt_ids, so, *, seed, n=1, max_tokens=48):
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + j, structured_outputs=so)
              for j in range(n)]
    return [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": prompt_ids}] * n, params)]


def test_completions_structured_outputs_and_response_format(client, offline_llm):
    ids = [12, 40, 77]
    r = client.completions.create(model="tiny", prompt=ids, n=4, seed=3, temperature=1.0, max_tokens=16,
                                  extra_body={"structured_outputs": {"choice": CHOICES}})
    texts = [c.text for c in r.choices]
    assert all(t in CHOICES for t in texts) and all(c.finish_reason == "stop" for c in r.choices)
    assert texts == _offline(offline_llm, ids, StructuredOutputsParams(choice=CHOICES), seed=3, n=4)

    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    r = client.completions.create(model="tiny", prompt=ids, n=3, seed=5, temperature=1.0, max_tokens=120,
                                  extra_body={"response_format": fmt})
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    want = _offline(offline_llm, ids, StructuredOutputsParams(json=SCHEMA), seed=5, n=3, max_tokens=120)
    assert [c.text for c in r.choices] == want


def test_chat_response_format_and_structured_outputs(client, offline_llm):
    messages = [{"role": "user", "content": "pick one"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    r = client.chat.completions.create(model="tiny", messages=messages, seed=1, temperature=1.0,
                                       max_tokens=100, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(model="tiny", messages=messages, n=3, seed=2, temperature=1.0,
                                       max_tokens=16, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert all(c.message.content in CHOICES for c in r.choices)
    stream = client.chat.completions.create(model="tiny", messages=messages, seed=4, temperature=1.0,
                                            max_tokens=48, stream=True,
                                            extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(text) == 6 and text[3] == "-" and text[:3].isalpha() and text[4:].isdigit()
    r = client.chat.completions.create(model="tiny", messages=messages, seed=6, temperature=1.0,
                                       max_tokens=8, response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0.0, max_tokens=4,
                                       response_format={"type": "text"})
    assert r.choices[0].finish_reason in ("stop", "length")


BAD = [
    ("/v1/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("/v1/completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ("/v1/completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ("/v1/completions", {"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
    ("/v1/completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("/v1/completions", {"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"guided_json": {}}}, "structured_outputs.guided_json"),
    ("/v1/chat/completions", {"structured_outputs": {"choice": ["a"]},
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/completions", {"structured_outputs": {"choice": ["a"]}, "min_tokens": 2}, None),
]


@pytest.mark.parametrize(("path", "extra", "param"), BAD)
def test_bad_constraint_is_a_400_naming_the_field(text_server, path, extra, param):
    body = {"model": "tiny", "max_tokens": 4, **extra}
    body.update({"prompt": [5, 6, 7]} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "hi"}]})
    r = httpx.post(text_server.url + path, json=body, headers=text_server.headers, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param and param.split(".")[0] in error["message"]
    else:
        assert "min_tokens" in error["message"]


def test_remote_backend_sends_structured_outputs():
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    fields = sampling_fields(SamplingParams(max_tokens=8, structured_outputs=so))
    assert fields["structured_outputs"] == {"json": SCHEMA, "disable_any_whitespace": True}
    assert "structured_outputs" not in sampling_fields(SamplingParams(max_tokens=8))
