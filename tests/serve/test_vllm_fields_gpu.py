"""vLLM's fields on a CUDA server (its defaults: the engine in its own process, async scheduling, decode
windows, CUDA graphs): prompt logprobs arrive with a request's first delta and equal the engine's
offline ones; echo, include_stop_str_in_output and return_token_ids behave as on the CPU."""

from __future__ import annotations

import httpx
import pytest
import torch
from serve_helpers import ServerProcess

from runner.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
TEXT = "the red circle"


@pytest.fixture(scope="module")
def gpu_server(tiny_text_model, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    log = tmp_path_factory.mktemp("serve_gpu") / "server.log"
    server = ServerProcess(tiny_text_model, log, "--device", "cuda", "--dtype", "float32",
                           "--max-model-len", "256", "--api-server-count", "1", wait=False)
    server.wait_ready(timeout=600)
    yield server
    assert server.stop() == 0, server.log()


def _post(server, route: str, **body) -> dict:
    r = httpx.post(server.url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_prompt_logprobs_echo_stop_strings_and_token_ids_on_cuda(gpu_server, tiny_text_model):
    from runner.llm import LLM, load_tokenizer

    tokenizer = load_tokenizer(tiny_text_model)
    ids = tokenizer.encode(TEXT)
    got = _post(gpu_server, "/v1/completions", prompt=TEXT, max_tokens=4, temperature=0.0, prompt_logprobs=2,
                return_token_ids=True)["choices"][0]
    llm = LLM(tiny_text_model, dtype="float32", device="cuda", max_model_len=256, num_kv_blocks=64)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
        want = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    assert got["prompt_token_ids"] == ids and len(got["token_ids"]) == 4
    rows = got["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids)
    for row, entry in zip(rows[1:], want.prompt_logprobs[1:]):
        assert {int(t): v["logprob"] for t, v in row.items()} == pytest.approx(entry, abs=2e-2)

    echoed = _post(gpu_server, "/v1/completions", prompt=TEXT, echo=True, logprobs=1, max_tokens=4,
                   temperature=0.0)["choices"][0]
    assert echoed["text"].startswith(TEXT) and len(echoed["logprobs"]["tokens"]) == len(ids) + 4
    assert echoed["logprobs"]["token_logprobs"][0] is None

    full = _post(gpu_server, "/v1/completions", prompt=TEXT, max_tokens=12, temperature=0.0,
                 ignore_eos=True)["choices"][0]["text"]
    stop = full[3:6]
    if len(stop) == 3 and full.find(stop) == 3:
        kept = _post(gpu_server, "/v1/completions", prompt=TEXT, max_tokens=12, temperature=0.0,
                     ignore_eos=True, stop=[stop], include_stop_str_in_output=True)["choices"][0]["text"]
        assert kept == full[:6]
