#!/usr/bin/env python3
"""A plain Hugging Face transformers baseline server for scripts/compare_servers.py (bench only).

    .venv-ref/bin/python scripts/_hf_server.py --model HF_FOLDER --tokenizer tokenizer.json --port 8003

A minimal OpenAI-compatible `/v1/completions` (JSON or streaming SSE with a final usage chunk),
`/v1/models` and `/health`, on the standard library's threaded HTTP server. One worker thread runs
`model.generate` (fp32, greedy) in *static* batches: it takes up to `--max-batch` requests that
are waiting when the previous batch ends, left-pads them, and generates the batch's largest
`max_tokens` for every row; each request streams its own tokens as they are produced (a streamer
sees every step) and ends when it has its own count (or its eos, unless `ignore_eos`). Requests
arriving meanwhile wait for the whole batch: that is what static batching costs.

It needs torch, transformers and tokenizers (the `bench` extra, or .venv-ref); jserve never
imports it. Sampling parameters other than greedy are ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_DONE = object()


def log(msg: str) -> None:
    print(f"[hf-server] {msg}", file=sys.stderr, flush=True)


class Pending:
    """One request in the worker's queue; the worker puts token ids (then _DONE or an exception) on `out`."""

    def __init__(self, ids: list[int], max_tokens: int, ignore_eos: bool):
        self.ids, self.max_tokens, self.ignore_eos = ids, max_tokens, ignore_eos
        self.out: queue.Queue = queue.Queue()
        self.count = 0
        self.done = False


class Worker:
    """Static batches of up to `max_batch` waiting requests through `model.generate`."""

    def __init__(self, model_dir: str, tokenizer_path: str, max_batch: int, threads: int):
        import tokenizers
        import torch
        from transformers import LlamaForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.tokenizer = tokenizers.Tokenizer.from_file(tokenizer_path)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # each request decides about eos itself
        self.eos = self.model.config.eos_token_id
        self.pad = self.eos if isinstance(self.eos, int) else 0
        self.max_batch = max_batch
        self.waiting: queue.Queue[Pending] = queue.Queue()
        self.num_batches = 0
        log(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {model_dir}")
        threading.Thread(target=self._run, name="hf-generate", daemon=True).start()

    def submit(self, p: Pending) -> None:
        self.waiting.put(p)

    def _run(self) -> None:
        while True:
            batch = [self.waiting.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self.waiting.get_nowait())
                except queue.Empty:
                    break
            try:
                self._generate(batch)
            except Exception as e:  # noqa: BLE001 - reported to every request of the batch
                log(f"generate failed: {e!r}")
                for p in batch:
                    if not p.done:
                        p.out.put(e)

    def _generate(self, batch: list[Pending]) -> None:
        torch = self.torch
        from transformers import GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        width = max(len(p.ids) for p in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p.ids):] = torch.tensor(p.ids, dtype=torch.long)
            mask[i, width - len(p.ids):] = 1

        class Streamer(BaseStreamer):
            first = True

            def put(self, value):
                if self.first:  # the prompt ids
                    self.first = False
                    return
                for p, tok in zip(batch, value.reshape(-1).tolist()):
                    if p.done:
                        continue
                    p.count += 1
                    p.out.put(tok)
                    if p.count >= p.max_tokens or (not p.ignore_eos and tok == worker_eos):
                        p.done = True
                        p.out.put(_DONE)

            def end(self):
                for p in batch:
                    if not p.done:
                        p.done = True
                        p.out.put(_DONE)

        worker_eos = self.eos
        gc = GenerationConfig(max_new_tokens=max(p.max_tokens for p in batch), min_new_tokens=0, do_sample=False,
                              eos_token_id=None, pad_token_id=self.pad)
        self.num_batches += 1
        with torch.inference_mode():
            self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gc, streamer=Streamer())


def make_handler(worker: Worker, model_name: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the connection closes after each response: no framing needed

        def log_message(self, fmt, *args):  # quiet
            pass

        def _json(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": model_name, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": f"no route {self.path}", "code": 404}})

        def do_POST(self):
            if self.path != "/v1/completions":
                return self._json(404, {"error": {"message": f"no route {self.path}", "code": 404}})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                prompt = body["prompt"]
                ids = list(prompt) if isinstance(prompt, list) else worker.tokenizer.encode(prompt).ids
                max_tokens = int(body.get("max_tokens") or 16)
                if not ids or max_tokens < 1:
                    raise ValueError("empty prompt or max_tokens < 1")
            except (ValueError, KeyError, TypeError) as e:
                return self._json(400, {"error": {"message": f"bad request: {e}", "code": 400}})
            p = Pending(ids, max_tokens, bool(body.get("ignore_eos", False)))
            worker.submit(p)
            rid, created = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time())
            out_ids: list[int] = []
            sent = ""
            stream = bool(body.get("stream"))
            if stream:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()

            def event(obj: dict) -> None:
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

            try:
                while True:
                    item = p.out.get()
                    if item is _DONE:
                        break
                    if isinstance(item, Exception):
                        raise item
                    out_ids.append(item)
                    if stream:
                        text = worker.tokenizer.decode(out_ids, skip_special_tokens=False)
                        if text.endswith("\ufffd"):
                            continue  # an incomplete UTF-8 sequence: wait for the next token
                        delta, sent = text[len(sent):], text
                        event({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                               "choices": [{"index": 0, "text": delta, "finish_reason": None}]})
                finish = "stop" if out_ids and out_ids[-1] == worker.eos and not p.ignore_eos else "length"
                usage = {"prompt_tokens": len(ids), "completion_tokens": len(out_ids),
                         "total_tokens": len(ids) + len(out_ids)}
                text = worker.tokenizer.decode(out_ids, skip_special_tokens=False)
                if not stream:
                    return self._json(200, {"id": rid, "object": "text_completion", "created": created,
                                            "model": model_name, "usage": usage,
                                            "choices": [{"index": 0, "text": text, "finish_reason": finish}]})
                event({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                       "choices": [{"index": 0, "text": text[len(sent):], "finish_reason": finish}]})
                event({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                       "choices": [], "usage": usage})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away; the batch finishes regardless (static batching)
            except Exception as e:  # noqa: BLE001
                if not stream:
                    return self._json(500, {"error": {"message": repr(e), "code": 500}})
                event({"error": {"message": repr(e), "code": 500}})

    return Handler


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF LlamaForCausalLM folder (fp32 safetensors)")
    p.add_argument("--tokenizer", required=True, help="a tokenizers tokenizer.json")
    p.add_argument("--served-model-name", default="hf")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8003)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = p.parse_args(argv)
    worker = Worker(args.model, args.tokenizer, args.max_batch, args.threads)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(worker, args.served_model_name))
    server.daemon_threads = True
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a clean stop: close the socket
    log(f"serving {args.served_model_name} on http://{args.host}:{args.port}")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
