"""The norm-GEMM kernels (`runner.layers.norm_gemm`) against the three-launch sequences they replace, in CUDA
graphs, on W1's shapes.

Each fused kernel does the work of three of the fused decoder layer's launches (`runner.layers.fused_layers`):

    qkv:     rms_norm -> F.linear(q/k/v) -> qkv_norm_rope_write   vs  norm_qkv_rope_write
    gate_up: rms_norm -> F.linear(gate/up) -> silu_mul            vs  norm_gate_up_silu

One command, GPU (under a minute on an H200; `--sweep` about two: ~0.7 s per tile, kernel builds included):

    python benchmarks/norm_gemm.py [--rows 1,16,32,64,128] [--sweep] [--json results.json]

W1's model is Qwen3-0.6B-shaped: hidden 1024, 16 q heads and 8 KV heads of 128 (q/k norms, no bias),
intermediate 3072, bf16. Each case captures 28 calls on 28 different weights (as a decode step meets
them, so no weight stays in L2) in one CUDA graph and reports the median replay over 28: microseconds
per call for the unfused sequence (as the engine runs it, and each of its three launches alone) and for
the fused kernel, the speedup, and the max abs difference between the two outputs on one layer (q, the
K and V cache contents; the activation), with the share of elements that agree bitwise. `--sweep` times
a grid of tiles per (kernel, M) and prints the best (tiles that fail to build or launch, e.g. out of
shared memory, are skipped); without it the defaults of `runner.layers.norm_gemm` are timed.

Check mode, CPU or GPU (small shapes, no CUDA graphs; without a GPU the kernels run under
TRITON_INTERPRET=1): the same comparison and a two-tile mini sweep, exit status 1 on a mismatch.

    python benchmarks/norm_gemm.py --check
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import pathlib
import sys
import time

if "--check" in sys.argv and not os.path.exists("/dev/nvidia0"):  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from skinny_gemm import graph_time  # noqa: E402

from runner.layers.fused_layers import qkv_norm_rope_write  # noqa: E402
from runner.layers.fused_linear import silu_mul_triton  # noqa: E402
from runner.layers.fused_ops import rms_norm  # noqa: E402
from runner.layers.norm_gemm import (  # noqa: E402
    GATE_UP_CONFIGS,
    QKV_CONFIGS,
    NormGemmConfig,
    default_config,
    norm_gate_up_silu,
    norm_qkv_rope_write,
    qkv_counters,
)

LAYERS = 28
BLOCK_SIZE = 16  # KV cache page
W1 = dict(hidden=1024, n_q=16, n_kv=8, head_dim=128, inter=3072, eps=1e-6)
SMALL = dict(hidden=96, n_q=4, n_kv=2, head_dim=32, inter=80, eps=1e-6)  # --check

# Tiles `--sweep` tries per (kernel, M); `--grid wide` a larger set (several minutes). block_m above the
# batch (rounded up to a power of two, at least 16) is skipped, so is swap_ab with a column tile under 64
# (then the MMA is no taller than without it; the q/k/v kernel's column tile is a half head, 64 on W1).
SWEEP_GRIDS = {
    "small": {
        "qkv": dict(block_m=(16, 32, 64), block_k=(128, 256), num_warps=(4, 8), num_stages=(3,),
                    swap_ab=(False, True), splits=(1, 2, 4)),
        "gate_up": dict(block_m=(16, 32, 64), block_n=(32, 64), block_k=(128, 256), num_warps=(4, 8),
                        num_stages=(3,), swap_ab=(False, True)),
    },
    "wide": {
        "qkv": dict(block_m=(16, 32, 64), block_k=(64, 128, 256), num_warps=(4, 8), num_stages=(3, 4),
                    swap_ab=(False, True), splits=(1, 2, 4, 8)),
        "gate_up": dict(block_m=(16, 32, 64), block_n=(16, 32, 64, 128), block_k=(128, 256), num_warps=(4, 8),
                        num_stages=(3, 4), swap_ab=(False, True)),
    },
}


# ------------------------------------------------------------------------------------------------ cases

@dataclasses.dataclass
class Case:
    kernel: str  # "qkv" or "gate_up"
    m: int
    shape: dict
    x: torch.Tensor
    layers: list[dict]  # per layer: weights (and KV caches for qkv)
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    slots: torch.Tensor | None = None


def make_case(kernel: str, m: int, shape: dict, layers: int, dev, dtype, *, pad: bool, seed: int = 0) -> Case:
    """Random inputs of W1's scale. `pad`: some rows are padding (slot -1), as in a padded decode graph."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(device=dev, dtype=dtype)

    def pos_weight(n):  # norm weights around 1
        return (torch.rand(n, generator=g) + 0.5).to(device=dev, dtype=dtype)

    k, d = shape["hidden"], shape["head_dim"]
    x = rnd(m, k, scale=2.0)
    if kernel == "gate_up":
        ws = [dict(nw=pos_weight(k), w=rnd(2 * shape["inter"], k, scale=2 * k**-0.5)) for _ in range(layers)]
        return Case(kernel, m, shape, x, ws)
    n = (shape["n_q"] + 2 * shape["n_kv"]) * d
    num_blocks = triton.cdiv(m, BLOCK_SIZE) + 1
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=g)[:m]
    if pad:
        slots[1::4] = -1
    angles = torch.rand(m, d // 2, generator=g) * 100.0
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(device=dev, dtype=dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(device=dev, dtype=dtype)
    ws = []
    for _ in range(layers):
        kc = torch.zeros(num_blocks, BLOCK_SIZE, shape["n_kv"], d, device=dev, dtype=dtype)
        ws.append(dict(nw=pos_weight(k), w=rnd(n, k, scale=k**-0.5), qn=pos_weight(d), kn=pos_weight(d),
                       kc=kc, vc=torch.zeros_like(kc)))
    return Case(kernel, m, shape, x, ws, cos, sin, slots.to(dev))


def unfused(case: Case, layer: dict, stage: int = 3):
    """The engine's three launches on one layer; `stage` < 3 runs only that launch (0 norm, 1 GEMM,
    2 epilogue) on precomputed inputs (timing breakdown; see `stage_inputs`)."""
    s, eps = case.shape, case.shape["eps"]
    if case.kernel == "gate_up":
        if stage == 3:
            return silu_mul_triton(F.linear(rms_norm(case.x, layer["nw"], eps), layer["w"]))
        return (lambda: rms_norm(case.x, layer["nw"], eps), lambda: F.linear(layer["h"], layer["w"]),
                lambda: silu_mul_triton(layer["y"]))[stage]()

    def epilogue(qkv):
        return qkv_norm_rope_write(qkv, s["n_q"], s["n_kv"], case.cos, case.sin, layer["kc"], layer["vc"],
                                   case.slots, (layer["qn"], layer["kn"], eps))

    if stage == 3:
        return epilogue(F.linear(rms_norm(case.x, layer["nw"], eps), layer["w"]))
    return (lambda: rms_norm(case.x, layer["nw"], eps), lambda: F.linear(layer["h"], layer["w"]),
            lambda: epilogue(layer["y"]))[stage]()


def stage_inputs(case: Case) -> None:
    """The norm output `h` and GEMM output `y` of every layer, for timing the three launches alone."""
    for layer in case.layers:
        layer["h"] = rms_norm(case.x, layer["nw"], case.shape["eps"])
        layer["y"] = F.linear(layer["h"], layer["w"])


def fused(case: Case, layer: dict, config: NormGemmConfig | None):
    s, eps = case.shape, case.shape["eps"]
    if case.kernel == "gate_up":
        return norm_gate_up_silu(case.x, layer["nw"], eps, layer["w"], config=config)
    split = config is not None and config.splits > 1  # the split-K form needs its arrival counters
    counters = layer.setdefault("counters", qkv_counters(s["n_q"] + 2 * s["n_kv"], case.m, case.x.device))
    return norm_qkv_rope_write(case.x, layer["nw"], eps, layer["w"], None, s["n_q"], s["n_kv"], case.cos,
                               case.sin, layer["kc"], layer["vc"], case.slots,
                               (layer["qn"], layer["kn"], eps), config=config,
                               counters=counters if split else None)


def compare(case: Case, config: NormGemmConfig | None) -> dict:
    """Max abs difference (and bitwise-equal share) between the unfused and fused outputs of layer 0,
    each path on its own zeroed KV caches."""
    layer = case.layers[0]
    out = {}
    pairs = []
    if case.kernel == "qkv":
        ref = {**layer, "kc": torch.zeros_like(layer["kc"]), "vc": torch.zeros_like(layer["vc"])}
        got = {**layer, "kc": torch.zeros_like(layer["kc"]), "vc": torch.zeros_like(layer["vc"])}
        pairs.append(("q", unfused(case, ref), fused(case, got, config)))
        pairs += [("k_cache", ref["kc"], got["kc"]), ("v_cache", ref["vc"], got["vc"])]
    else:
        pairs.append(("act", unfused(case, layer), fused(case, layer, config)))
    for name, a, b in pairs:
        a, b = a.float(), b.float()
        out[name] = dict(max_abs=(a - b).abs().max().item(), scale=a.abs().max().item(),
                         exact=(a == b).float().mean().item())
    return out


def within_tolerance(diff: dict, dtype) -> bool:
    """A few rounding steps of the values' scale: the two paths sum in different orders."""
    step = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    return all(d["max_abs"] <= 8 * step * max(d["scale"], 1.0) for d in diff.values())


def fmt_diff(diff: dict) -> str:
    return " ".join(f"{k} {v['max_abs']:.2g} ({v['exact'] * 100:.0f}% eq)" for k, v in diff.items())


# ----------------------------------------------------------------------------------------------- timing

def per_call(case: Case, fn) -> float:
    """Seconds per call of `fn(case, layer)` over the case's layers, in one graph."""
    def body():
        for layer in case.layers:
            fn(case, layer)
    return graph_time(body) / len(case.layers)


def sweep_configs(kernel: str, m: int, grid_name: str = "small"):
    grid = SWEEP_GRIDS[grid_name][kernel]
    for values in itertools.product(*grid.values()):
        cfg = NormGemmConfig(**dict(zip(grid, values)))
        if cfg.block_m > max(16, triton.next_power_of_2(m)):
            continue
        if kernel == "gate_up" and cfg.swap_ab and cfg.block_n < 64:
            continue
        yield cfg


def try_config(case: Case, cfg: NormGemmConfig | None, dtype, timed: bool):
    """(seconds per call or None, diff) for one tile; None, None when it does not build or launch."""
    try:
        diff = compare(case, cfg)
        if not within_tolerance(diff, dtype):
            print(f"  {case.kernel} M={case.m} {cfg}: {fmt_diff(diff)}: WRONG")
            return None, diff
        t = per_call(case, lambda c, layer: fused(c, layer, cfg)) if timed else 0.0
        return t, diff
    except Exception as exc:  # out of shared memory / registers, a tile the compiler rejects
        print(f"  {case.kernel} M={case.m} {cfg}: skipped ({type(exc).__name__}: {str(exc)[:80]})")
        if case.x.is_cuda:
            torch.cuda.synchronize()
        return None, None


def cfg_str(cfg: NormGemmConfig, kernel: str) -> str:
    n = f" N{cfg.block_n}" if kernel == "gate_up" else ""
    swap = " swap" if cfg.swap_ab else ""
    splits = f" split{cfg.splits}" if cfg.splits > 1 else ""
    return f"M{cfg.block_m}{n} K{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}{swap}{splits}"


# ------------------------------------------------------------------------------------------------- main

def run_check(dtype) -> tuple[list, int]:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"check on {dev} ({'interpreter' if os.environ.get('TRITON_INTERPRET') == '1' else 'compiled'}), "
          f"{dtype}, shapes {SMALL}")
    failures = 0
    results = []
    for kernel, m in itertools.product(("qkv", "gate_up"), (1, 5, 17)):
        case = make_case(kernel, m, SMALL, 2, dev, dtype, pad=True, seed=m)
        configs = [None, NormGemmConfig(block_m=16, block_n=16, block_k=32),
                   NormGemmConfig(block_m=16, block_n=64, block_k=32, swap_ab=True)]
        if kernel == "qkv":  # K = 96 over steps of 32: splits of 64 and 32 columns
            configs.append(NormGemmConfig(block_m=16, block_k=32, splits=2))
        for cfg in configs:
            t, diff = try_config(case, cfg, dtype, timed=False)
            ok = t is not None
            failures += not ok
            name = "default" if cfg is None else cfg_str(cfg, kernel)
            print(f"  {kernel:>7} M={m:>2} {name:>22}: {'ok' if ok else 'FAILED'} {fmt_diff(diff or {})}")
            results.append(dict(kernel=kernel, m=m, config=name, ok=ok, diff=diff))
    print("check:", "all match" if not failures else f"{failures} FAILED")
    return results, failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,32,64,128", help="decode batch sizes (M)")
    ap.add_argument("--kernels", default="qkv,gate_up")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tiles per (kernel, M)")
    ap.add_argument("--grid", default="small", choices=sorted(SWEEP_GRIDS), help="the sweep's tiles")
    ap.add_argument("--check", action="store_true", help="correctness only, small shapes, no CUDA graphs")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    dtype = torch.bfloat16
    if args.check:
        results, failures = run_check(dtype)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(dict(check=results), indent=1))
        return 1 if failures else 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --check)")
        return 2
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name()}; {LAYERS} calls per graph on {LAYERS} weights; W1 {W1}")
    rows = [int(r) for r in args.rows.split(",")]
    kernels = args.kernels.split(",")
    results: dict = dict(device=torch.cuda.get_device_name(), shape=W1, cases=[])
    print(f"{'kernel':>7} {'M':>4} | {'unfused':>7} = {'norm':>5} + {'gemm':>5} + {'epi':>5} | "
          f"{'fused':>6} | {'speedup':>7} | tile | max abs diff (bitwise-equal share)")
    failures = 0
    saved_per_step = {m: 0.0 for m in rows}
    start = time.perf_counter()
    for m in rows:
        for kernel in kernels:
            case = make_case(kernel, m, W1, LAYERS, dev, dtype, pad=False, seed=m)
            t_unfused = per_call(case, unfused)
            stage_inputs(case)
            t_stages = [per_call(case, lambda c, layer, i=i: unfused(c, layer, i)) for i in range(3)]
            default = default_config(QKV_CONFIGS if kernel == "qkv" else GATE_UP_CONFIGS, m)
            candidates = [default]
            if args.sweep:
                candidates += [c for c in sweep_configs(kernel, m, args.grid) if c != default]
            timed = []
            diff0 = None
            for cfg in candidates:
                t, diff = try_config(case, cfg, dtype, timed=True)
                if cfg is default:
                    diff0 = diff
                if t is not None:
                    timed.append((t, cfg))
            if not timed:
                print(f"{kernel:>7} {m:>4} | {t_unfused * 1e6:7.2f} | (no tile ran)")
                failures += 1
                continue
            t_default = next((t for t, c in timed if c is default), None)
            t_best, best = min(timed, key=lambda tc: tc[0])
            stages = " + ".join(f"{t * 1e6:5.2f}" for t in t_stages)
            shown = t_default if t_default is not None else t_best
            print(f"{kernel:>7} {m:>4} | {t_unfused * 1e6:7.2f} = {stages} | {shown * 1e6:6.2f} | "
                  f"{t_unfused / shown:6.2f}x | {cfg_str(default, kernel)} | {fmt_diff(diff0 or {})}")
            if args.sweep:
                top = sorted(timed, key=lambda tc: tc[0])[:3]
                print(f"{'':>12} best of {len(timed)} tiles: " + ", ".join(
                    f"{cfg_str(c, kernel)} {t * 1e6:.2f} us" for t, c in top)
                    + f"  [{time.perf_counter() - start:.0f} s]")
            saved_per_step[m] += (t_unfused - shown) * LAYERS
            results["cases"].append(dict(
                kernel=kernel, m=m, unfused_s=t_unfused, stages_s=t_stages, default_s=t_default,
                default=dataclasses.asdict(default), best_s=t_best, best=dataclasses.asdict(best),
                diff=diff0, tiles=[dict(s=t, **dataclasses.asdict(c)) for t, c in timed]))
            del case
            torch.cuda.empty_cache()
    print("\nper decode step (28 layers, both kernels with the default tile): " + ", ".join(
        f"M={m}: {saved_per_step[m] * 1e6:.0f} us saved" for m in rows))
    results["saved_per_step_s"] = saved_per_step
    out = args.json or (os.path.join(os.environ["OUT"], "norm_gemm.json") if os.environ.get("OUT") else None)
    if out:
        pathlib.Path(out).write_text(json.dumps(results, indent=1))
        print(f"wrote {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
