"""The remote backend against a real `bridge serve` process on 127.0.0.1 (the test double for
vLLM's server): greedy generation through the server gives exactly the tokens of the in-process
engine for image, audio, graph and plain-text prompts, with more prompts than `max_concurrency`;
streaming gives the same; and `bridge eval RUN --backend URL` (the `eval.backend` recipe key)
scores a trained run exactly as the in-process evaluation did."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import tiny_graph_recipe_parts
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent / "serve"))  # the server tests' process helper
from serve_helpers import ServerProcess  # noqa: E402

from bridge.api import Bridge  # noqa: E402
from bridge.backends import RemoteBackend  # noqa: E402
from bridge.cli import main  # noqa: E402
from bridge.tiny_models import build_tiny_model  # noqa: E402
from encoders.api import build_encoder, tiny_encoder_config  # noqa: E402

HIDDEN = 32
WORDS = ["red", "blue", "circle", "square", "tone", "high", "low", "graph", "nodes", "three", "five"]
SERVER_FLAGS = ("--enable-prompt-embeds", "--dtype", "float32", "--max-model-len", "256",
                "--num-kv-blocks", "96", "--max-num-seqs", "8", "--max-num-batched-tokens", "256")


@pytest.fixture(scope="module")
def llm_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("remote_llm") / "tiny-qwen3", "qwen3", seed=3,
                            hidden_size=HIDDEN, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                            intermediate_size=64, vocab_words=WORDS)


@pytest.fixture(scope="module")
def server(llm_dir, tmp_path_factory):
    proc = ServerProcess(llm_dir, tmp_path_factory.mktemp("remote_logs") / "server.log", *SERVER_FLAGS)
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def bridge(llm_dir):
    torch.manual_seed(0)
    encoders = {m: build_encoder(tiny_encoder_config(m, HIDDEN)) for m in ("image", "audio", "graph")}
    b = Bridge(llm_dir, encoders, device="cpu")
    yield b
    b.engine.shutdown()


def _prompts() -> list:
    g = torch.Generator().manual_seed(1)
    return [
        {"text": "<image> red or blue", "image": Image.new("RGB", (40, 36), (200, 10, 10))},
        {"text": "a <image>", "image": Image.new("RGB", (24, 50), (0, 90, 200))},
        {"text": "<audio> high or low tone", "audio": torch.randn(16000, generator=g) * 0.1},
        {"text": "tone <audio>", "audio": torch.randn(6000, generator=g) * 0.1},
        {"text": "<graph> nodes", "graph": {"num_nodes": 3, "edges": [[0, 1], [1, 2]]}},
        {"text": "graph <graph> five", "graph": {"num_nodes": 5, "edges": [[0, 1], [2, 3], [3, 4]]}},
        "red circle blue square",
    ]


def test_remote_generation_equals_local_tokens_for_every_modality(bridge, server):
    prompts = _prompts()
    local = bridge.generate(prompts, max_tokens=8)
    remote = RemoteBackend(server.url, max_concurrency=2)  # no tokenizer: the ids must come from the server
    try:
        outs = bridge.generate(prompts, max_tokens=8, backend=remote)  # 7 prompts, 2 in flight
        assert remote.model == "tiny-qwen3"  # the served root names the Bridge's LLM dir
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in local]
        assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in local]
        assert [o.outputs[0].finish_reason for o in outs] == [o.outputs[0].finish_reason for o in local]
        assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in local]
        assert all(len(o.outputs[0].token_ids) >= 1 for o in outs)
        # streaming one request gives the same tokens, chunk by chunk
        (request,) = bridge.build_requests(prompts[4:5])
        steps = list(remote.stream(request, bridge_params(8)))
        assert steps[-1].finished and steps[-1].outputs[0].token_ids == local[4].outputs[0].token_ids
        assert steps[-1].outputs[0].text == local[4].outputs[0].text
    finally:
        remote.close()


def bridge_params(max_tokens: int):
    from runner.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_bridge_eval_with_backend_scores_like_the_in_process_evaluation(tmp_path, capsys):
    recipe = {"name": "remote-eval", "seed": 0, "stage": "align", **tiny_graph_recipe_parts(),
              "train": {"max_steps": 2, "batch_size": 4, "progress": False, "device": "cpu"},
              "eval": {"num_items": 6, "max_tokens": 4}}
    path, run = tmp_path / "r.yaml", tmp_path / "run"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path), "--output-dir", str(run)]) == 0
    local = json.loads((run / "eval.json").read_text())
    proc = ServerProcess(run, tmp_path / "run_server.log", *SERVER_FLAGS)
    try:
        capsys.readouterr()
        assert main(["eval", str(run), "--backend", proc.url, "--output", str(tmp_path / "remote.json")]) == 0
        printed = json.loads(capsys.readouterr().out)
    finally:
        assert proc.stop() == 0, proc.log()
    remote = json.loads((tmp_path / "remote.json").read_text())
    assert printed["backend"] == proc.url and printed["n"] == local["n"] == 6
    assert remote["exact_match"] == local["exact_match"]
    assert [s["output"] for s in remote["samples"]] == [s["output"] for s in local["samples"]]
    # a server that is not there: a clear error, exit 1
    assert main(["eval", str(run), "--backend", proc.url]) == 1
    assert "could not connect" in capsys.readouterr().err
