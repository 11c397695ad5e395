"""Hugging Face `generate` baselines for benchmarks/generate.py, each measured at its best.

Every baseline first runs the whole workload once at full size (the same batches, prompt widths and
output lengths as the timed runs) untimed, then times `repeats` more runs and reports the median.
The first call is reported separately: for the eager baseline it is the cold call (cuBLAS and
allocator warm-up), for the compiled one it is the compile.

Two variants:

- dynamic: `generate(inputs_embeds=..., attention_mask=...)` with the default DynamicCache (sdpa).
- static compiled: transformers 5.x's documented fast path. `cache_implementation="static"` makes
  `generate` compile the decode forward itself (`model.get_compiled_call`, torch.compile with the
  given `compile_config`; here `CompileConfig(fullgraph=True, mode="reduce-overhead")`, i.e. CUDA
  graphs); the prefill runs eager and the 4-D attention mask is built outside the compiled graph at
  the static cache's width. The docs warn against also compiling `model.forward` by hand ("avoid
  calling torch.compile(model) outside of generate"): it would be compiled twice. If fullgraph=True
  raises, the run is retried once with HF's default CompileConfig (fullgraph=False) and the error is
  kept. On the CPU the static cache runs eager unless compile is asked for.

Peak memory: `torch.cuda.max_memory_allocated` over the timed runs (reset after the full-size
warm-up), so it includes what stays allocated (weights, CUDA graph pools), minus the weight bytes.
"""

from __future__ import annotations

import statistics
import time

import torch


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def left_pad(chunk: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One left-padded (batch, width, hidden) tensor on `device` and its attention mask."""
    width, hidden = max(e.shape[0] for e in chunk), chunk[0].shape[1]
    x = torch.zeros(len(chunk), width, hidden, dtype=chunk[0].dtype, device=device)
    mask = torch.zeros(len(chunk), width, dtype=torch.long, device=device)
    for i, e in enumerate(chunk):
        x[i, width - e.shape[0]:] = e
        mask[i, width - e.shape[0]:] = 1
    return x, mask


def run_hf_generate(model, embeds: list[torch.Tensor], output_lens: list[int], device: torch.device,
                    batch_size: int, **generate_kwargs) -> dict:
    """HF `generate(inputs_embeds=...)`, left-padded batches; counts only the tokens asked for.

    `embeds` may live on the CPU: each batch is padded onto `device` outside the timed region.
    `generate_kwargs` go to `generate` (e.g. `cache_implementation="static"`, `compile_config`).
    """
    t_total, useful = 0.0, 0
    for start in range(0, len(embeds), batch_size):
        outs = output_lens[start:start + batch_size]
        x, mask = left_pad(embeds[start:start + batch_size], device)
        new = max(outs)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(inputs_embeds=x, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, **generate_kwargs)
        sync(device)
        t_total += time.perf_counter() - t0
        useful += sum(outs)
        del x, mask
    return {"tok_s": useful / t_total, "seconds": t_total, "output_tokens": useful}


def measure_hf(model, embeds: list[torch.Tensor], output_lens: list[int], device: torch.device,
               batch_size: int, repeats: int = 3, weight_bytes: int = 0, **generate_kwargs) -> dict:
    """One untimed full-size run, then the median tok/s of `repeats` timed runs (and peak memory)."""
    first = run_hf_generate(model, embeds, output_lens, device, batch_size, **generate_kwargs)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runs = [run_hf_generate(model, embeds, output_lens, device, batch_size, **generate_kwargs)
            for _ in range(max(1, repeats))]
    tok_s = statistics.median(r["tok_s"] for r in runs)
    res = {"tok_s": tok_s, "seconds": first["output_tokens"] / tok_s, "output_tokens": first["output_tokens"],
           "all_tok_s": [r["tok_s"] for r in runs], "first_seconds": first["seconds"],
           "first_tok_s": first["tok_s"]}
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        res["peak_memory_bytes"] = peak
        res["peak_minus_weights_bytes"] = peak - weight_bytes
    return res


def static_kwargs(compile_decode: bool, fullgraph: bool = True) -> dict:
    """`generate` arguments for the static cache, compiled (CUDA graphs) or eager."""
    if not compile_decode:
        return {"cache_implementation": "static", "disable_compile": True}
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=fullgraph, mode="reduce-overhead")
    config._compile_all_devices = True  # also on the CPU when asked for (HF compiles on CUDA only)
    return {"cache_implementation": "static", "compile_config": config}


def measure_hf_static(model, embeds: list[torch.Tensor], output_lens: list[int], device: torch.device,
                      batch_size: int, repeats: int = 3, weight_bytes: int = 0,
                      compile_decode: bool = True) -> dict:
    """`measure_hf` with the static cache (compiled decode unless `compile_decode` is False).

    Never raises: a failing variant is recorded under "errors" (and "error" when none ran).
    `first_seconds` is the compile when compiled (the first full-size call).
    """
    errors: list[str] = []
    for fullgraph in ((True, False) if compile_decode else (None,)):
        try:
            res = measure_hf(model, embeds, output_lens, device, batch_size, repeats, weight_bytes,
                             **static_kwargs(compile_decode, bool(fullgraph)))
        except Exception as e:  # noqa: BLE001  (any failure is a result to report, not a crash)
            msg = f"{type(e).__name__}: {e}"
            msg = msg if len(msg) < 2000 else msg[:2000] + " ..."
            log(f"  HF static {'compiled, fullgraph=' + str(fullgraph) if compile_decode else 'eager'} "
                f"raised: {msg}")
            errors.append(msg)
            if compile_decode:
                torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        res.update(compiled=compile_decode, fullgraph=fullgraph, errors=errors)
        if compile_decode:
            res["compile_seconds"] = res["first_seconds"]
        return res
    return {"error": errors[-1], "errors": errors, "compiled": compile_decode}


def run_hf_baselines(model, work: dict[str, tuple[list[torch.Tensor], list[int], int]],
                     device: torch.device, repeats: int, weight_bytes: int, static: bool = True,
                     compile_decode: bool = True, dynamic: bool = True) -> dict[str, dict]:
    """`work`: name -> (embeds, output_lens, batch_size). Every dynamic run comes before any compile.

    Returns name -> {"dynamic": ..., "static": ...} (each key only when that baseline was asked for).
    """
    out: dict[str, dict] = {name: {} for name in work}
    for name, (embeds, output_lens, batch) in work.items():
        if not dynamic:
            break
        log(f"HF dynamic cache, {name}: full-size warm-up, then {repeats} timed runs")
        r = measure_hf(model, embeds, output_lens, device, batch, repeats, weight_bytes)
        out[name]["dynamic"] = r
        log(f"  {name}: {r['tok_s']:.0f} tok/s warm (median of {r['all_tok_s']}), "
            f"first call {r['first_seconds']:.2f}s")
    if not static:
        return out
    kind = "compiled (reduce-overhead, CUDA graphs)" if compile_decode else "eager"
    for name, (embeds, output_lens, batch) in work.items():
        log(f"HF static cache {kind}, {name}: full-size first call, then {repeats} timed runs")
        r = measure_hf_static(model, embeds, output_lens, device, batch, repeats, weight_bytes,
                              compile_decode)
        out[name]["static"] = r
        if "error" not in r:
            log(f"  {name}: {r['tok_s']:.0f} tok/s warm, first call {r['first_seconds']:.2f}s")
    return out
