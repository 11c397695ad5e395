"""Where a W1 decode layer's time goes when it runs as the engine runs it (GPU).

Why: the engine's decode attention on W1's bucket measured ~50 us a layer in a profiled generate, while
`decode_attention.py` timed the same kernel and configuration at ~44 us on one layer's cache replayed 28
times. And the residual projections at 64 rows run as cuBLAS split-K GEMMs with two helper kernels each
(`splitKreduce`, `memcpy32_post`). This separates the candidates, each as a CUDA-graph replay of 28
launches (a decode step's worth):

- attention: one layer's cache replayed 28 times (the benchmark's way) against 28 layers of one
  allocation shaped as the engine's (`(layers, 2, blocks, block, kv heads, head dim)`, the engine's pool
  size, so each layer's K and V lie gigabytes apart) and against a pool just big enough;
- the residual GEMMs at 64 rows: `addmm` out of place and `addmm_` in place (the engine's two calls)
  against `mm` without the residual (beta 0), with cuBLAS and with cuBLASLt, and the kernels each
  launches (torch.profiler).

    python benchmarks/w1_layer_costs.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from decode_attention import BLOCK, HEAD_DIM, KV_HEADS, POOL_BLOCKS, Q_HEADS, decode_metadata  # noqa: E402
from skinny_gemm import graph_time  # noqa: E402

import runner.layers.paged_attention_triton as pat  # noqa: E402
from runner.layers.attention_metadata import AttentionMetadata  # noqa: E402

LAYERS = 28
HIDDEN, Q_SIZE, INTER = 1024, 2048, 3072


def attention_rows(copy_bw: float) -> list[dict]:
    specs = [random.Random(1).randint(560, 600) for _ in range(64)]
    need = sum(-(-s // BLOCK) for s in specs)
    kv_bytes = sum(specs) * 2 * KV_HEADS * HEAD_DIM * 2
    q = torch.randn(len(specs), Q_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    scale = HEAD_DIM**-0.5
    rows = []

    def run(label: str, caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> None:
        def body():
            for kc, vc in caches:
                pat.paged_attention_triton(q, kc, vc, meta, scale, out)

        us = graph_time(body, replays=20) / len(caches) * 1e6
        pct = 100 * kv_bytes / (us * 1e-6) / copy_bw
        rows.append({"case": "attention", "variant": label, "us": round(us, 2), "pct_of_copy": round(pct, 1)})
        print(f"  attention {label:58s} {us:7.2f} us/layer  {pct:5.1f}% of copy", flush=True)

    meta = decode_metadata(specs, first_block=1000)
    one = torch.zeros((2, POOL_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
    run("one layer's cache (pool-sized), 28 times", [(one[0], one[1])] * LAYERS, meta)
    del one
    for blocks in (need + 2000, POOL_BLOCKS):
        shape = (LAYERS, 2, blocks, BLOCK, KV_HEADS, HEAD_DIM)
        store = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        caches = [(store[i, 0], store[i, 1]) for i in range(LAYERS)]
        run(f"28 layers, engine layout, {blocks} blocks, 1 layer x28", [caches[0]] * LAYERS, meta)
        run(f"28 layers, engine layout, {blocks} blocks, each layer once", caches, meta)
        del store, caches
        torch.cuda.empty_cache()
    return rows


def prefill_rows() -> list[dict]:
    """A W1 prefill step's attention (32 fresh prompts of 512 rows): the paged prefill kernel against
    FlashAttention's varlen kernel on the step's own contiguous k and v (`torch.nn.attention.varlen`)."""
    from torch.nn.attention.varlen import varlen_attn

    reqs, length = 32, 512
    t = reqs * length
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, Q_HEADS, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g, device="cuda", dtype=torch.bfloat16)
    blocks = t // BLOCK
    kc = torch.zeros((blocks + 64, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    kc[:blocks] = k.view(blocks, BLOCK, KV_HEADS, HEAD_DIM)
    vc[:blocks] = v.view(blocks, BLOCK, KV_HEADS, HEAD_DIM)
    per = length // BLOCK
    table = torch.arange(blocks, dtype=torch.int32, device="cuda").view(reqs, per)
    qsl = [i * length for i in range(reqs + 1)]
    meta = AttentionMetadata(
        torch.arange(t, device="cuda"), torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        torch.full((reqs,), length, dtype=torch.int32, device="cuda"), table, max_query_len=length,
        max_seq_len=length, num_reqs=reqs, is_decode_only=False, query_start_loc_cpu=qsl,
        seq_lens_cpu=[length] * reqs,
    )  # fmt: skip
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    cu = torch.tensor(qsl, dtype=torch.int32, device="cuda")
    flops = 4 * reqs * (length * (length + 1) / 2) * HEAD_DIM * Q_HEADS
    forms = {
        "paged prefill kernel": lambda: pat.paged_attention_triton(q, kc, vc, meta, scale, out),
        "varlen_attn (flash), GQA k/v": lambda: varlen_attn(q, k, v, cu, cu, length, length, scale=scale,
                                                            window_size=(-1, 0)),
        "varlen_attn (flash), k/v repeated": lambda: varlen_attn(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), cu, cu, length, length, scale=scale,
            window_size=(-1, 0)),
    }
    rows, ref = [], None
    from triton.testing import do_bench

    for label, fn in forms.items():
        try:
            got = fn()
            torch.cuda.synchronize()
            us = do_bench(fn, rep=200) * 1e3
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"  prefill {label:40s} failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            continue
        if ref is None:
            ref = got.float().clone()
        err = (got.float() - ref).abs().max().item()
        rows.append({"case": "prefill attention", "variant": label, "us": round(us, 2),
                     "tflops": round(flops / (us * 1e-6) / 1e12, 1), "max_diff": err})  # fmt: skip
        print(f"  prefill {label:40s} {us:8.2f} us  {flops / (us * 1e-6) / 1e12:6.1f} TFLOP/s  "
              f"max diff {err:.4f}", flush=True)
    return rows


class SyntheticLayers:
    """W1's 28 decoder layers as the engine runs a decode step of up to 64 rows, on random weights: fused
    norm + q/k/v + rotary + cache write, paged decode attention, o_proj `addmm`, norm, gate/up, SiLU*mul,
    down `addmm_` (cuBLAS, no per-layer arrival counters, so two chains can run at once)."""

    def __init__(self, specs: list[int]) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        bf16 = torch.bfloat16

        def w(*shape):
            return torch.randn(*shape, generator=g, device="cuda", dtype=bf16) * 0.02

        qkv_n = (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.layers = [dict(qkv=w(qkv_n, HIDDEN), o=w(HIDDEN, Q_SIZE), gu=w(2 * INTER, HIDDEN),
                            d=w(HIDDEN, INTER), n1=1 + w(HIDDEN), n2=1 + w(HIDDEN),
                            qn=1 + w(HEAD_DIM), kn=1 + w(HEAD_DIM))
                       for _ in range(LAYERS)]  # fmt: skip
        need = sum(-(-s // BLOCK) for s in specs)
        shape = (LAYERS, 2, need + 64, BLOCK, KV_HEADS, HEAD_DIM)
        self.store = torch.randn(shape, generator=g, device="cuda", dtype=bf16)
        self.specs = specs

    def part(self, lo: int, hi: int) -> dict:
        """Inputs of the rows [lo, hi): their own hidden states, rotary rows, metadata and outputs."""
        first = sum(-(-s // BLOCK) for s in self.specs[:lo])
        rows = hi - lo
        return dict(x=torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16),
                    cos=torch.ones(rows, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                    sin=torch.zeros(rows, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                    slots=torch.full((rows,), -1, dtype=torch.int64, device="cuda"),
                    meta=decode_metadata(self.specs[lo:hi], first),
                    out=torch.empty(rows, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                    )  # fmt: skip

    def forward(self, part: dict) -> None:
        from runner.layers.fused_linear import silu_mul
        from runner.layers.fused_ops import rms_norm
        from runner.layers.norm_gemm import norm_qkv_rope_write

        x, eps = part["x"], 1e-6
        for i, lw in enumerate(self.layers):
            kc, vc = self.store[i, 0], self.store[i, 1]
            q = norm_qkv_rope_write(x, lw["n1"], eps, lw["qkv"], None, Q_HEADS, KV_HEADS, part["cos"],
                                    part["sin"], kc, vc, part["slots"], (lw["qn"], lw["kn"], eps))
            o = pat.paged_attention_triton(q, kc, vc, part["meta"], HEAD_DIM**-0.5, part["out"])
            x = torch.addmm(x, o.view(x.shape[0], -1), lw["o"].t())
            a = silu_mul(torch.mm(rms_norm(x, lw["n2"], eps), lw["gu"].t()))
            x.addmm_(a, lw["d"].t())


def two_stream_rows() -> list[dict]:
    """A W1 decode step's 28 layers: 64 rows on one stream against two halves of 32 rows on two streams
    of one graph (each half's attention can overlap the other half's weight-latency-bound GEMMs)."""
    specs = [random.Random(1).randint(560, 600) for _ in range(64)]
    model = SyntheticLayers(specs)
    whole, lo, hi = model.part(0, 64), model.part(0, 32), model.part(32, 64)
    quarters = [model.part(16 * i, 16 * (i + 1)) for i in range(4)]
    side = [torch.cuda.Stream() for _ in range(3)]

    def split(parts):
        def body():
            main = torch.cuda.current_stream()
            for s in side[: len(parts) - 1]:
                s.wait_stream(main)
            for s, p in zip([main, *side], parts):
                with torch.cuda.stream(s):
                    model.forward(p)
            for s in side[: len(parts) - 1]:
                main.wait_stream(s)
        return body

    cases = {
        "64 rows, one stream": lambda: model.forward(whole),
        "32 rows, one stream (one half alone)": lambda: model.forward(lo),
        "2 x 32 rows, one stream after the other": lambda: (model.forward(lo), model.forward(hi)),
        "2 x 32 rows, two streams": split([lo, hi]),
        "4 x 16 rows, four streams": split(quarters),
    }
    rows = []
    for label, body in cases.items():
        ms = graph_time(body, replays=20) * 1e3
        rows.append({"case": "decode step layers", "variant": label, "us": round(ms * 1e3, 1)})
        print(f"  decode step, 28 layers: {label:42s} {ms:7.3f} ms", flush=True)
    return rows


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name[:60] for e in prof.events() if e.device_type.name == "CUDA"]


def gemm_case(proj: str, n: int, k: int, copy_bw: float, g: torch.Generator) -> list[dict]:
    m, rows = 64, []
    bf16 = torch.bfloat16
    weights = [torch.randn(n, k, generator=g, device="cuda", dtype=bf16) * 0.02 for _ in range(LAYERS)]
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, n, generator=g, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    forms = {
        "addmm out of place": lambda w: torch.addmm(res, x, w.t()),
        "addmm_ in place": lambda w: res.addmm_(x, w.t()),
        "mm (beta 0)": lambda w: torch.mm(x, w.t()),
        "mm out=": lambda w: torch.mm(x, w.t(), out=dst),
    }
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for label, form in forms.items():
            def body(form=form):
                for w in weights:
                    form(w)

            us = graph_time(body, replays=20) / LAYERS * 1e6
            pct = 100 * n * k * 2 / (us * 1e-6) / copy_bw
            names = kernel_names(lambda form=form: form(weights[0]))
            rows.append({"case": proj, "variant": f"{lib} {label}", "us": round(us, 2),
                         "pct_of_copy": round(pct, 1), "kernels": names})  # fmt: skip
            print(f"  {proj:8s} {lib:8s} {label:20s} {us:6.2f} us/call {pct:5.1f}% of copy  "
                  f"{len(names)} kernels: {', '.join(names)}", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def gemm_rows(copy_bw: float) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for proj, n, k in (("o_proj", HIDDEN, Q_SIZE), ("down", HIDDEN, INTER), ("gate_up", 2 * INTER, HIDDEN)):
        rows += gemm_case(proj, n, k, copy_bw, g)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--two-streams-only", action="store_true")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    from attention import measure_copy_bandwidth

    copy_bw = measure_copy_bandwidth()
    print(f"copy rate {copy_bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}", flush=True)
    rows = two_stream_rows()
    if args.two_streams_only:
        return 0
    rows += prefill_rows() + gemm_rows(copy_bw)
    if not args.skip_attention:
        rows += attention_rows(copy_bw)
    summary = {}
    for r in rows:
        summary.setdefault(r["case"], []).append(r["us"])
    print({k: round(statistics.median(v), 2) for k, v in summary.items()})
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"copy_TBps": copy_bw / 1e12, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
