"""`bridge serve RUN_DIR` over tiny trained audio and graph runs (the tones and graphs demos, two
steps): chat with an `input_audio` part (a real WAV, base64) or a `graph` part (the JSON graph
format) equals `Bridge.from_checkpoint(...).generate` on the same item, a repeated item is served
from the encoder cache, and a streamed answer equals the non-streamed one. Issue 40's media findings:
forged WAV rates and media over the request's budget are 400s naming the part and the flag, and an
item the encoder fails on finishes with its reason (a 500 with it, or in the stream, an error event)."""

from __future__ import annotations

import base64
import io
import json
import wave
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from serve_helpers import TEMPLATE, ServerProcess

from bridge.cli import main
from bridge.data.sources import build_datasets
from bridge.recipe import load_recipe
from bridge.serve.media import decode_wav
from encoders.audio_inputs import load_wav, save_wav

ROOT = Path(__file__).resolve().parents[2]
DATA = ["data.num_train=8", "data.num_eval=2"]
TRAIN = ["train.max_steps=2", "train.progress=false", "train.batch_size=4", "eval.num_items=1"]
MODEL = "run"
# small media limits, so that a request just over each is cheap to send (the demo clips are 8000 samples)
SERVE_FLAGS = ["--max-model-len", "64", "--num-kv-blocks", "32", "--served-model-name", MODEL,
               "--max-audio-samples", "48000", "--max-audio-file-samples", "96000",
               "--max-graph-nodes", "1000", "--max-graph-edges", "5000"]


def _train(demo: str, out: Path) -> Path:
    assert main(["demo", demo, "--output-dir", str(out), *TRAIN, *DATA]) == 0
    return out


def _held_out(demo: str, modality: str) -> list:
    recipe = load_recipe(ROOT / "recipes" / "demo" / f"{demo}.yaml", DATA)
    _, held_out = build_datasets(recipe.data, recipe.seed)
    return [held_out[i].media[modality][0] for i in range(2)]


def _serve(run: Path, tmp: Path) -> ServerProcess:
    """A server on the run, started but not yet ready (several boot at once; `wait_ready` later)."""
    template = tmp / "t.jinja"
    template.write_text(TEMPLATE)
    return ServerProcess(run, tmp / "server.log", "--chat-template", str(template), *SERVE_FLAGS, wait=False)


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _bridge_texts(run: Path, modality: str, items: list) -> list[str]:
    from bridge.api import Bridge

    bridge = Bridge.from_checkpoint(run, device="cpu")
    outs = bridge.generate([{"text": f"<{modality}>", modality: item} for item in items], max_tokens=8)
    return [o.outputs[0].text for o in outs]


def _chat(client: openai.OpenAI, part: dict) -> str:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [part]}],
                                       temperature=0.0, max_tokens=8)
    return r.choices[0].message.content


def _streamed(server: ServerProcess, part: dict) -> tuple[str, list[str]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}], "temperature": 0.0,
            "max_tokens": 8, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        chunks = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    return text, chunks


def _check_cache(server: ServerProcess, client: openai.OpenAI, parts: list[dict], want: list[str]) -> None:
    """Each part once (answers equal `want`), then the first part three times more: two items
    encoded, three cache hits."""
    before = server.metrics()
    assert [_chat(client, p) for p in parts] == want
    for _ in range(3):
        assert _chat(client, parts[0]) == want[0]
    m = server.metrics()
    assert m["bridge:encoder_encoded_items"] - before["bridge:encoder_encoded_items"] == 2
    assert m["bridge:encoder_cache_hits_total"] - before.get("bridge:encoder_cache_hits_total", 0) == 3
    assert m["bridge:encoder_cache_queries_total"] - before.get("bridge:encoder_cache_queries_total", 0) == 5
    server.wait_idle()


@pytest.fixture(scope="module")
def wav_files(tmp_path_factory) -> list[Path]:
    """Two real WAV files of held-out clips: the first as is (16 kHz mono), the second at 8 kHz
    in stereo, so that the server must take the file's rate and channels (both sides resample
    it to the tower's 16 kHz and average the channels)."""
    import torchaudio.functional as AF

    tmp = tmp_path_factory.mktemp("serve_wavs")
    first, second = _held_out("tones", "audio")
    stereo = AF.resample(second, 16000, 8000).expand(2, -1) * torch.tensor([[1.0], [0.5]])
    return [save_wav(tmp / "a.wav", first, 16000), save_wav(tmp / "b.wav", stereo, 8000)]


def _audio_part(path: Path) -> dict:
    data = base64.b64encode(path.read_bytes()).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def _graph_part(graph: dict) -> dict:
    return {"type": "graph", "graph": json.loads(json.dumps(graph))}  # exactly what travels as JSON


@dataclass
class Served:
    """One demo run behind a server: its two held-out items as chat parts, and the Bridge API's
    greedy answers for the same items."""

    server: ServerProcess
    parts: list[dict]
    want: list[str]


@pytest.fixture(scope="module")
def served(tmp_path_factory, wav_files):
    """The tones and graphs runs, trained and served. Each server boots while the next run trains
    and the Bridge API's answers are computed here (most of a boot is imports)."""
    tmp = tmp_path_factory.mktemp("serve_media")
    servers: dict[str, ServerProcess] = {}
    try:
        tones = _train("tones", tmp / "tones")
        servers["audio"] = _serve(tones, tmp_path_factory.mktemp("serve_tones"))
        graphs = _train("graphs", tmp / "graphs")
        servers["graph"] = _serve(graphs, tmp_path_factory.mktemp("serve_graphs"))
        graph_items = _held_out("graphs", "graph")
        out = {
            "audio": Served(servers["audio"], [_audio_part(p) for p in wav_files],
                            _bridge_texts(tones, "audio", wav_files)),
            "graph": Served(servers["graph"], [_graph_part(g) for g in graph_items],
                            _bridge_texts(graphs, "graph", graph_items)),
        }
        for server in servers.values():
            server.wait_ready()
        yield out
    finally:
        codes = {m: server.stop() for m, server in servers.items()}
    assert codes == {"audio": 0, "graph": 0}, [s.log() for s in servers.values()]


def test_the_server_decodes_a_wav_as_the_encoders_do(wav_files):
    for path in wav_files:
        got, rate = decode_wav(path.read_bytes(), "x")
        want, want_rate = load_wav(path)
        assert rate == want_rate and torch.equal(got, want)


@pytest.mark.parametrize("modality", ["audio", "graph"])
def test_chat_with_media_equals_the_bridge_api_and_encodes_once(served, modality):
    s = served[modality]
    _check_cache(s.server, _client(s.server), s.parts, s.want)


@pytest.mark.parametrize("modality", ["audio", "graph"])
def test_a_streamed_answer_equals_the_non_streamed_one(served, modality):
    s = served[modality]
    text, chunks = _streamed(s.server, s.parts[1])
    assert chunks[-1] == "[DONE]"
    assert text == _chat(_client(s.server), s.parts[1]) == s.want[1]
    s.server.wait_idle()


def _post(server: ServerProcess, part: dict, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 4,
            "stream": stream}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def _wav_part(rate: int, frames: int, channels: int = 1) -> dict:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:  # the wave module writes whatever rate it is given
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(b"\x00\x00" * frames * channels)
    data = base64.b64encode(buf.getvalue()).decode()
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def _refused(r: httpx.Response, *needles: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages[0].content[0]", error
    for needle in needles:
        assert needle in error["message"], error["message"]


def test_forged_wav_rates_and_audio_over_the_budget_are_400s(served):
    s = served["audio"]
    _refused(_post(s.server, _wav_part(100_000_007, 8000)), "sample rate 100000007 Hz is outside")
    _refused(_post(s.server, _wav_part(16001, 8000)),
             "16001 Hz cannot be resampled to the encoder's 16000 Hz")
    _refused(_post(s.server, _wav_part(16000, 64000)), "audio samples at the encoder's rate add up to 64000",
             "--max-audio-samples")
    _refused(_post(s.server, _wav_part(48000, 72000, channels=2)), "samples as stored",
             "--max-audio-file-samples")
    assert _chat(_client(s.server), s.parts[1]) == s.want[1]  # and the server serves on
    s.server.wait_idle()


def test_graphs_over_the_node_and_edge_budget_are_400s(served):
    s = served["graph"]
    for nodes in (1_000_000, 10**12):
        _refused(_post(s.server, _graph_part({"num_nodes": nodes, "edges": []})),
                 f"graph nodes add up to {nodes}", "--max-graph-nodes")
    edges = [[0, 1]] * 5001
    _refused(_post(s.server, _graph_part({"num_nodes": 2, "edges": edges})), "--max-graph-edges")
    s.server.wait_idle()


def test_a_failed_item_finishes_with_its_reason(served):
    """The graphs tower takes no node features: the engine's encoder fails on this item. The answer is a
    500 with the encoder's message; a stream ends its choice with finish_reason "error" and the message
    as stop_reason, then an error event and [DONE]."""
    s = served["graph"]
    part = _graph_part({"num_nodes": 3, "edges": [[0, 1]], "node_features": [[1.0], [2.0], [3.0]]})
    r = _post(s.server, part)
    assert r.status_code == 500 and "node_features" in r.json()["error"]["message"], r.text
    with httpx.stream("POST", s.server.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": [part]}], "max_tokens": 4,
            "stream": True}) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    finish = json.loads(events[-3])["choices"][0]
    assert finish["finish_reason"] == "error" and "node_features" in finish["stop_reason"]
    assert "node_features" in json.loads(events[-2])["error"]["message"]
    s.server.wait_idle()
