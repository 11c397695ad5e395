"""Small pieces several test files share (imported as `helpers`: pytest puts `tests/` on the path)."""

from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import sys
import zlib

import pytest

from runner.multimodal.encoder_protocol import tensor_content_hash

ROOT = pathlib.Path(__file__).resolve().parents[1]


_SM90_PRELUDE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


# `fn` compiled for Hopper: `types` names the non-int arguments' types (the rest are i32), `consts` the
# constexprs, `aligned` the arguments marked 16-byte divisible; `options` are Triton's (num_warps, ...).
def build_sm90(fn, types, consts, aligned=(), **options):
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in names}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    assert kernel.asm["cubin"], fn.__name__
    return kernel
"""


def compile_for_sm90(script: str) -> str:
    """Run `script` (which compiles Triton kernels for Hopper, with the `build_sm90(fn, types, consts,
    aligned, **options)` defined before it) in a fresh process without TRITON_INTERPRET, and return its
    stdout: a kernel only the interpreter accepts is caught without a GPU. Skips when Triton's bundled
    ptxas is missing."""
    import triton

    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("Triton's bundled ptxas is not available")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _SM90_PRELUDE + script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


class IdentityEncoder:
    """An encoder whose item is an (n, hidden) tensor that encodes to itself, so the rows a test
    puts in are the rows the model reads. `calls` records the batch size of every `encode`."""

    def __init__(self, modality: str = "image", *, is_realtime: bool = False) -> None:
        self.modality = modality
        self.is_realtime = is_realtime
        self.calls: list[int] = []

    def num_rows(self, item) -> int:
        return int(item.shape[0])

    def content_hash(self, item) -> str:
        return tensor_content_hash(item)

    def encode(self, items):
        self.calls.append(len(items))
        return [item.clone() for item in items]


def tiny_graph_recipe_parts() -> dict:
    """The model, encoder and data sections of the cheapest recipe to train on a CPU (a one-layer
    tiny LLM reading synthetic graphs through a small GIN); fresh dicts on every call."""
    return {
        "model": {
            "tiny": {
                "hidden_size": 32,
                "num_layers": 1,
                "num_heads": 2,
                "num_kv_heads": 1,
                "head_dim": 16,
                "intermediate_size": 64,
            }
        },
        "encoder": {
            "modality": "graph",
            "tower": {"name": "gin", "dim": 32, "num_layers": 2, "readout_tokens": 2},
            "projector": {"name": "mlp", "num_layers": 2},
        },
        "data": {"source": "graphs", "prompt": "<graph>", "num_train": 64, "num_eval": 8},
    }


def load_hf_fp32(path):
    """The tiny model at `path` as plain Hugging Face fp32 in eval mode: what the fused paths must match."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def cpu_runner_with_fused_ops(path, **switches):
    """A CPU ModelRunner over `path` with the fused ops requested (as on the GPU), for install checks;
    `switches` set `fused_linear` / `fused_layers`."""
    from transformers import AutoConfig

    from runner.config import EngineConfig
    from runner.worker.model_runner import ModelRunner

    hf_config = AutoConfig.from_pretrained(path)
    config = EngineConfig(str(path), dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                          max_model_len=128, num_kv_blocks=16, fused_ops=True, **switches).resolve(hf_config)
    return ModelRunner(config, hf_config)


def fused_cpu_llm(path, *, layers: int = 2):
    """A bf16 CPU LLM over the tiny model at `path` with merged projections and every decoder layer fused
    (the kernel tests' engine: their switches are read at fuse time and at each step)."""
    from runner.layers import fused_layers, fused_linear
    from runner.llm import LLM

    llm = LLM(path, dtype="bfloat16", device="cpu", num_kv_blocks=32, max_num_seqs=4)
    fused_linear.fuse_linears(llm.runner.model)
    assert fused_layers.fuse_decoder_layers(llm.runner.model) == layers
    return llm


def gpu_tokens_and_logprobs(path, prompts, params, check=None) -> list[tuple[list[int], list]]:
    """Each request's sampled tokens and their logprobs from a fresh bf16 GPU engine over `path` (the
    bitwise A/B tests of kernel switches); `check(llm)` runs on the engine before it generates. Asserts
    decode steps replayed CUDA graphs, and shuts the engine down."""
    from runner.llm import LLM

    llm = LLM(path, dtype="bfloat16", device="cuda", kv_cache_memory=64 << 20)
    if check is not None:
        check(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.runner.num_graph_replays > 0
    llm.shutdown()
    return [(o.outputs[0].token_ids, [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def greedy_token_ids(llm, prompts, params) -> list[list[int]]:
    """The output token ids of `llm` for token-id `prompts`, in order."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` and holds a few bytes of pixels: PIL's lazy open reads
    its size; decoding it would allocate the full image and then fail."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\x00" * 16))
            + _chunk(b"IEND", b""))
