"""RemoteBackend against a scripted local HTTP stub (tests/remote_stub.py): the body it sends is
vLLM's completions format field by field, transient faults are retried, a 4xx is not, a dead
server keeps the finished part of a batch, and a server on another LLM is refused before any
embedding is sent. (Exact tokens against a real `bridge serve`: test_remote_serve.py.)"""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import pytest
import torch
from remote_stub import StubServer, free_port

from bridge.backends import (
    GenerationError,
    ModelExpectation,
    RemoteBackend,
    RemoteError,
    RemoteHTTPError,
    RemoteModelMismatch,
    resolve_backend,
)
from bridge.backends.retry import Backoff
from runner.sampling_params import SamplingParams

HIDDEN = 32
FAST = Backoff(base=0.02, cap=0.2)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)

# vLLM's CompletionRequest (vllm/entrypoints/openai/protocol.py, vllm-project/vllm at 0052bed3; plus
# return_token_ids, added in 0.10.2): every field the client may send and the JSON types it takes.
VLLM_COMPLETION_FIELDS = {
    "model": (str,), "prompt": (str, list), "prompt_embeds": (str, list), "best_of": (int,),
    "echo": (bool,), "frequency_penalty": (float, int), "logit_bias": (dict,), "logprobs": (int,),
    "max_tokens": (int,), "n": (int,), "presence_penalty": (float, int), "seed": (int,),
    "stop": (str, list), "stream": (bool,), "stream_options": (dict,), "suffix": (str,),
    "temperature": (float, int), "top_p": (float, int), "user": (str,), "use_beam_search": (bool,),
    "top_k": (int,), "min_p": (float, int), "repetition_penalty": (float, int),
    "length_penalty": (float, int),
    "stop_token_ids": (list,), "include_stop_str_in_output": (bool,), "ignore_eos": (bool,),
    "min_tokens": (int,), "skip_special_tokens": (bool,), "spaces_between_special_tokens": (bool,),
    "truncate_prompt_tokens": (int,), "allowed_token_ids": (list,), "prompt_logprobs": (int,),
    "add_special_tokens": (bool,), "response_format": (dict,), "priority": (int,), "request_id": (str,),
    "return_tokens_as_token_ids": (bool,), "return_token_ids": (bool,), "cache_salt": (str,),
}


def _requests(n: int, rows: int = 3, dtype=torch.float32) -> list[dict]:
    """Prompt i's first value is i, so the stub's answer (token ids [rows, first]) names it."""
    out = []
    for i in range(n):
        t = torch.randn(rows, HIDDEN).to(dtype)
        t[0, 0] = i
        out.append({"prompt_embeds": t, "prompt_token_ids": [0] * rows})
    return out


def _backend(url: str, **kw) -> RemoteBackend:
    kw.setdefault("backoff", FAST)
    return RemoteBackend(url, **kw)


def test_request_body_is_vllm_completions_format_field_by_field():
    params = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, seed=11, stop=["x y"],
                            stop_token_ids=[3, 4], ignore_eos=True, min_tokens=1, logprobs=1,
                            repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=-0.1)
    t = torch.randn(5, HIDDEN).to(torch.bfloat16)
    with StubServer(hidden_size=HIDDEN) as stub, _backend(stub.url, api_key="sekret") as backend:
        backend.verify(ModelExpectation(("stub",), HIDDEN))
        (out,) = backend.generate([{"prompt_embeds": t, "prompt_token_ids": [0] * 5}], params)
    models, probe, sent = stub.requests
    assert models["path"] == "/v1/models" and probe["body"]["max_tokens"] == 1
    body = sent["body"]
    assert sent["headers"]["Authorization"] == "Bearer sekret"
    assert sent["headers"]["Content-Type"] == "application/json"
    for key, value in body.items():
        assert key in VLLM_COMPLETION_FIELDS, f"{key} is not a field of vLLM's CompletionRequest"
        assert isinstance(value, VLLM_COMPLETION_FIELDS[key]), (key, value)
        assert not (isinstance(value, bool) and bool not in VLLM_COMPLETION_FIELDS[key]), key
    assert body == {
        "prompt_embeds": body["prompt_embeds"], "model": "stub", "max_tokens": 7, "temperature": 0.7,
        "top_p": 0.9, "top_k": 5, "n": 1, "seed": 11, "stop": ["x y"], "stop_token_ids": [3, 4],
        "ignore_eos": True, "min_tokens": 1, "logprobs": 1, "return_tokens_as_token_ids": True,
        "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": -0.1,
        "skip_special_tokens": True, "include_stop_str_in_output": False, "return_token_ids": True,
    }
    # prompt_embeds is base64 of torch.save of the (n, hidden) tensor, dtype kept, as vLLM loads it
    loaded = torch.load(io.BytesIO(base64.b64decode(body["prompt_embeds"])), weights_only=True)
    assert loaded.dtype == torch.bfloat16 and torch.equal(loaded, t)
    comp = out.outputs[0]
    assert comp.token_ids == [5, round(float(t[0, 0]))] and comp.text.startswith("rows=5")
    assert comp.logprobs == [{5: -0.5}, {comp.token_ids[1]: -0.5}] and comp.cumulative_logprob == -1.0
    with pytest.raises(ValueError, match="prompt_logprobs"):
        backend.generate(_requests(1), SamplingParams(prompt_logprobs=1))


def test_batch_larger_than_max_concurrency_is_bounded_ordered_and_encoded_off_the_loop(monkeypatch):
    import bridge.backends.remote as remote

    threads = []
    real_encode = remote.encode_prompt_embeds
    monkeypatch.setattr(remote, "encode_prompt_embeds",
                        lambda t: threads.append(threading.current_thread().name) or real_encode(t))
    with StubServer(hidden_size=HIDDEN, script=lambda n, body: ("sleep", 0.1)) as stub, \
            _backend(stub.url, max_concurrency=3) as backend:
        outs = backend.generate(_requests(10), GREEDY)
    assert [o.outputs[0].token_ids[1] for o in outs] == list(range(10))
    assert stub.max_in_flight == 3  # concurrent, never above the cap
    assert threads and all(name.startswith("bridge-encode") for name in threads)


def test_refused_connection_then_success():
    port = free_port()
    holder = {}

    def start_later():
        time.sleep(0.3)
        holder["stub"] = StubServer(hidden_size=HIDDEN, port=port).__enter__()

    threading.Thread(target=start_later, daemon=True).start()
    with _backend(f"http://127.0.0.1:{port}", retries=6, backoff=Backoff(base=0.1, cap=0.4)) as backend:
        outs = backend.generate(_requests(2), GREEDY)
    holder["stub"].stop()
    assert [o.outputs[0].token_ids for o in outs] == [[3, 0], [3, 1]]


def test_503_is_retried_then_succeeds():
    script = lambda n, body: ("status", 503, "overloaded", {"Retry-After": "0"}) if n == 0 else ("ok",)
    with StubServer(hidden_size=HIDDEN, script=script) as stub, _backend(stub.url) as backend:
        (out,) = backend.generate(_requests(1), GREEDY)
    assert out.outputs[0].token_ids == [3, 0] and len(stub.completions()) == 2


def test_timeout_is_retried_then_raises_naming_the_timeout():
    with StubServer(hidden_size=HIDDEN, script=lambda n, body: ("sleep", 1.5)) as stub, \
            _backend(stub.url, timeout=0.3, retries=1) as backend:
        with pytest.raises(GenerationError) as info:
            backend.generate(_requests(1), GREEDY)
    err = info.value.failed[0]
    assert isinstance(err, RemoteError) and err.attempts == 2 and "timed out" in str(err)
    assert len(stub.completions()) == 2 and "prompt 0" in str(info.value)


def test_400_is_not_retried_and_carries_the_server_message():
    script = lambda n, body: ("status", 400, "max_tokens is too large for this model") if n == 1 else ("ok",)
    with StubServer(hidden_size=HIDDEN, script=script) as stub, \
            _backend(stub.url, max_concurrency=1, retries=5) as backend:
        with pytest.raises(GenerationError) as info:
            backend.generate(_requests(3), GREEDY)
    err = info.value
    assert list(err.failed) == [1] and len(stub.completions()) == 3  # one attempt, not six
    assert isinstance(err.failed[1], RemoteHTTPError) and err.failed[1].status == 400
    assert "max_tokens is too large for this model" in str(err.failed[1]) and "prompt 1" in str(err)
    assert [o.outputs[0].token_ids[1] for o in (err.outputs[0], err.outputs[2])] == [0, 2]


def test_server_dying_mid_batch_keeps_the_completed_outputs():
    script = lambda n, body: ("die",) if n == 3 else ("ok",)
    with StubServer(hidden_size=HIDDEN, script=script) as stub, \
            _backend(stub.url, max_concurrency=1, retries=2) as backend:
        with pytest.raises(GenerationError) as info:
            backend.generate(_requests(6), GREEDY)
    err = info.value
    assert sorted(err.failed) == [3, 4, 5]
    assert [o.outputs[0].token_ids[1] for o in err.outputs[:3]] == [0, 1, 2] and err.outputs[3:] == [None] * 3
    assert all(isinstance(e, RemoteError) and e.attempts == 3 for e in err.failed.values())
    assert "prompt 3" in str(err) and "3 completed" in str(err)


def test_streaming_one_request():
    with StubServer(hidden_size=HIDDEN) as stub, _backend(stub.url) as backend:
        steps = list(backend.stream(_requests(2)[1], GREEDY))
    assert len(steps) == 2 and not steps[0].finished and steps[0].outputs[0].token_ids == [3]
    final = steps[-1].outputs[0]
    assert steps[-1].finished and final.text == "rows=3 first=1" and final.token_ids == [3, 1]
    assert stub.completions()[0]["stream"] is True


# ----------------------------------------------------------------------------- model checks
def test_model_name_and_hidden_size_mismatches_are_refused_before_any_embedding(tmp_path):
    served = [{"id": "big-llm", "object": "model", "root": "/models/big-llm"}]
    with StubServer(hidden_size=HIDDEN, models=served) as stub, _backend(stub.url) as backend:
        with pytest.raises(RemoteModelMismatch, match=r"serves 'big-llm'.*not this Bridge's base LLM"):
            backend.verify(ModelExpectation(("/ckpt/tiny-llm",), HIDDEN))
        assert stub.completions() == []  # nothing was posted at all
        # same name (last path component), other width: the one-row zero probe is refused
        refused = r"refused a \(1, 48\) prompt-embeds probe.*hidden size"
        with pytest.raises(RemoteModelMismatch, match=refused):
            backend.verify(ModelExpectation(("/local/copy/big-llm",), 48))
        (probe,) = stub.completions()
        t = torch.load(io.BytesIO(base64.b64decode(probe["prompt_embeds"])), weights_only=True)
        assert t.shape == (1, 48) and not t.any()  # only the probe's zeros went out
        with pytest.raises(RemoteModelMismatch, match="does not serve the model 'nope'"):
            _backend(stub.url, model="nope").verify(ModelExpectation(("big-llm",), HIDDEN))
        unchecked = _backend(stub.url, check_model=False)
        unchecked.verify(ModelExpectation(("other",), HIDDEN))
        assert unchecked.model == "big-llm"
        unchecked.close()


def test_bridge_generate_with_a_mismatched_server_sends_no_embedding(tmp_path):
    from bridge.api import Bridge
    from bridge.tiny_models import build_tiny_model
    from encoders.api import build_encoder, tiny_encoder_config

    llm = build_tiny_model(tmp_path / "tiny-llm", "qwen3", hidden_size=48, num_layers=1, num_heads=2,
                           num_kv_heads=1, head_dim=24, intermediate_size=64)
    bridge = Bridge(llm, {"graph": build_encoder(tiny_encoder_config("graph", 48))}, device="cpu")
    graph = {"num_nodes": 3, "edges": [[0, 1], [1, 2]]}
    served = [{"id": "tiny-llm", "object": "model", "root": str(llm)}]
    with StubServer(hidden_size=HIDDEN, models=served) as stub:
        with pytest.raises(RemoteModelMismatch, match="hidden size 48 does not match the model's 32"):
            bridge.generate([{"text": "<graph>", "graph": graph}], backend=stub.url)
        assert [b["max_tokens"] for b in stub.completions()] == [1]  # the probe only
    other = [{"id": "llama-70b", "object": "model", "root": "meta/llama-70b"}]
    with StubServer(hidden_size=48, models=other) as stub:
        with pytest.raises(RemoteModelMismatch, match="llama-70b"):
            Bridge(llm, {}, device="cpu", backend=stub.url).generate(["hello"])
        assert stub.completions() == []
    with StubServer(hidden_size=48, models=served) as stub:
        remote = Bridge(llm, {}, device="cpu", backend=stub.url)
        (out,) = remote.generate(["hello"], max_tokens=2)
        assert out.outputs[0].text.startswith("rows=")
        remote.backend.close()


def test_backoff_and_backend_specs():
    import random

    b = Backoff(base=0.5, cap=4.0)
    rng = random.Random(0)
    for attempt, full in enumerate([0.5, 1.0, 2.0, 4.0, 4.0]):
        assert full / 2 <= b.delay(attempt, rng=rng) <= full
    assert b.delay(0, retry_after=2.0) == 2.0 and b.delay(0, retry_after=100) == 4.0
    assert resolve_backend(None) is None and resolve_backend("local") is None
    assert isinstance(resolve_backend("http://h:8000/v1/"), RemoteBackend)
    assert resolve_backend("http://h:8000/v1/").base_url == "http://h:8000"
    with pytest.raises(ValueError, match="backend must be 'local' or an http"):
        resolve_backend("h:8000")
    with pytest.raises(ValueError, match="max_concurrency"):
        RemoteBackend("http://h", max_concurrency=0)


def test_encoded_body_is_the_same_json_as_json_dumps():
    from bridge.backends.completions import encode_body

    for body in ({"prompt_embeds": "QUJD", "max_tokens": 3, "stop": ['a"b']}, {"prompt_embeds": "QUJD"},
                 {"prompt_embeds": 'not "base64"', "n": 1}, {"max_tokens": 1}):
        assert json.loads(encode_body(body)) == body
