"""Malformed and hostile requests against a live server: each gets a 4xx, never a 5xx; no code runs;
the server answers /health after every batch and holds no KV block, slot or live request after.

Two sources: schemathesis generating schema-violating bodies from the server's own /openapi.json
(negative mode, a bounded number of examples per operation), and hand-made hostile payloads
(pickles that run code, sparse and zip bombs, wrong dtypes and shapes, huge bodies, broken base64,
bad UTF-8, a wrong type in every field).
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import struct
import wave

import httpx
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, given, settings
from serve_helpers import MAX_MODEL_LEN
from wire_crafting import b64, deflate_bomb, pickle_archive, saved_entries, zip_entries

from bridge import encode_prompt_embeds

HIDDEN = 64
MARKER = "/tmp/bridge_serve_fuzz_pwned"


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def _saved(obj) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return b64(buffer.getvalue())


def _hostile_embeds() -> dict[str, str]:
    """Payloads for prompt_embeds: each must be refused before anything reaches the engine."""
    code_pickle = pickle.dumps(_RunsCode(), protocol=2)
    sparse_bomb = torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]), (10**7, HIDDEN))
    ok = torch.randn(4, HIDDEN)
    entries = saved_entries(ok)
    pkl = next(n for n in entries if n.endswith("data.pkl"))
    return {
        "code pickle in an archive": b64(pickle_archive(code_pickle)),
        "bare code pickle": b64(code_pickle),
        "code pickle beside a tensor": b64(zip_entries({**entries, pkl: code_pickle})),
        "a saved dict of ints": _saved({"x": 1}),
        "sparse bomb": _saved(sparse_bomb),
        "zip bomb": b64(deflate_bomb(2**26, HIDDEN)),
        "int64": _saved(torch.ones(4, HIDDEN, dtype=torch.int64)),
        "bool": _saved(torch.ones(4, HIDDEN, dtype=torch.bool)),
        "complex": _saved(torch.ones(4, HIDDEN, dtype=torch.complex64)),
        "uint8": _saved(torch.ones(4, HIDDEN, dtype=torch.uint8)),
        "1-D": _saved(torch.randn(HIDDEN)),
        "3-D batch 2": _saved(torch.randn(2, 4, HIDDEN)),
        "4-D": _saved(torch.randn(1, 1, 4, HIDDEN)),
        "wrong hidden": _saved(torch.randn(4, HIDDEN + 1)),
        "no rows": _saved(torch.randn(0, HIDDEN)),
        "over the context": _saved(torch.randn(MAX_MODEL_LEN + 1, HIDDEN)),
        "over the byte cap": _saved(torch.randn(2000, HIDDEN)),
        "NaN": _saved(torch.full((4, HIDDEN), float("nan"))),
        "Inf": _saved(torch.full((4, HIDDEN), float("inf"))),
        "a list of tensors": _saved([ok, ok]),
        "a dict": _saved({"prompt_embeds": ok}),
        "empty": "",
        "not base64": "!!!not base64!!!",
        "bad padding": "abc",
        "base64 of junk": base64.b64encode(os.urandom(300)).decode(),
        "base64 of text": base64.b64encode(b"hello").decode(),
        "truncated archive": encode_prompt_embeds(ok)[:200],
        "unicode": "é" * 40,
        "whitespace": "   \n\t ",
    }


def _wav(rate: int = 16000) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(struct.pack("<4h", 0, 1, 2, 3))
    return base64.b64encode(buf.getvalue()).decode()


# A wrong value for every field of the completions body (types, ranges, shapes).
BAD_FIELDS = {
    "prompt": [5, 1.5, True, {"a": 1}, [], [[]], [1, "a"], [[1], "a"], [-1], [10**9], [[2**63]], [1.5], None],
    "prompt_embeds": [5, True, ["ok", 5], [], {"a": 1}, [[1.0]]],
    "max_tokens": ["5", 5.5, 0, -1, True, [], {}, 10**6],
    "temperature": ["hot", -1, True, [], {}],
    "top_p": ["a", 0, -0.5, 1.5, True, []],
    "top_k": ["a", -2, 1.5, True, []],
    "seed": ["a", 1.5, True, [], 2**70, 2**63, -(2**63) - 1],
    "stop": [5, [5], [""], "", {"a": 1}, [None]],
    "stop_token_ids": ["a", [1.5], ["a"], 5, [2**70]],
    "ignore_eos": ["yes", 1, [], None],
    "min_tokens": ["1", -1, 1.5, 1000],
    "logprobs": ["1", -1, 1.5, 21, True],
    "n": ["2", 0, -1, 1.5, 9, True],
    "presence_penalty": ["a", 3, -3, True],
    "frequency_penalty": ["a", 3, -3, []],
    "repetition_penalty": ["a", 0, -1, True],
    "stream": ["yes", 1, []],
    "stream_options": ["a", 1, {"include_usage": "yes"}],
    "user": [5, [], {}],
    "model": [5, [], "no-such-model"],
    "echo": ["yes", 1],
    "suffix": ["x", 5],
    "skip_special_tokens": ["no", 0],
    # vLLM's fields: wrong types and values, and those this server refuses
    "prompt_logprobs": ["1", -2, -1, 21, 1.5, True],
    "include_stop_str_in_output": ["yes", 1],
    "return_token_ids": ["yes", 1],
    "return_tokens_as_token_ids": ["yes"],
    "add_special_tokens": ["no", 0],
    "min_p": [0.5, "a"],
    "logit_bias": [{"1": 5}],
    "response_format": [{"type": "json_schema", "json_schema": {}}, "text", {"type": "xml"}],
    "structured_outputs": [{"choice": []}, {"regex": "a("}, {"choise": ["a"]}, "json"],
    "guided_json": [{"type": "object"}],
    "use_beam_search": [True],
    "tools": [[{"type": "function", "function": {"name": "f"}}]],
    "cache_salt": ["salt"],
}

BAD_MESSAGES = [
    [], "hi", [{"content": "x"}], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "video", "video": "x"}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!!"}}]}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": "not an object"}]}],
    [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": _wav()}}]}],
    [{"role": "user", "content": [{"type": "graph", "graph": {"num_nodes": 2, "edges": [[0, 1]]}}]}],
    [{"role": "user", "content": [{"type": "prompt_embeds"}]}],
    [{"role": "user", "content": [{"type": "prompt_embeds", "prompt_embeds": "!!!"}]}],
    [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": _saved(torch.randn(3, 7))}]}],
    [{"role": "user", "content": "x" * 2000}],
]


def _hostile_requests() -> list[tuple[str, str, dict | bytes, dict]]:
    """(name, path, json body or raw bytes, extra headers)."""
    out: list[tuple[str, str, dict | bytes, dict]] = []
    for name, payload in _hostile_embeds().items():
        out.append((f"embeds {name}", "/v1/completions", {"prompt_embeds": payload, "max_tokens": 2}, {}))
        out.append((f"embeds list {name}", "/v1/completions",
                    {"prompt_embeds": [encode_prompt_embeds(torch.randn(2, HIDDEN)), payload],
                     "max_tokens": 2}, {}))
        out.append((f"chat embeds {name}", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "prompt_embeds", "prompt_embeds": payload}]}], "max_tokens": 2}, {}))
    for field, values in BAD_FIELDS.items():
        for value in values:
            body = {"prompt": "hi", "max_tokens": 2, field: value}
            out.append((f"completions {field}={str(value)[:30]}", "/v1/completions", body, {}))
            if field not in ("prompt", "prompt_embeds", "logprobs", "echo", "suffix"):
                chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
                out.append((f"chat {field}={str(value)[:30]}", "/v1/chat/completions", chat, {}))
    for i, messages in enumerate(BAD_MESSAGES):
        out.append((f"messages {i}", "/v1/chat/completions", {"messages": messages, "max_tokens": 2}, {}))
    for name, extra in {"logprobs": {"logprobs": "yes"}, "top_logprobs": {"top_logprobs": 2},
                        "top_logprobs -1": {"logprobs": True, "top_logprobs": -1},
                        "max_completion_tokens": {"max_completion_tokens": 0},
                        "template kwargs": {"chat_template_kwargs": "x"}}.items():
        out.append((f"chat {name}", "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "hi"}], **extra}, {}))
    raw = {
        "bad utf-8": b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}',
        "lone surrogate": b'{"prompt": "\\ud800", "max_tokens": 2}',
        "not json": b"prompt=hi",
        "truncated json": b'{"prompt": "hi", ',
        "json list": b"[1, 2, 3]",
        "json string": b'"hi"',
        "json null": b"null",
        "nan temperature": b'{"prompt": "hi", "temperature": NaN}',
        "infinite top_p": b'{"prompt": "hi", "top_p": Infinity}',
        "deep nesting": b"[" * 100_000 + b"]" * 100_000,
        "empty": b"",
        "huge body": b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}',
        "huge prompt": b'{"prompt": "' + b"word " * 300 + b'", "max_tokens": 2}',
        "too many prompts": ('{"prompt": [' + ",".join(['"a"'] * 17) + '], "max_tokens": 1}').encode(),
    }
    for name, body in raw.items():
        for path in ("/v1/completions", "/v1/chat/completions"):
            out.append((f"raw {name} {path}", path, body, {"content-type": "application/json"}))
    return out


def _assert_healthy(server) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    server.wait_idle()
    assert not os.path.exists(MARKER), "a payload ran code on the server"


def test_hand_made_hostile_requests_get_4xx(text_server):
    if os.path.exists(MARKER):
        os.remove(MARKER)
    cases = _hostile_requests()
    assert len(cases) >= 300
    bad = []
    with httpx.Client(base_url=text_server.url, headers=text_server.headers, timeout=60) as http:
        for k, (name, path, body, headers) in enumerate(cases):
            try:
                if isinstance(body, bytes):
                    r = http.post(path, content=body, headers=headers)
                else:
                    r = http.post(path, json=body, headers=headers)
            except httpx.HTTPError as err:
                bad.append((name, type(err).__name__, str(err)[:200]))
                continue
            ok = 400 <= r.status_code < 500
            if ok:
                error = r.json()["error"]
                ok = set(error) == {"message", "type", "param", "code"} and len(error["message"]) <= 600
                ok = ok and "Traceback" not in r.text
            if not ok:
                bad.append((name, r.status_code, r.text[:300]))
            if k % 100 == 99:
                _assert_healthy(text_server)
    assert not bad, bad[:10]
    _assert_healthy(text_server)
    # the server still generates after all that
    r = httpx.post(text_server.url + "/v1/completions", headers=text_server.headers, timeout=60,
                   json={"prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_schema_driven_negative_fuzzing_gets_4xx(text_server, path):
    """schemathesis generates bodies that violate /openapi.json; every one gets a 4xx."""
    schema = schemathesis.openapi.from_url(text_server.url + "/openapi.json")
    operation = schema[path]["POST"]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE)
    statuses: list[int] = []
    bad: list[tuple[int, str]] = []
    with httpx.Client(base_url=text_server.url, headers=text_server.headers, timeout=60) as http:

        @settings(max_examples=130, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def run(case) -> None:
            kwargs = case.as_transport_kwargs(base_url=text_server.url)
            r = http.request(kwargs["method"], path, params=kwargs.get("params"),
                             headers={**(kwargs.get("headers") or {}), **text_server.headers},
                             **({"json": kwargs["json"]} if "json" in kwargs else
                                {"content": kwargs.get("data") or kwargs.get("content") or b""}))
            statuses.append(r.status_code)
            if not 400 <= r.status_code < 500:
                bad.append((r.status_code, r.text[:300]))

        run()
    assert len(statuses) >= 100
    assert not bad, bad[:10]
    _assert_healthy(text_server)
