"""What one prompt's embeddings cost on the wire: encode (torch.save + base64 + JSON body, what
RemoteBackend does in its thread pool) and send (POST over loopback to a server that reads the
whole body and answers a few bytes), for a (rows, hidden) tensor.

    python benchmarks/remote_payload.py [--rows 576] [--hidden 4096] [--dtype bfloat16] [--repeat 10]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import torch

from bridge.backends.completions import completion_body, encode_body
from bridge.wire import encode_prompt_embeds
from runner.sampling_params import SamplingParams


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=576)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    tensor = torch.randn(args.rows, args.hidden).to(getattr(torch, args.dtype))
    params = SamplingParams(max_tokens=16, temperature=0.0)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"
    encode_ms, send_ms = [], []
    with httpx.Client() as client:
        for _ in range(args.repeat + 1):
            t0 = time.perf_counter()
            body = encode_body(completion_body(encode_prompt_embeds(tensor), params, model="m"))
            t1 = time.perf_counter()
            client.post(url, content=body, headers={"Content-Type": "application/json"}).raise_for_status()
            t2 = time.perf_counter()
            encode_ms.append((t1 - t0) * 1e3)
            send_ms.append((t2 - t1) * 1e3)
    server.shutdown()
    raw = tensor.numel() * tensor.element_size()
    size = f"tensor {raw / 2**20:.2f} MiB, body {len(body) / 2**20:.2f} MiB"
    print(f"{args.rows} x {args.hidden} {args.dtype}: {size}; "
          f"encode median {statistics.median(encode_ms[1:]):.1f} ms, loopback send median "
          f"{statistics.median(send_ms[1:]):.1f} ms ({args.repeat} runs, first dropped)")


if __name__ == "__main__":
    main()
