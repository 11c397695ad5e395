"""CPU-tensor prompt uploads: the engine's ring (`HostUploader.upload_rows`) by memcpy thread count, beside
the two ways around its host memcpy (page-locking the caller's memory in place, the driver's pageable copy).

Why: W1's 64 prompts of 512 x 1024 bf16 rows (67 MB) arrive as pageable CPU tensors; before the first step
can launch they are copied into pinned memory by `COPY_THREADS` threads, uploaded and checked for NaN/Inf.
On an H200 host that took ~9 ms of the ~17 ms before W1's first step (`w1_diagnose.py startprof`).

    python benchmarks/upload_threads.py [--threads 1,2,4,8,12] [--repeats 7] [--no-alternatives]

Prints the median time of one `upload_rows` call (host copy, device copy, check, flags read) per fill
schedule (`PIPELINED_FILL`), ring chunk size and thread count, and the bandwidth it implies; then, for
the same 64 tensors, the time of the host memcpy alone (threads, no device copy), of `cudaHostRegister`
+ device copies + `cudaHostUnregister` (in place, no memcpy), and of plain `copy_` from pageable memory
(the driver stages it). Register and unregister are timed apart: they are paid on every call, as user
tensors are new every call.
"""

from __future__ import annotations

import argparse
import ctypes
import pathlib
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from runner.worker import host_upload  # noqa: E402

PAGE = 4096


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def _page_ranges(srcs: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The page-rounded address ranges of `srcs`, merged where they touch (a page is registered once)."""
    spans = sorted((s.data_ptr() // PAGE * PAGE,
                    -(-(s.data_ptr() + s.numel() * s.element_size()) // PAGE) * PAGE) for s in srcs)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _last_error_reset() -> None:
    """Clear the CUDA runtime's last error after a failed register (torch checks it after launches)."""
    for line in open("/proc/self/maps"):
        if "libcudart" in line:
            ctypes.CDLL(line.split()[-1]).cudaGetLastError()
            return


def alternatives(srcs: list[torch.Tensor], repeats: int) -> None:
    total = sum(s.numel() * s.element_size() for s in srcs)
    dst = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    pinned_np = pinned.numpy()
    pieces = [s.reshape(-1).view(torch.uint8).numpy() for s in srcs]
    offsets = [0]
    for p in pieces:
        offsets.append(offsets[-1] + p.size)

    for threads in (4, 8):
        pool = ThreadPoolExecutor(threads)

        def memcpy(pool=pool):
            def one(i):
                pinned_np[offsets[i]:offsets[i + 1]] = pieces[i]
            list(pool.map(one, range(len(pieces))))

        ms = _median_ms(memcpy, repeats)
        print(f"memcpy only, {threads} threads: {ms:6.2f} ms ({total / ms / 1e6:5.1f} GB/s)", flush=True)
        pool.shutdown()

    ms = _median_ms(lambda: dst.copy_(pinned, non_blocking=True), repeats)
    print(f"pinned -> device, one copy: {ms:6.2f} ms ({total / ms / 1e6:5.1f} GB/s)", flush=True)

    def pageable():
        for i, s in enumerate(srcs):
            dst[offsets[i]:offsets[i + 1]].copy_(s.reshape(-1).view(torch.uint8))

    ms = _median_ms(pageable, repeats)
    print(f"pageable copy_ per tensor: {ms:6.2f} ms ({total / ms / 1e6:5.1f} GB/s)", flush=True)

    cudart = torch.cuda.cudart()
    ranges = _page_ranges(srcs)
    reg, copy, unreg = [], [], []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        errors = [int(cudart.cudaHostRegister(lo, hi - lo, 0)) for lo, hi in ranges]
        t1 = time.perf_counter()
        if any(errors):
            _last_error_reset()
            print(f"cudaHostRegister failed on {sum(1 for e in errors if e)} of {len(ranges)} ranges: "
                  f"{sorted(set(errors))}")
            for (lo, _), e in zip(ranges, errors):
                if not e:
                    cudart.cudaHostUnregister(lo)
            return
        for i, s in enumerate(srcs):
            dst[offsets[i]:offsets[i + 1]].copy_(s.reshape(-1).view(torch.uint8), non_blocking=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        for lo, _ in ranges:
            cudart.cudaHostUnregister(lo)
        t3 = time.perf_counter()
        reg.append(t1 - t0)
        copy.append(t2 - t1)
        unreg.append(t3 - t2)
    r, c, u = (statistics.median(x[1:]) * 1e3 for x in (reg, copy, unreg))
    print(f"register in place ({len(ranges)} ranges): register {r:6.2f} ms, copies {c:6.2f} ms, "
          f"unregister {u:6.2f} ms, total {r + c + u:6.2f} ms", flush=True)
    ok = torch.equal(dst.cpu(), torch.cat([s.reshape(-1).view(torch.uint8) for s in srcs]))
    print(f"register in place: bytes match {ok}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2,4,8,12")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-alternatives", action="store_true", help="the ring's thread counts only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    srcs = [torch.randn(512, 1024).to(torch.bfloat16) for _ in range(64)]
    total = sum(s.numel() * s.element_size() for s in srcs)
    default = host_upload.COPY_THREADS
    print(f"{len(srcs)} prompts, {total / 2**20:.0f} MiB; COPY_THREADS default here {default}")
    pipelined = host_upload.PIPELINED_FILL
    for fill in (False, True):
        host_upload.PIPELINED_FILL = fill
        for chunk_mib in (16, 8):
            for n in [int(t) for t in args.threads.split(",")]:
                host_upload.COPY_THREADS = n
                uploader = host_upload.HostUploader(torch.device("cuda"))
                uploader.chunk_bytes = chunk_mib << 20
                uploader.upload_rows(srcs, torch.bfloat16)  # pins the ring
                ms = _median_ms(lambda u=uploader: u.read_flag_tensor(u.upload_rows(srcs, torch.bfloat16)[2]),
                                args.repeats)
                kind = "pipelined" if fill else "per chunk"
                print(f"{kind} fill, chunks of {chunk_mib:2d} MiB, threads {n:2d}: {ms:6.2f} ms  "
                      f"({total / ms / 1e6:5.1f} GB/s)", flush=True)
    host_upload.COPY_THREADS, host_upload.PIPELINED_FILL = default, pipelined
    if not args.no_alternatives:
        alternatives(srcs, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
