"""The engine is correct to the token: greedy `LLM.generate` equals Hugging Face greedy `generate()`.

Tiny fp32 llama / qwen2 / qwen3 models (2 layers, hidden 64) built in code. Each family runs three
engine configurations: the default, a token budget small enough to chunk prefills across steps
and requests, and a KV cache small enough to force preemption by recompute. In each, the same
prompts given as token ids, as prompt embeddings (the model's own input embeddings of those ids)
and as a mixed batch produce exactly Hugging Face's tokens, and every block and slot is free after.
"""

from __future__ import annotations

import pytest
import torch

from bridge.tiny_models import build_tiny_model
from runner.llm import LLM
from runner.sampling_params import SamplingParams

FAMILIES = ("llama", "qwen2", "qwen3")
PROMPT_LENGTHS = (1, 3, 7, 12, 20, 33, 48, 70)
MAX_TOKENS = 16
CONFIGS = {
    "default": dict(num_kv_blocks=256),
    # 16 tokens per step: prompts are chunked, several requests share a step's budget.
    "chunked": dict(num_kv_blocks=256, max_num_batched_tokens=16, max_num_seqs=4),
    # 26 blocks of 4 tokens hold one long request (70 + 16 tokens) but nowhere near all eight.
    "preempt": dict(num_kv_blocks=26, block_size=4, max_num_batched_tokens=32),
}


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_models")
    return {f: build_tiny_model(root / f, f, seed=11) for f in FAMILIES}


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_reference(model_dirs):
    """Per family: the HF model, the prompts and HF's greedy continuation of each (batch of one)."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for family, path in model_dirs.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = _prompts(model.config.vocab_size)
        outs = []
        with torch.no_grad():
            for ids in prompts:
                seq = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
                outs.append(seq[0, len(ids) :].tolist())
        refs[family] = (model, prompts, outs)
    return refs


def _embeds_of(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.get_input_embeddings()(torch.tensor(ids)).clone()


def _assert_all_free(llm: LLM) -> None:
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
    assert llm.stats().num_free_slots == llm.stats().num_total_slots


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_token_and_embeds_paths_match_hf(family, config_name, model_dirs, hf_reference):
    model, prompts, expected = hf_reference[family]
    llm = LLM(model_dirs[family], enable_prompt_embeds=True, dtype="float32", device="cpu",
              **CONFIGS[config_name])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    _assert_all_free(llm)
    if config_name == "chunked":
        assert llm.scheduler.num_partial_prefills > 0  # prompts were split across steps
        assert llm.scheduler.num_mixed_steps > 0  # decodes and prefill chunks shared steps
    if config_name == "preempt":
        assert llm.stats().num_preemptions > 0

    preempted_before = llm.stats().num_preemptions
    outs = llm.generate([{"prompt_embeds": _embeds_of(model, p)} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.prompt_token_ids == [0] * len(p) for o, p in zip(outs, prompts))
    _assert_all_free(llm)
    if config_name == "preempt":
        assert llm.stats().num_preemptions > preempted_before


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_text_ids_and_embeds(family, model_dirs, hf_reference):
    model, prompts, expected = hf_reference[family]
    llm = LLM(model_dirs[family], enable_prompt_embeds=True, dtype="float32", device="cpu", num_kv_blocks=256,
              max_num_batched_tokens=24)
    tok = llm.get_tokenizer()
    text = "the quick brown fox jumps"
    text_ids = tok.encode(text)
    with torch.no_grad():
        text_ref = model.generate(torch.tensor([text_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    text_ref = text_ref[0, len(text_ids) :].tolist()

    # Half-token, half-embeds prompt: token positions carry garbage embeddings that must be ignored.
    partial_ids = prompts[6]
    mask = torch.arange(len(partial_ids)) % 2 == 0
    partial_embeds = _embeds_of(model, partial_ids)
    partial_embeds[mask] = 1e3
    batch = [
        text,
        {"prompt_embeds": _embeds_of(model, prompts[5])},
        {"prompt_token_ids": prompts[3]},
        {"prompt_embeds": partial_embeds, "prompt_is_token_ids": mask, "prompt_token_ids": partial_ids},
        {"prompt": text},
        {"prompt_embeds": _embeds_of(model, prompts[0])},
    ]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [text_ref, expected[5], expected[3], expected[6], text_ref, expected[0]]
    assert outs[3].prompt_token_ids == [t if m else 0 for t, m in zip(partial_ids, mask.tolist())]
    _assert_all_free(llm)


def test_slot_reuse_never_serves_previous_embeds(model_dirs, hf_reference):
    """One slot, many requests in turn: each embeds request must see only its own rows."""
    model, prompts, expected = hf_reference["qwen3"]
    llm = LLM(model_dirs["qwen3"], enable_prompt_embeds=True, dtype="float32", device="cpu", num_kv_blocks=64,
              max_num_seqs=1)
    batch = [{"prompt_embeds": _embeds_of(model, p)} if i % 2 else {"prompt_token_ids": p}
             for i, p in enumerate(prompts[:5])]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[:5]
    _assert_all_free(llm)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_graphs_match_eager_and_hf(family, model_dirs, hf_reference):
    _, prompts, expected = hf_reference[family]
    eager = LLM(model_dirs[family], dtype="float32", device="cuda", enforce_eager=True,
                kv_cache_memory=64 << 20)
    graphed = LLM(model_dirs[family], dtype="float32", device="cuda", kv_cache_memory=64 << 20)
    batch = [{"prompt_token_ids": p} for p in prompts]
    out_eager = [o.outputs[0].token_ids for o in eager.generate(batch, GREEDY, use_tqdm=False)]
    out_graph = [o.outputs[0].token_ids for o in graphed.generate(batch, GREEDY, use_tqdm=False)]
    assert graphed.runner.num_graph_replays > 0
    assert graphed.runner.num_mixed_graph_replays > 0  # the prefills replayed mixed-step graphs
    assert out_graph == out_eager == expected


def test_decode_buckets_and_triton_kernels_inside_the_engine(model_dirs, hf_reference):
    """The GPU code path on the CPU: padded decode buckets on fixed buffer offsets (CUDA graphs
    emulated by eager replays of the same body), decode windows, the fused RMSNorm, and then the
    Triton attention and rotary kernels under TRITON_INTERPRET, with chunked prefill over a paged
    prefix and prompt embeddings."""
    from runner.layers.hf_attention import set_attention_backend

    model, prompts, expected = hf_reference["qwen3"]
    llm = LLM(model_dirs["qwen3"], enable_prompt_embeds=True, dtype="float32", device="cpu",
              num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=8)
    llm.runner.capture_cuda_graphs(emulate=True)
    llm.decode_window = 3
    from runner.layers import fused_ops

    assert fused_ops.fuse_rmsnorms(llm.runner.model) == 2 * 4 + 1  # 4 norms per layer (qwen3) + final norm
    assert fused_ops.fuse_rotary(llm.runner.model)
    picks = [0, 2, 4, 5, 1]  # five requests: decode steps run in the padded bucket of 8
    batch = [{"prompt_embeds": _embeds_of(model, prompts[i])} if i % 2 else {"prompt_token_ids": prompts[i]}
             for i in picks]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    eager = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert eager == [expected[i][:6] for i in picks]
    assert llm.runner.num_graph_replays > 0
    assert llm.runner.num_mixed_graph_replays > 0  # prefill chunks in the 16- and 24-token buckets
    previous = set_attention_backend("triton")
    fused_ops.ROTARY_ON_CPU = True
    try:
        replays = llm.runner.num_graph_replays
        triton = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    finally:
        set_attention_backend(previous)
        fused_ops.ROTARY_ON_CPU = False
    assert triton == eager
    assert llm.runner.num_graph_replays > replays
    _assert_all_free(llm)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rmsnorm_matches_hf_modules(family, dtype, model_dirs, hf_reference):
    from runner.layers.fused_ops import FUSABLE_RMSNORM_CLASSES, rms_norm

    model = hf_reference[family][0]
    norms = [m for m in model.modules() if type(m).__name__ in FUSABLE_RMSNORM_CLASSES]
    assert norms
    g = torch.Generator().manual_seed(3)
    for norm in norms[:3]:
        n = norm.weight.shape[0]
        weight = (torch.randn(n, generator=g) + 1).to(dtype)
        x = (torch.randn(2, 7, n, generator=g) * 3).to(dtype)
        module = type(norm)(n, eps=norm.variance_epsilon).to(dtype)
        with torch.no_grad():
            module.weight.copy_(weight)
            expected = module(x)
        got = rms_norm(x, module.weight, module.variance_epsilon)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.07, rtol=1e-2)
        torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decode_windows_match_hf_and_single_steps(family, model_dirs, hf_reference):
    """Greedy decode steps run several at a time with device-fed tokens (graphs emulated on the CPU)."""
    model, prompts, expected = hf_reference[family]
    llm = LLM(model_dirs[family], enable_prompt_embeds=True, dtype="float32", device="cpu",
              num_kv_blocks=256, max_num_seqs=8, decode_window=1)
    llm.runner.capture_cuda_graphs(emulate=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    # Single steps first: the reference for stop behaviour inside a window.
    stop_id = expected[5][6]
    stopping = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=[stop_id])
    single = [o.outputs[0] for o in llm.generate(batch, stopping, use_tqdm=False)]

    llm.decode_window = 4
    steps = llm.stats().num_steps
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats().num_steps - steps >= MAX_TOKENS - 1  # every decode step still ran
    assert llm.runner.num_decode_windows > 0
    windows = llm.runner.num_decode_windows
    windowed = [o.outputs[0] for o in llm.generate(batch, stopping, use_tqdm=False)]
    assert llm.runner.num_decode_windows > windows
    assert [(o.token_ids, o.finish_reason, o.stop_reason) for o in windowed] == \
        [(o.token_ids, o.finish_reason, o.stop_reason) for o in single]
    assert windowed[5].finish_reason == "stop" and windowed[5].token_ids[-1] == stop_id
    # Different max_tokens in one window: each request stops at its own limit, and the rows of those that
    # reached it are inert for the rest of the window (no keys read, no KV written): every decode-graph
    # replay's live rows (context > 0) are then exactly the tokens kept after each request's first.
    live_rows = []
    st = llm.runner.staging
    for b, replayer in llm.runner.decode_graphs.graphs.items():
        v = st.views(st.dev64, st.dev32, b, b, llm.runner.max_blocks_per_req, 0)

        def recording(replay=replayer.replay, v=v):
            live = v.seq_lens > 0
            assert torch.equal(live, v.slot_mapping >= 0)  # inert rows write no KV either
            live_rows.append(int(live.sum()))
            replay()

        replayer.replay = recording
    lengths = [1, 2, 3, 5, 7, 9, 11, 13]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    windows = llm.runner.num_decode_windows
    outs = llm.generate(batch, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    assert all(o.outputs[0].token_ids == e[:n] for o, e, n in zip(outs, expected, lengths) if len(e) >= n)
    assert llm.runner.num_decode_windows > windows
    assert sum(live_rows) == sum(lengths) - len(lengths)
    _assert_all_free(llm)


def test_pipelined_decode_windows_match_synchronous_windows(model_dirs, hf_reference):
    """A window launched behind the one in flight (planned before that one's tokens are read), or behind
    the overlapped prefill step before it, gives the synchronous windows' tokens, stops and finish
    reasons: a stop on a token of the window (or step) read drops the next window's tokens, requests
    ended by length are left out of the next window, an abort with a window in flight frees everything,
    and prefix caching keys only blocks of known tokens."""
    from runner.request import Request

    model, prompts, expected = hf_reference["qwen3"]
    llm = LLM(model_dirs["qwen3"], dtype="float32", device="cpu", num_kv_blocks=256, max_num_seqs=8,
              decode_window=3, enable_prefix_caching=True)
    llm.runner.capture_cuda_graphs(emulate=True)
    batch = [{"prompt_token_ids": p} for p in prompts[:7]]  # the seven shortest: CPU time
    stop_id = expected[5][7]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 4, 12, 7, 12)]
    params.append(SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id]))
    # Stops on its first token, the prefill step's: the first window was launched behind that step.
    params.append(SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[expected[6][0]]))

    def run() -> list[tuple]:
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                for o in llm.generate(batch, params, use_tqdm=False)]

    llm.core.pipeline_windows = False
    synchronous = run()
    assert llm.core.num_pipelined_windows == 0 and llm.core.num_windows_behind_steps == 0
    llm.core.pipeline_windows = True
    discarded = llm.scheduler.num_discarded_tokens
    pipelined = run()
    assert llm.core.num_pipelined_windows > 0 and llm.core.num_windows_behind_steps > 0
    assert pipelined == synchronous
    assert pipelined[5][1] == "stop" and pipelined[5][0][-1] == stop_id
    assert pipelined[6] == ([expected[6][0]], "stop", expected[6][0])
    assert [len(t) for t, _, _ in pipelined[:5]] == [2, 4, 12, 7, 12]
    assert all(t == e[: len(t)] for (t, _, _), e in zip(pipelined, expected))
    assert llm.scheduler.num_discarded_tokens > discarded  # the stopped request's next-window tokens
    _assert_all_free(llm)
    hits = llm.core.block_manager.num_hit_blocks
    assert run() == synchronous  # again, from the blocks the pipelined run keyed
    assert llm.core.block_manager.num_hit_blocks > hits

    # An abort with a window in flight: the request's tokens are dropped, its blocks and slot freed.
    for i, p in enumerate(prompts[:3]):
        llm.core.add_request(Request(f"a{i}", i, list(p), SamplingParams(max_tokens=10, temperature=0.0,
                                                                          ignore_eos=True)))
    while llm.core.window is None:
        llm.core.step()
    assert llm.core.abort("a1") is not None
    while llm.core.has_unfinished():
        llm.core.step()
    assert llm.core.window is None
    _assert_all_free(llm)


@pytest.mark.gpu
def test_gpu_a_window_launched_behind_another_does_not_wait_for_it(model_dirs, hf_reference):
    """Launching the next window queues everything, never waits for the window in flight: a copy from
    pageable memory (the rows of the requests that go on, the inert-row mask) first waits for the
    whole stream, which had serialised the two windows. A ~0.2 s sleep kernel queued behind the first
    window makes any such wait plain; the tokens still equal the synchronous windows'."""
    import time

    _, prompts, expected = hf_reference["qwen3"]
    llm = LLM(model_dirs["qwen3"], dtype="float32", device="cuda", kv_cache_memory=64 << 20, decode_window=4)
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (3, 6, 16, 9, 16, 11, 16, 5)]
    llm.core.pipeline_windows = False
    synchronous = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    llm.core.pipeline_windows = True
    launch, waits = llm.runner.launch_decode_window, []

    def launch_behind(so, k, prev=None):
        if prev is None:
            return launch(so, k, prev)
        torch.cuda._sleep(400_000_000)  # about 0.2 s at 2 GHz
        t0 = time.perf_counter()
        out = launch(so, k, prev)
        waits.append(time.perf_counter() - t0)
        return out

    llm.runner.launch_decode_window = launch_behind
    pipelined = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    assert pipelined == synchronous and len(waits) >= 2
    assert max(waits) < 0.1, waits


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_rotary_matches_hf(family, hf_reference):
    import sys

    from runner.layers import fused_ops
    from runner.layers.attention_metadata import ForwardContext, set_forward_context

    model = hf_reference[family][0]
    original = sys.modules[type(model).__module__].apply_rotary_pos_emb
    original = getattr(original, "bridge_original", original)
    g = torch.Generator().manual_seed(4)
    t, d = 9, 16
    # q/k laid out as HF makes them: (1, T, H, D) projections viewed as (1, H, T, D).
    q = torch.randn(1, t, 4, d, generator=g).transpose(1, 2)
    k = torch.randn(1, t, 2, d, generator=g).transpose(1, 2)
    pos = torch.arange(t, dtype=torch.float32)[None, :, None] * torch.rand(d // 2, generator=g)
    emb = torch.cat([pos, pos], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    expected = original(q, k, cos, sin)
    assert fused_ops.rope_fusable(q, k, cos, sin) is False  # CPU tensors take HF's path by default
    fused_ops.ROTARY_ON_CPU = True
    try:
        got = fused_ops.apply_rope(q, k, cos, sin)
        assert fused_ops.fuse_rotary(model)
        wrapped = sys.modules[type(model).__module__].apply_rotary_pos_emb
        outside = wrapped(q, k, cos, sin)  # no Bridge forward context: HF's own function
        with set_forward_context(ForwardContext(attn_metadata=None, kv_caches=[])):
            inside = wrapped(q, k, cos, sin)
    finally:
        fused_ops.ROTARY_ON_CPU = False
    for a, b in zip(got, expected):
        assert a.shape == b.shape and a.stride() == b.stride()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(outside, expected))
    assert all(torch.equal(a, b) for a, b in zip(inside, got))


def test_decode_window_stops_where_every_request_reaches_max_tokens():
    """Window steps after every running request has reached its max_tokens would only be dropped."""
    from runner.engine.block_manager import BlockManager
    from runner.engine.scheduler import Scheduler
    from runner.request import Request

    scheduler = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    for i, (max_tokens, done) in enumerate([(5, 1), (10, 4)]):
        req = Request(f"w{i}", i, [11, 12, 13], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                      output_token_ids=[20] * done)
        req.num_computed_tokens = req.num_tokens - 1  # a plain decode
        scheduler.running.append(req)
    assert scheduler.decode_window_size(32, 1000) == 10 - 4  # the longest still needs 6 tokens
    assert scheduler.decode_window_size(4, 1000) == 4
    assert scheduler.decode_window_size(32, 3 + 4 + 2) == 2  # the context limit still bounds it

