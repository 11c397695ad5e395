"""Mixed-step CUDA graphs: prefill chunks and decodes of one step replayed from a token-count bucket.

On the CPU the graphs are emulated (`capture_cuda_graphs(emulate=True)`: "replay" runs the captured
body eagerly on the same fixed, padded views), so the bucket choice, the padding tokens and requests,
the fixed LM-head rows and the hand-off of sampled rows are checked against the eager engine to the
token; the GPU test checks real captures against Hugging Face.
"""

from __future__ import annotations

import pytest
import torch

from bridge.tiny_models import build_tiny_model
from runner.config import EngineConfig, auto_mixed_graph_max_tokens
from runner.llm import LLM
from runner.sampling_params import SamplingParams
from runner.worker.cuda_graphs import mixed_graph_token_sizes

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("mixed_graphs") / "qwen3", "qwen3", seed=5)


def _batch(hidden: int, vocab: int) -> list[dict]:
    """Token prompts and whole-prompt embeddings of several lengths: chunked prefills beside decodes."""
    g = torch.Generator().manual_seed(7)
    batch = []
    for i, n in enumerate((3, 30, 9, 17, 41, 2, 12)):
        if i % 3 == 1:
            batch.append({"prompt_embeds": torch.randn(n, hidden, generator=g) * 0.5})
        else:
            batch.append({"prompt_token_ids": torch.randint(10, vocab, (n,), generator=g).tolist()})
    return batch


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_token_buckets_pad_by_less_than_half():
    assert mixed_graph_token_sizes(0) == []
    assert mixed_graph_token_sizes(8) == [8]
    assert mixed_graph_token_sizes(24) == [16, 24]
    assert mixed_graph_token_sizes(4096) == [16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096]
    sizes = mixed_graph_token_sizes(8192)
    assert sizes[-1] == 8192 and sizes == sorted(set(sizes))
    for small, big in zip(sizes[5:], sizes[6:]):  # from 512 on, the next bucket is at most 1.5x
        assert big <= small * 3 // 2


def test_default_cap_follows_the_decoder_size(model_dir):
    assert auto_mixed_graph_max_tokens(440_000_000) == 16384  # W1's model: 0.44B decoder parameters
    assert auto_mixed_graph_max_tokens(1_300_000_000) == 4096
    assert auto_mixed_graph_max_tokens(6_500_000_000) == 1024  # 7B
    assert auto_mixed_graph_max_tokens(70_000_000_000) == 512  # 70B: vLLM's default capture size
    assert auto_mixed_graph_max_tokens(100_000) == 16384  # tiny models: the upper bound
    llm = LLM(model_dir, device="cpu", num_kv_blocks=16, max_num_batched_tokens=1000)
    assert llm.runner.mixed_graph_max_tokens == 1000  # never above the step budget
    assert LLM(model_dir, device="cpu", num_kv_blocks=16,
               mixed_graph_max_tokens=0).runner.mixed_graph_max_tokens == 0


def test_config_default_validation_and_clamp(model_dir):
    from runner.worker.model_states import load_hf_config

    hf = load_hf_config(model_dir)
    assert EngineConfig(str(model_dir), device="cpu").resolve(hf).mixed_graph_max_tokens is None  # auto
    assert EngineConfig(str(model_dir), device="cpu", max_num_batched_tokens=64,
                        mixed_graph_max_tokens=100).resolve(hf).mixed_graph_max_tokens == 64
    off = EngineConfig(str(model_dir), device="cpu", mixed_graph_max_tokens=0).resolve(hf)
    assert off.mixed_graph_max_tokens == 0
    for bad in (-1, 1.5, True, "4096"):
        with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
            EngineConfig(str(model_dir), device="cpu", mixed_graph_max_tokens=bad).resolve(hf)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mixed_steps_replay_buckets_and_match_eager(model_dir, async_scheduling):
    """Chunked prefills (16 tokens a step) beside decodes, token and embeds prompts: every step of at
    most 16 tokens replays a bucket; the tokens equal the eager engine's; every block and slot is free."""
    kw = dict(enable_prompt_embeds=True, dtype="float32", device="cpu", num_kv_blocks=128,
              max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=async_scheduling)
    eager = LLM(model_dir, **kw)
    graphed = LLM(model_dir, mixed_graph_max_tokens=16, **kw)
    graphed.runner.capture_cuda_graphs(emulate=True)
    assert graphed.runner.mixed_graphs.sizes == [16]
    batch = _batch(eager.hidden_size, eager.get_tokenizer().vocab_size)
    want = _tokens(eager.generate(batch, GREEDY, use_tqdm=False))
    got = _tokens(graphed.generate(batch, GREEDY, use_tqdm=False))
    assert got == want
    runner = graphed.runner
    assert runner.num_mixed_graph_replays > 0
    # Every step replayed a graph: a decode bucket or the mixed one (no step exceeds 16 tokens).
    assert runner.num_mixed_graph_replays + runner.num_graph_replays == runner.num_forward_steps
    assert eager.runner.num_mixed_graph_replays == 0
    assert graphed.stats().num_free_blocks == graphed.stats().num_total_blocks
    assert graphed.stats().num_free_slots == graphed.stats().num_total_slots


def test_steps_beyond_the_largest_bucket_and_prompt_logprobs_run_eagerly(model_dir):
    llm = LLM(model_dir, enable_prompt_embeds=True, dtype="float32", device="cpu", num_kv_blocks=128,
              max_num_batched_tokens=64, max_num_seqs=4, mixed_graph_max_tokens=16)
    llm.runner.capture_cuda_graphs(emulate=True)
    runner = llm.runner
    prompt = {"prompt_token_ids": list(range(20, 60))}  # 40 tokens: one eager prefill step
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(prompt, one, use_tqdm=False)
    assert runner.num_mixed_graph_replays == 0
    short = {"prompt_token_ids": list(range(20, 30))}
    llm.generate(short, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2), use_tqdm=False)
    assert runner.num_mixed_graph_replays == 0  # prompt-logprob rows need every prompt row's logits
    out = llm.generate(short, one, use_tqdm=False)[0]
    assert runner.num_mixed_graph_replays == 1
    reference = LLM(model_dir, enable_prompt_embeds=True, dtype="float32", device="cpu", num_kv_blocks=128)
    assert out.outputs[0].token_ids == reference.generate(short, one, use_tqdm=False)[0].outputs[0].token_ids


def test_passthrough_items_gathered_before_a_mixed_replay(model_dir):
    """Item rows (a prompt-embeds item behind `<embeds>`) go into the embeddings buffer the graph reads."""
    kw = dict(enable_prompt_embeds=True, dtype="float32", device="cpu", num_kv_blocks=128,
              max_num_batched_tokens=32, max_num_seqs=4)
    eager = LLM(model_dir, **kw)
    graphed = LLM(model_dir, **kw)
    graphed.runner.capture_cuda_graphs(emulate=True)
    g = torch.Generator().manual_seed(3)
    items = [{"prompt": f"look {i} <embeds> now", "multi_modal_data":
              {"prompt_embeds": [torch.randn(3 + i, eager.hidden_size, generator=g)]}} for i in range(3)]
    want = _tokens(eager.generate(items, GREEDY, use_tqdm=False))
    got = _tokens(graphed.generate(items, GREEDY, use_tqdm=False))
    assert got == want and graphed.runner.num_mixed_graph_replays > 0


def test_a_failed_capture_keeps_prefills_eager_and_decode_graphs(model_dir, monkeypatch, caplog):
    """A model whose prefill forward cannot be captured (a host sync in some layer) still builds: the
    failure is logged, prefills run eagerly, decode steps keep their graphs, the tokens are unchanged."""
    from runner.worker import step_graphs

    def uncapturable(runner, tokens):
        raise RuntimeError("operation not permitted when stream is capturing")

    kw = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
    reference = LLM(model_dir, **kw)
    llm = LLM(model_dir, **kw)
    monkeypatch.setattr(step_graphs, "mixed_graph_body", uncapturable)
    with caplog.at_level("WARNING", logger="runner.worker.step_graphs"):
        llm.runner.capture_cuda_graphs(emulate=True)
    assert "prefill and mixed steps stay eager" in caplog.text and "stream is capturing" in caplog.text
    assert not llm.runner.mixed_graphs.graphs and llm.runner.decode_graphs.graphs
    batch = [{"prompt_token_ids": list(range(20, 20 + n))} for n in (5, 19, 9)]
    assert _tokens(llm.generate(batch, GREEDY, use_tqdm=False)) == \
        _tokens(reference.generate(batch, GREEDY, use_tqdm=False))
    assert llm.runner.num_mixed_graph_replays == 0 and llm.runner.num_graph_replays > 0


@pytest.mark.gpu
def test_mixed_graphs_on_the_gpu_match_hf(model_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(10, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 33, 70, 12)]
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                    for p in prompts]
    llm = LLM(model_dir, dtype="float32", device="cuda", kv_cache_memory=64 << 20,
              max_num_batched_tokens=64)
    assert llm.runner.mixed_graphs.graphs  # captured
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert _tokens(out) == expected
    assert llm.runner.num_mixed_graph_replays > 0
