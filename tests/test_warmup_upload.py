"""Warm-up at construction and the host uploader.

The warm-up's dummy requests must leave nothing behind: counters as before, every KV block and slot
free, the same outputs for the caller's requests. The uploader must give back exactly the rows it
was handed (cast to the model dtype), catch NaN/Inf on the device, keep its pinned memory bounded
(tensors larger than the ring go through in chunks) and release its keep budget when a kept tensor
is freed. The CUDA parts are marked `gpu`; the CPU device path is tested here too.
"""

from __future__ import annotations

import gc

import pytest
import torch

from bridge.tiny_models import build_tiny_model
from runner import LLM, SamplingParams
from runner.worker.host_upload import HostUploader


@pytest.fixture(scope="module")
def model_dir(tiny_model_root):
    return build_tiny_model(tiny_model_root / "warmup_qwen3", "qwen3", seed=3, max_position_embeddings=256)


def _counters(llm: LLM) -> dict:
    stats = llm.stats()
    return {"steps": stats.num_steps, "preemptions": stats.num_preemptions, "async": stats.num_async_steps,
            "forward": llm.runner.num_forward_steps, "replays": llm.runner.num_graph_replays,
            "windows": llm.runner.num_decode_windows}


def test_warm_up_leaves_no_trace_and_changes_no_output(model_dir, one_cpu_thread):
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]},
               {"prompt_embeds": torch.randn(9, 64, generator=torch.Generator().manual_seed(0))}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    cold = LLM(model_dir, enable_prompt_embeds=True, num_kv_blocks=64, warmup=False)
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, params, use_tqdm=False)]
    fresh_counters = _counters(LLM(model_dir, enable_prompt_embeds=True, num_kv_blocks=64, warmup=False))
    cold.shutdown()

    warm = LLM(model_dir, enable_prompt_embeds=True, num_kv_blocks=64, warmup=True)
    assert warm.warmup_seconds > 0
    assert _counters(warm) == fresh_counters  # the dummy requests are not counted
    assert warm.stats().all_free
    outs = warm.generate(prompts, params, use_tqdm=False)
    assert [o.request_id for o in outs] == ["0", "1"]  # ids start where a cold engine's do
    assert [o.outputs[0].token_ids for o in outs] == expected
    warm.shutdown()


def test_warm_up_leaves_nothing_in_the_prefix_cache(model_dir, one_cpu_thread):
    llm = LLM(model_dir, num_kv_blocks=64, enable_prefix_caching=True, warmup=True)
    block_manager = llm.core.scheduler.block_manager
    assert block_manager.num_cached_blocks == 0 and block_manager.num_queried_blocks == 0
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    assert block_manager.num_cached_blocks > 0  # the cache itself still works
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens > 0
    llm.shutdown()


def test_serving_warm_up_prefills_every_query_length_class_and_leaves_no_trace(model_dir, one_cpu_thread):
    """The server's extra warm-up: one step per power of two of the longest query (the prefill
    kernel's compile-time row block), embeds and ids; forgotten like the construction warm-up."""
    from runner.warmup import SERVING_PROMPT_LENGTHS, warm_up_serving

    llm = LLM(model_dir, enable_prompt_embeds=True, num_kv_blocks=64, warmup=False)
    fresh = _counters(llm)
    seen: list[int] = []
    runner = llm.core.runner
    launch = runner.launch

    def spy(so, *args, **kwargs):
        seen.append(max(so.num_scheduled_tokens))
        return launch(so, *args, **kwargs)

    runner.launch = spy
    assert warm_up_serving(llm) > 0
    runner.launch = launch
    classes = {1 << (n - 1).bit_length() for n in seen if n > 1}
    assert classes == {1 << (n - 1).bit_length() for n in SERVING_PROMPT_LENGTHS}
    assert _counters(llm) == fresh
    assert llm.stats().all_free
    llm.shutdown()


def test_warm_up_is_off_on_the_cpu_by_default(model_dir, one_cpu_thread):
    llm = LLM(model_dir, num_kv_blocks=32)
    assert llm.engine_config.warmup is False and llm.warmup_seconds == 0.0
    report = llm.memory_report()
    assert report["num_kv_blocks"] == 32 and report["kv_cache_tokens"] == 32 * report["block_size"]
    assert report["weights_bytes"] > 0 and report["kv_cache_bytes"] > 0
    llm.shutdown()


def test_cpu_uploader_copies_and_checks():
    up = HostUploader(torch.device("cpu"))
    src = torch.randn(5, 8)
    out, ok = up.upload(src, torch.bfloat16, check_fits=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, src.to(torch.bfloat16))
    src[0, 0] = 7.0
    assert out[0, 0].item() != 7.0  # an owned copy
    bad = torch.tensor([[1.0, float("nan")]])
    assert up.read_flags([ok, up.upload(bad, torch.float32, check_fits=True)[1]]) == [True, False]
    assert not up.keep(out)  # nothing is kept on a CPU device


@pytest.mark.gpu
def test_gpu_uploader_round_trips_in_chunks_and_bounds_its_memory():
    up = HostUploader(torch.device("cuda"), ring_bytes=1 << 16, keep_bytes=1 << 20)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, 64, generator=g) for n in (3, 700, 1, 2048)]  # 2048 x 64 x 4 > the ring
    outs = [up.upload(t, torch.bfloat16, check_fits=True) for t in tensors]
    assert up.read_flags([ok for _, ok in outs]) == [True] * 4
    for t, (out, _) in zip(tensors, outs):
        assert out.is_cuda and out.dtype == torch.bfloat16
        assert torch.equal(out.cpu(), t.to(torch.bfloat16))
    assert up._ring.numel() == 1 << 16 and up._ring.is_pinned()
    inf = torch.tensor([[1e39, 0.0]], dtype=torch.float64)  # finite in float64, Inf in bfloat16
    assert up.read_flags([up.upload(inf, torch.bfloat16, check_fits=True)[1]]) == [False]
    kept, _ = up.upload(torch.ones(1024, 64), torch.float32)
    assert up.keep(kept) and up.kept_bytes == 1024 * 64 * 4
    big, _ = up.upload(torch.ones(3073, 64), torch.float32)  # 768 KiB + 256 B: with `kept`, over 1 MiB
    assert not up.keep(big)  # over the keep budget
    del kept
    gc.collect()
    assert up.kept_bytes == 0


@pytest.mark.gpu
def test_gpu_flags_are_read_behind_a_busy_copy_stream():
    """The verdicts are read after the checks that write them, however long the copy stream is busy
    (a caller whose own stream is idle must not read them early)."""
    up = HostUploader(torch.device("cuda"))
    tensors = [torch.full((64, 64), float(i)) for i in range(8)]
    for _ in range(5):
        up._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(up._stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time ahead of the copies and checks
        oks = [up.upload(t, torch.bfloat16, check_fits=True)[1] for t in tensors]
        assert up.read_flags(oks) == [True] * len(tensors)


class _Parsed:
    """The one field of a parsed prompt that `stage_embeds` reads and writes."""

    def __init__(self, embeds):
        self.embeds = embeds


@pytest.mark.gpu
def test_gpu_upload_rows_packs_a_call_through_the_ring_and_checks_each_source():
    """A call's host prompts as one upload: sources cross ring chunks and chunk edges, an empty one in
    between; each verdict is its own source's; the views equal one-by-one uploads."""
    from runner.engine.embeds_staging import stage_embeds

    up = HostUploader(torch.device("cuda"), ring_bytes=1 << 16, keep_bytes=1 << 22)
    g = torch.Generator().manual_seed(2)
    srcs = [torch.randn(n, 64, generator=g, dtype=torch.float64) for n in (3, 700, 0, 1, 90)]
    srcs[3][0, 5] = 1e39  # finite in float64, Inf in bfloat16
    srcs[4][89, 63] = float("nan")  # the very last value of the call
    whole, views, ok = up.upload_rows(srcs, torch.bfloat16)
    assert up.read_flag_tensor(ok) == [True, True, True, False, False]
    assert whole.dtype == torch.bfloat16 and whole.shape == (794, 64)
    for src, view in zip(srcs[:3], views[:3]):
        assert view.shape == src.shape and torch.equal(view.cpu(), src.to(torch.bfloat16))
        assert view.data_ptr() % 16 == 0

    # A large chunk is filled by several threads (pieces of up to 1 MiB, across source boundaries).
    big = HostUploader(torch.device("cuda"), ring_bytes=64 << 20)
    large = [torch.randn(n, 1024, generator=g) for n in (1500, 1, 2600)]  # ~16 MiB in one ring chunk
    whole, views, ok = big.upload_rows(large, torch.float32)
    assert big.read_flag_tensor(ok) == [True] * 3
    assert all(torch.equal(view.cpu(), src) for view, src in zip(views, large))

    good = [_Parsed(torch.randn(n, 64, generator=g)) for n in (5, 600, 33)]
    host = [p.embeds for p in good]
    stage_embeds(good, torch.bfloat16, up, keep=True)
    for staged, h in zip(good, host):
        assert staged.embeds.is_cuda and torch.equal(staged.embeds.cpu(), h.to(torch.bfloat16))
    assert up.kept_bytes == 638 * 64 * 2  # one charge for the call's tensor
    bad = [_Parsed(torch.randn(4, 64, generator=g)), _Parsed(torch.full((2, 64), float("inf")))]
    with pytest.raises(ValueError, match="prompt 1: prompt_embeds contains NaN or Inf"):
        stage_embeds(bad, torch.bfloat16, up, keep=True)
    del good, staged
    gc.collect()
    assert up.kept_bytes == 0  # given back once the last view is gone


@pytest.mark.gpu
def test_gpu_threaded_fill_of_many_ring_laps_keeps_every_byte(monkeypatch):
    """Threads fill half a ring of chunks at a time while this thread queues each chunk's copy: a call
    several times the ring, starting mid-ring, with pieces crossing sources, arrives byte for byte."""
    from runner.worker import host_upload

    monkeypatch.setattr(host_upload, "PARALLEL_COPY_BYTES", 1 << 20)
    monkeypatch.setattr(host_upload, "PIECE_BYTES", 300_000)
    monkeypatch.setattr(host_upload, "COPY_THREADS", 3)
    up = HostUploader(torch.device("cuda"), ring_bytes=8 << 20)  # chunks of 2 MiB, groups of 4 MiB
    g = torch.Generator().manual_seed(5)
    first = torch.randn(1000, 256, generator=g)  # ~1 MiB: moves the ring's head off 0
    srcs = [torch.randn(n, 256, generator=g) for n in (7000, 1, 9000, 0, 15000)]  # ~30 MiB
    _, _, ok = up.upload_rows([first], torch.float32)
    whole, views, ok2 = up.upload_rows(srcs, torch.float32)
    assert up.read_flag_tensor([ok, ok2]) == [True] * 6
    assert all(torch.equal(view.cpu(), src) for view, src in zip(views, srcs))
    assert up.pinned_bytes == 8 << 20


@pytest.mark.gpu
def test_gpu_a_call_beyond_the_keep_budget_is_staged_in_batches(monkeypatch):
    """A call larger than the keep budget: its leading prompts that fit go up as one kept tensor, the
    rest are checked on the device in chunks and stay host tensors (uploaded again when admitted); a
    NaN in a checked-only chunk names its own prompt; the check chunks' memory is not held."""
    from runner.engine import embeds_staging as prompts_mod
    from runner.engine.embeds_staging import stage_embeds

    g = torch.Generator().manual_seed(3)
    up = HostUploader(torch.device("cuda"), ring_bytes=1 << 16, keep_bytes=40 * 64 * 2)
    calls = [_Parsed(torch.randn(n, 64, generator=g)) for n in (10, 20, 15, 7, 30, 2)]
    host = [p.embeds for p in calls]
    monkeypatch.setattr(prompts_mod, "CHECK_CHUNK_BYTES", 25 * 64 * 2)  # the rest: [15, 7], [30], [2]
    checks = []
    real = up.check_rows
    up.check_rows = lambda srcs, dtype: checks.append([t.shape[0] for t in srcs]) or real(srcs, dtype)
    stage_embeds(calls, torch.bfloat16, up, keep=True)
    assert checks == [[15, 7], [30], [2]]
    assert [p.embeds.is_cuda for p in calls] == [True, True, False, False, False, False]
    for p, h in zip(calls, host):
        want = h.to(torch.bfloat16) if p.embeds.is_cuda else h
        assert torch.equal(p.embeds.cpu(), want)
    assert up.kept_bytes == 30 * 64 * 2
    bad = [_Parsed(torch.randn(n, 64, generator=g)) for n in (10, 20, 15, 7, 30, 2)]
    bad[4].embeds[29, 0] = float("nan")
    with pytest.raises(ValueError, match="prompt 4: prompt_embeds contains NaN or Inf"):
        stage_embeds(bad, torch.bfloat16, up, keep=True)
    assert all(not p.embeds.is_cuda for p in bad)  # a refused call keeps its host tensors


@pytest.mark.gpu
def test_gpu_device_embeds_are_staged_as_one_call():
    """Prompts already on the device go up like host ones: one concatenation and one check for the call
    (not one upload per prompt), read after the work that produced them on the caller's stream; a bad
    prompt is named; a call mixing host and device tensors keeps the per-prompt path."""
    from runner.engine.embeds_staging import stage_embeds

    up = HostUploader(torch.device("cuda"), keep_bytes=1 << 22)
    calls = []
    real = up.upload_rows
    up.upload_rows = lambda srcs, dtype: calls.append(len(srcs)) or real(srcs, dtype)
    g = torch.Generator(device="cuda").manual_seed(4)
    torch.cuda._sleep(20_000_000)  # the caller's stream is busy: the sources are written after this
    good = [_Parsed(torch.randn(n, 64, generator=g, device="cuda").mul_(2)) for n in (5, 600, 33)]
    want = [p.embeds.to(torch.bfloat16) for p in good]
    stage_embeds(good, torch.bfloat16, up, keep=True)
    assert calls == [3]
    for staged, w in zip(good, want):
        assert staged.embeds.dtype == torch.bfloat16 and torch.equal(staged.embeds, w)
    bad = [_Parsed(torch.randn(4, 64, device="cuda")),
           _Parsed(torch.full((2, 64), float("nan"), device="cuda"))]
    with pytest.raises(ValueError, match="prompt 1: prompt_embeds contains NaN or Inf"):
        stage_embeds(bad, torch.bfloat16, up, keep=True)
    mixed = [_Parsed(torch.randn(4, 64, device="cuda")), _Parsed(torch.randn(3, 64))]
    stage_embeds(mixed, torch.bfloat16, up, keep=True)
    assert calls == [3, 2]  # only the bad call went as one; the mixed one went prompt by prompt
    assert all(p.embeds.is_cuda for p in mixed)


@pytest.mark.gpu
def test_gpu_cpu_tensor_embeds_match_device_embeds_and_ids(model_dir):
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (40, 7, 200)]  # context 256
    llm = LLM(model_dir, enable_prompt_embeds=True, dtype="float32", num_kv_blocks=256)
    table = llm.runner.embed_tokens.weight.detach()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    by_ids = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    on_host = llm.generate([{"prompt_embeds": table[i].cpu()} for i in ids], params, use_tqdm=False)
    on_device = llm.generate([{"prompt_embeds": table[i]} for i in ids], params, use_tqdm=False)
    toks = [[o.outputs[0].token_ids for o in outs] for outs in (by_ids, on_host, on_device)]
    assert toks[0] == toks[1] == toks[2]
    with pytest.raises(ValueError, match="prompt 1: prompt_embeds contains NaN"):
        llm.generate([{"prompt_embeds": table[ids[0]].cpu()},
                      {"prompt_embeds": torch.full((4, table.shape[1]), float("nan"))}], params)
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
    report = llm.memory_report()
    assert report["weights_bytes"] > 0 and report["reserved_bytes"] >= report["allocated_bytes"]
    llm.shutdown()
