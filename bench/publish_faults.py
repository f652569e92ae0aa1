"""How long a trainer's ``publish_checkpoint`` takes while the event API is healthy, refusing
connections, or accepting them and never answering, measured side by side in one run.

    .venv/bin/python bench/publish_faults.py [--publishes 10] [--event-timeout-s 5]

Each API gets ``--publishes`` publishes of one small checkpoint (the manifest line is fsynced
each time), then ``flush_events`` waits for the events still being posted. Prints p50 and max
per publish, the hung API's p50 over the healthy one's, the time the flush took, and one JSON
line.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from common import emit, median


class Answering(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def healthy_api() -> str:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Answering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/api"


def hung_api() -> str:
    """Accepts every connection and never answers."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in iter(int, 1)], daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/api"


def refusing_api() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}/api"  # closed again: connections are refused


def main() -> None:
    import logging

    from areal_eval.checkpoints.publisher import flush_events, publish_checkpoint

    logging.getLogger("areal_eval.checkpoints.publisher").setLevel(logging.ERROR)  # the expected warnings
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--publishes", type=int, default=10)
    parser.add_argument("--event-timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        checkpoint.mkdir()
        (checkpoint / "model.safetensors").write_bytes(b"w" * 4096)
        (checkpoint / "config.json").write_text("{}")
        for name, api_url in (("healthy", healthy_api()), ("refusing", refusing_api()), ("hung", hung_api())):
            seconds = []
            for step in range(args.publishes):
                start = time.perf_counter()
                publish_checkpoint(
                    checkpoint,
                    Path(tmp) / f"{name}.jsonl",
                    name,
                    step,
                    api_url=api_url,
                    event_timeout_s=args.event_timeout_s,
                )
                seconds.append(time.perf_counter() - start)
            start = time.perf_counter()
            left = flush_events(args.event_timeout_s * args.publishes + 30)
            result[name] = {
                "publish_p50_ms": round(1000 * median(seconds), 2),
                "publish_max_ms": round(1000 * max(seconds), 2),
                "flush_s": round(time.perf_counter() - start, 2),
                "unsent_after_flush": left,
            }
            print(
                f"{name:9s} publish p50 {result[name]['publish_p50_ms']} ms, max {result[name]['publish_max_ms']} ms; "
                f"flush {result[name]['flush_s']} s"
            )
    result["hung_over_healthy_p50"] = round(result["hung"]["publish_p50_ms"] / result["healthy"]["publish_p50_ms"], 2)
    print(f"hung API / healthy API, publish p50: {result['hung_over_healthy_p50']}x")
    emit(result)


if __name__ == "__main__":
    main()
