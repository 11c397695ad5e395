"""`batch_invariant` on the GPU, in bf16: the pieces at Qwen3-0.6B's shapes, then the engine with its GPU
defaults (CUDA graphs, decode windows, async scheduling, fused norms and merged projections): 64 prompts
alone, as one batch of 64 (with logprobs, and without, in decode windows), and under a 96-token chunk
budget with prefix caching give the same tokens and logprob floats; and a `bridge serve --batch-invariant`
process answering 64 concurrent clients gives the offline engine's. Without the flag the same engine's
batch differs from its prompts alone (printed: the share of prompts whose tokens still match). Skipped
without CUDA."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

from bridge.tiny_models import build_tiny_model
from runner.layers.attention_metadata import AttentionMetadata
from runner.layers.invariant_matmul import invariant_mm_triton
from runner.layers.paged_attention import paged_attention
from runner.llm import LLM
from runner.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
HIDDEN = 512
PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize(("k", "n"), [(1024, 4096), (2048, 1024), (3072, 1024), (1024, 151936)])
def test_matmul_rows_at_qwen3_shapes(k, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=g).to(torch.bfloat16) * 0.05
    x = torch.randn(2048, k, device="cuda", generator=g).to(torch.bfloat16)
    full = invariant_mm_triton(x, w.t(), split=False)
    assert torch.equal(invariant_mm_triton(x, w.t(), split=True), full)
    torch.testing.assert_close(full.float(), (x.float() @ w.float().t()), atol=0.05, rtol=0.02)
    for m in (1, 3, 17, 64, 200, 1000):
        for offset in (0, 7):
            assert torch.equal(invariant_mm_triton(x[offset : offset + m], w.t()), full[offset : offset + m])


def test_attention_rows_in_bf16_at_head_dim_128():
    g = torch.Generator(device="cuda").manual_seed(0)
    heads, kv_heads, dim, block, length = 16, 8, 128, 16, 300
    cache = [torch.randn(64, block, kv_heads, dim, device="cuda", generator=g).to(torch.bfloat16)
             for _ in "kv"]
    table = torch.randperm(64, device="cuda", generator=g)[:32].int()
    queries = torch.randn(length, heads, dim, device="cuda", generator=g).to(torch.bfloat16)

    def attend(start: int, end: int, others: int = 0) -> torch.Tensor:
        # the request's rows [start, end) after `others` one-row requests over the same keys
        qsl = list(range(others + 1)) + [others + end - start]
        seq = [end] * others + [end]
        meta = AttentionMetadata(
            torch.full((qsl[-1],), -1, dtype=torch.int64, device="cuda"),
            torch.tensor(qsl, dtype=torch.int32, device="cuda"),
            torch.tensor(seq, dtype=torch.int32, device="cuda"),
            table.expand(others + 1, -1).contiguous(), max_query_len=end - start, max_seq_len=end,
            num_reqs=others + 1, is_decode_only=end - start == 1, query_start_loc_cpu=qsl, seq_lens_cpu=seq)
        q = torch.cat([queries[end - 1 : end].expand(others, heads, dim), queries[start:end]])
        return paged_attention(q, *cache, meta, dim**-0.5, batch_invariant=True)[others:]

    whole = attend(0, length)
    chunks = torch.cat([attend(0, 100), attend(100, 227), attend(227, length)])
    decodes = torch.cat([attend(p, p + 1, others=p % 70) for p in range(0, length, 13)])
    assert torch.equal(chunks, whole)
    assert torch.equal(decodes, whole[::13])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Qwen3-0.6B's head layout (head_dim 128, 2 query heads per KV head), fewer and narrower layers."""
    return build_tiny_model(tmp_path_factory.mktemp("bi_gpu") / "qwen3", "qwen3", seed=5, hidden_size=HIDDEN,
                            num_layers=4, num_heads=8, num_kv_heads=4, head_dim=128, intermediate_size=1536,
                            dtype=torch.bfloat16, max_position_embeddings=4096)


def _prompts(n: int = 64) -> list:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(20, 250, (40,), generator=g).tolist()
    out = []
    for i in range(n):
        length = int(torch.randint(8, 300, (1,), generator=g))
        if i % 2:
            rows = torch.randn(length, HIDDEN, generator=g) * 0.05
            out.append({"prompt_embeds": rows.to(torch.bfloat16)})
        else:
            ids = torch.randint(20, 250, (length,), generator=g).tolist()
            out.append({"prompt_token_ids": (prefix if i % 4 == 0 else []) + ids})
    return out


def _run(llm: LLM, prompts: list, alone: bool) -> list:
    if alone:
        outs = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _llm(model_dir, invariant: bool, **kw) -> LLM:
    return LLM(model_dir, enable_prompt_embeds=True, dtype="bfloat16", device="cuda",
               batch_invariant=invariant, gpu_memory_utilization=0.3, **kw)


def _differences(label: str, got: list, want: list, prompts: list) -> list[str]:
    """One line per prompt whose (tokens, logprobs) differ: its kind, the first position that differs and
    whether the tokens differ there or only the logprobs."""
    out = []
    for i, ((tokens, logprobs), (want_tokens, want_logprobs)) in enumerate(zip(got, want)):
        if (tokens, logprobs) == (want_tokens, want_logprobs):
            continue
        kind = "embeds" if "prompt_embeds" in prompts[i] else f"ids ({len(prompts[i]['prompt_token_ids'])})"
        at = next((k for k, (a, b) in enumerate(zip(tokens, want_tokens)) if a != b), None)
        if at is None:
            at = next(k for k, (a, b) in enumerate(zip(logprobs, want_logprobs)) if a != b)
            out.append(f"{label}: prompt {i} ({kind}): logprobs only, first at output {at}: "
                       f"{logprobs[at]} != {want_logprobs[at]}")
        else:
            out.append(f"{label}: prompt {i} ({kind}): tokens differ from output {at}")
    return out


def test_engine_alone_batch64_chunked_cached_are_the_same_bits(model_dir):
    prompts = _prompts()
    llm = _llm(model_dir, True)
    assert llm.use_cuda_graphs and llm.runner.num_fused_layers == 0
    alone = _run(llm, prompts, alone=True)
    assert _run(llm, prompts, alone=False) == alone
    # Without logprobs the decodes run in windows (argmax on the device, tokens fed back there).
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [a[0] for a in alone]
    assert llm.runner.num_graph_replays > 0 and llm.runner.num_decode_windows > 0
    llm.shutdown()

    # Chunked prefills, prefix caching, and both: every difference is collected, then reported at once.
    found = []
    for options in ({"max_num_batched_tokens": 96}, {"enable_prefix_caching": True},
                    {"max_num_batched_tokens": 96, "enable_prefix_caching": True}):
        llm = _llm(model_dir, True, **options)
        found += _differences(f"{options}", _run(llm, prompts, alone=False), alone, prompts)
        if options.get("enable_prefix_caching"):  # a warm prefix cache, the prompts in reverse order
            found += _differences(f"{options}, warm", _run(llm, prompts[::-1], alone=False)[::-1], alone,
                                  prompts)
            assert llm.block_manager.num_hit_blocks > 0
        llm.shutdown()
    assert not found, "\n".join(found)

    llm = _llm(model_dir, False)
    default_alone, default_batch = _run(llm, prompts, alone=True), _run(llm, prompts, alone=False)
    same = sum(a[0] == b[0] for a, b in zip(default_alone, default_batch))
    print(f"without batch_invariant: {same}/{len(prompts)} prompts' tokens alone == in the batch of 64")
    assert default_alone != default_batch  # the bits differ by default
    llm.shutdown()


def test_served_64_clients_equal_offline_alone(model_dir, tmp_path):
    sys.path.insert(0, str(Path(__file__).parent / "serve"))
    import httpx
    from serve_helpers import ServerProcess

    prompts = [p["prompt_token_ids"] for p in _prompts() if "prompt_token_ids" in p] * 2
    offline = _llm(model_dir, True)
    want = [offline.generate([{"prompt_token_ids": p}], PARAMS, use_tqdm=False)[0].outputs[0]
            for p in prompts]
    offline.shutdown()
    server = ServerProcess(model_dir, tmp_path / "server.log", "--device", "cuda", "--dtype", "bfloat16",
                           "--batch-invariant", "--gpu-memory-utilization", "0.3",
                           "--served-model-name", "bi")
    try:
        async def one(http: httpx.AsyncClient, prompt: list[int]) -> dict:
            body = {"model": "bi", "prompt": prompt, "temperature": 0.0, "max_tokens": 32,
                    "ignore_eos": True, "logprobs": 1}
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        async def run_all() -> list[dict]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                         limits=httpx.Limits(max_connections=64)) as http:
                return await asyncio.gather(*(one(http, p) for p in prompts))

        got = asyncio.run(run_all())
    finally:
        assert server.stop() == 0, server.log()
    for choice, w in zip(got, want):
        assert choice["text"] == w.text
        assert choice["logprobs"]["token_logprobs"] == [row[t] for t, row in zip(w.token_ids, w.logprobs)]
