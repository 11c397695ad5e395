"""CPU-tensor prompt uploads (`runner.worker.host_upload.HostUploader.upload_rows`) by memcpy thread count.

Why: W1's 64 prompts of 512 x 1024 bf16 rows (67 MB) arrive as pageable CPU tensors; before the first step
can launch they are copied into pinned memory by `COPY_THREADS` threads, uploaded and checked for NaN/Inf.
On an H200 host that took ~9 ms of the ~17 ms before W1's first step (`w1_diagnose.py startprof`).

    python benchmarks/upload_threads.py [--threads 1,2,4,8,12] [--repeats 7]

Prints the median time of one `upload_rows` call (host copy, device copy, check, flags read) per thread
count, and the bandwidth it implies.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from runner.worker import host_upload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2,4,8,12")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 1
    srcs = [torch.randn(512, 1024).to(torch.bfloat16) for _ in range(64)]
    total = sum(s.numel() * s.element_size() for s in srcs)
    default = host_upload.COPY_THREADS
    print(f"{len(srcs)} prompts, {total / 2**20:.0f} MiB; COPY_THREADS default here {default}")
    for n in [int(t) for t in args.threads.split(",")]:
        host_upload.COPY_THREADS = n
        uploader = host_upload.HostUploader(torch.device("cuda"))
        times = []
        for _ in range(args.repeats + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _, _, ok = uploader.upload_rows(srcs, torch.bfloat16)
            assert all(uploader.read_flag_tensor(ok))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times[1:])  # the first call pins the ring
        print(f"threads {n:2d}: {med * 1e3:6.2f} ms  ({total / med / 1e9:5.1f} GB/s)", flush=True)
    host_upload.COPY_THREADS = default
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
