"""`bridge serve RUN_DIR` over tiny trained audio and graph runs (the tones and graphs demos, two
steps): chat with an `input_audio` part (a real WAV, base64) or a `graph` part (the JSON graph
format) equals `Bridge.from_checkpoint(...).generate` on the same item, a repeated item is served
from the encoder cache, and a streamed answer equals the non-streamed one."""

from __future__ import annotations

import base64
import json
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
from bridge.serve.chat import decode_wav
from encoders.audio_inputs import load_wav, save_wav

ROOT = Path(__file__).resolve().parents[2]
DATA = ["data.num_train=8", "data.num_eval=2"]
TRAIN = ["train.max_steps=2", "train.progress=false", "train.batch_size=4", "eval.num_items=1"]
MODEL = "run"
SERVE_FLAGS = ["--max-model-len", "64", "--num-kv-blocks", "32", "--served-model-name", MODEL]


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
