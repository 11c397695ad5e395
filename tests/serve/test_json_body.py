"""`loads_body` equals `json.loads` on every body: values, exception types and messages.

Hand-made cases for each path (a long base64 value, a list of them, one as a key, escapes next to
one, broken bodies of every kind, other encodings), then Hypothesis: random JSON values with long
base64 strings in random places, and byte-level damage to such bodies.
"""

from __future__ import annotations

import base64
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.serve import json_body
from bridge.serve.json_body import FAST_BODY_BYTES, LONG_STRING_BYTES, loads_body

B64 = base64.b64encode(random.Random(0).randbytes(3 * 30_000)).decode()  # 120,000 characters, strict base64


def outcome(fn, body):
    """("ok", value) or ("error", exception type, message)."""
    try:
        return ("ok", fn(body))
    except Exception as exc:  # noqa: BLE001 - the comparison is the point
        return ("error", type(exc), str(exc))


def same(body: bytes) -> None:
    assert outcome(loads_body, body) == outcome(json.loads, body)


def test_a_prompt_embeds_body_takes_the_fast_path_and_equals_json(monkeypatch):
    body = json.dumps({"model": "m", "prompt_embeds": B64, "max_tokens": 2, "stream": True}).encode()
    scanned = []
    original = json_body._restore
    monkeypatch.setattr(json_body, "_restore", lambda *a: scanned.append(1) or original(*a))
    assert loads_body(body) == json.loads(body)
    assert scanned == [1]  # the short body was parsed and the string put back


@pytest.mark.parametrize("value", [
    {"prompt_embeds": [B64, B64[:-4], B64]},                              # a list of payloads
    {"a": "x\\\"y", "prompt_embeds": B64, "b": "\\\\", "c": "\"" + B64},  # escapes around it
    {"prompt_embeds": B64, "prompt_embeds ": B64, "n": [1, 2.5, None, True, {"d": [B64]}]},
    {"prompt_embeds": B64, "prompt_embeds": "x"},                          # noqa: F601 - duplicate key
    [B64, {"k": B64}],
    B64,                                                                   # a top-level string
    {"text": "A" * (LONG_STRING_BYTES + 1) + "!", "prompt_embeds": B64},  # long, but not base64
    {"prompt_embeds": B64 + "="},                                          # bad padding: not fast-pathed
    {"é": "ünïcode", "prompt_embeds": B64, "emoji": "\U0001f600"},
])
def test_values_equal_json(value):
    for ensure_ascii in (True, False):
        same(json.dumps(value, ensure_ascii=ensure_ascii).encode())
    same(json.dumps(value, indent=1).encode())


def test_a_long_string_as_a_key_gives_json_loads_the_body():
    same(json.dumps({B64: 1, "prompt_embeds": B64}).encode())


@pytest.mark.parametrize("body", [
    b'{"prompt_embeds": "' + B64.encode(),                            # unterminated string
    b'{"prompt_embeds": "' + B64.encode() + b'"',                     # unterminated object
    b'{"prompt_embeds": "' + B64.encode() + b'" "x": 1}',             # missing comma
    b'{"prompt_embeds": 1"' + B64.encode() + b'"}',                   # a string where it cannot be
    b'{"a": "\xff\xfe", "prompt_embeds": "' + B64.encode() + b'"}',   # bad UTF-8
    b'{"a": "\x01", "prompt_embeds": "' + B64.encode() + b'"}',       # a raw control character
    b'{"prompt_embeds": "' + B64[:5000].encode() + b'\x01' + B64[5000:].encode() + b'"}',
    b'{"prompt_embeds": "' + B64.encode() + b'"}' + b' x',            # trailing data
    b'\xef\xbb\xbf{"prompt_embeds": "' + B64.encode() + b'"}',        # UTF-8 BOM (json.loads takes it)
    json.dumps({"prompt_embeds": B64}).encode("utf-16"),               # UTF-16 (json.loads detects it)
    b'[' * 100_000 + b'"' + B64.encode() + b'"' + b']' * 100_000,      # deeper than json.loads goes
    b'{"a": "' + b'\\' * 1000 + b'", "prompt_embeds": "' + B64.encode() + b'"}',  # long backslash run
    b'["x",' * 5000 + b'"' + B64.encode() + b'"' + b']' * 5000,        # more strings than the lexer walks
    b'{"a": "' + b'\\"' * 50_000 + b'", "prompt_embeds": "' + B64.encode() + b'"}',  # escaped quotes
    b'{"a": "' + b'\\' * 200_000 + b'", "prompt_embeds": "' + B64.encode() + b'"}',  # a backslash run

], ids=["unterminated-string", "unterminated-object", "missing-comma", "misplaced-string", "bad-utf8",
        "control-char", "control-char-in-payload", "trailing-data", "utf8-bom", "utf16", "too-deep",
        "backslash-run", "many-strings", "escaped-quotes", "long-backslash-run"])
def test_broken_and_unusual_bodies_fail_or_parse_exactly_as_json(body):
    assert len(body) >= FAST_BODY_BYTES
    same(body)


def test_a_client_cannot_forge_a_marker():
    forged = "\x00bridge-json:0000000000000000:0"
    value = {"prompt_embeds": B64, "forged": forged, forged: 1}
    assert loads_body(json.dumps(value).encode()) == value


@pytest.mark.parametrize("body", [
    b'["x",' * 9000 + b'"' + B64.encode() + b'"' + b']' * 9000,
    b'{"a": "' + b'\\"' * 50_000 + b'", "prompt_embeds": "' + B64.encode() + b'"}',
    b'{"a": "' + b'\\' * 200_000 + b'", "prompt_embeds": "' + B64.encode() + b'"}',
], ids=["many-strings", "escaped-quotes", "long-backslash-run"])
def test_the_lexer_gives_up_on_bodies_that_would_cost_a_python_step_per_byte(body):
    assert json_body._long_base64_strings(body) == []


def test_strings_and_small_bodies_go_to_json_loads_unchanged():
    same(json.dumps({"prompt_embeds": B64}))  # a str body
    same(b'{"prompt": "hi"}')
    same(b"")


base64_strings = st.integers(LONG_STRING_BYTES // 4, LONG_STRING_BYTES // 2).map(
    lambda n: B64[: 4 * n])
leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                   st.text(max_size=20), base64_strings)
values = st.recursive(leaves, lambda children: st.one_of(
    st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)),
    max_leaves=12)
# every body long enough for the fast path: the random value beside a 120,000-character payload
bodies = st.tuples(values, st.booleans(), st.booleans()).map(
    lambda t: {"prompt_embeds": B64, "value": t[0]} if t[1] else [t[0], B64])
SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(bodies, st.booleans())
def test_random_values_equal_json(value, ensure_ascii):
    same(json.dumps(value, ensure_ascii=ensure_ascii).encode())


@SETTINGS
@given(bodies, st.data())
def test_damaged_bodies_fail_or_parse_exactly_as_json(value, data):
    body = bytearray(json.dumps(value).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body) - 1))
        op = data.draw(st.sampled_from(["set", "delete", "insert"]))
        byte = data.draw(st.sampled_from(b'"\\{}[],:\x00\x01 aA=/+\xff'))
        if op == "set":
            body[at] = byte
        elif op == "delete":
            del body[at]
        else:
            body.insert(at, byte)
    same(bytes(body))


def test_a_fast_pathed_payload_is_decoded_once(monkeypatch):
    """The fast path decodes each long string to know it is base64; the string it puts back carries those
    bytes, `load_prompt_embeds` takes them instead of decoding again, and the string pickles as a plain one
    (an ingest worker's parsed body crosses a process boundary)."""
    import pickle

    import torch

    from bridge import wire
    from bridge.wire import encode_prompt_embeds, load_prompt_embeds

    rows = torch.randn(512, 48, generator=torch.Generator().manual_seed(3))  # 98 KB
    payload = encode_prompt_embeds(rows)
    assert len(payload) >= LONG_STRING_BYTES
    value = loads_body(json.dumps({"prompt_embeds": payload, "n": 1}).encode())["prompt_embeds"]
    assert value == payload and isinstance(value, str)
    assert value.decoded == base64.b64decode(payload)
    plain = pickle.loads(pickle.dumps(value))
    assert type(plain) is str and plain == payload

    decodes = []
    real = wire.pybase64.b64decode
    monkeypatch.setattr(wire.pybase64, "b64decode", lambda *a, **k: decodes.append(1) or real(*a, **k))
    assert torch.equal(load_prompt_embeds(value, hidden_size=48), rows)
    assert decodes == []  # the fast path's bytes were used
    assert torch.equal(load_prompt_embeds(plain, hidden_size=48), rows)
    assert decodes == [1]  # a plain string is decoded as before
    with pytest.raises(ValueError, match="exceeds the cap"):  # the caps still hold for carried bytes
        load_prompt_embeds(value, hidden_size=48, max_bytes=1024)
