"""Fixtures of the server tests: the tiny model, a chat template, one shared text server, and the
same model offline (what the server's outputs must equal)."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_helpers import API_KEY, MAX_MODEL_LEN, MAX_PENDING, TEMPLATE, ServerProcess, still_running


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory):
    from bridge.tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("serve_model") / "qwen3", "qwen3", seed=5)


@pytest.fixture(scope="session")
def chat_template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("serve_template") / "template.jinja"
    path.write_text(TEMPLATE)
    return path



@pytest.fixture(scope="session")
def text_server(tiny_text_model, chat_template_file, tmp_path_factory):
    """One server over the tiny text model for the API and fuzz modules (prompt embeds on, an API
    key, small limits so the limit paths are cheap to reach). It runs as a GPU server does by
    default: the engine in its own process, and every JSON body through the ingest pool (one worker
    process, no inline size). The other servers keep both in-process, the CPU default. At teardown
    (SIGTERM) the server exits 0 and leaves no child process behind."""
    log = tmp_path_factory.mktemp("serve_logs") / "text_server.log"
    server = ServerProcess(
        tiny_text_model, log, "--enable-prompt-embeds", "--dtype", "float32", "--max-model-len",
        str(MAX_MODEL_LEN), "--num-kv-blocks", "160", "--max-num-seqs", "32",
        "--max-num-batched-tokens", "256",
        "--chat-template", str(chat_template_file), "--max-pending-requests", str(MAX_PENDING),
        "--max-request-bytes", str(4 * 2**20), "--max-prompt-embeds-bytes", str(256 * 2**10), "--max-n", "8",
        "--max-prompts-per-request", "16", "--served-model-name", "tiny", "--ingest-workers", "1",
        "--ingest-inline-bytes", "0", "--engine-process", api_key=API_KEY)
    children = server.children()
    assert len(children) >= 2, children  # the engine process and the ingest worker (at least)
    yield server
    assert server.stop() == 0, server.log()
    assert not still_running(children), "a child process outlived the server"


@pytest.fixture(scope="session")
def offline_llm(tiny_text_model):
    """The same model offline (runner.LLM in this process): what the server's greedy outputs must equal."""
    from runner.llm import LLM

    llm = LLM(tiny_text_model, enable_prompt_embeds=True, dtype="float32", device="cpu", num_kv_blocks=160,
              max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=256)
    yield llm
    llm.shutdown()
