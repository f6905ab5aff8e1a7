"""A stand-in for the Hugging Face hub: the routes a pull uses, served from memory by a local HTTP server.

GET /api/models/{id}[/revision/{rev}] (model_info, with sizes and hashes as `blobs=true` gives them) and
HEAD/GET /{id}/resolve/{rev}/{file}, with Range requests answered 206 as the hub's CDN does. Tests point
HF_ENDPOINT at it; it records every request and can cut a file's body short once, to test resuming.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SHA = "0123456789abcdef0123456789abcdef01234567"


def safetensors_bytes(n_values: int) -> bytes:
    """A valid one-tensor bf16 safetensors file of `n_values` values."""
    header = json.dumps({"w": {"dtype": "BF16", "shape": [n_values], "data_offsets": [0, 2 * n_values]}}).encode()
    header += b" " * (-len(header) % 8)
    body = bytes((i * 7 + 3) % 251 for i in range(2 * n_values))
    return struct.pack("<Q", len(header)) + header + body


def tiny_model(architecture: str = "LlamaForCausalLM", weight_values: int = 1_500_000) -> dict[str, bytes]:
    """config.json, tokenizer files and a ~3 MB safetensors file: what a pull fetches."""
    config = {"architectures": [architecture], "model_type": "llama", "hidden_size": 64, "num_attention_heads": 1,
              "num_key_value_heads": 1, "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 16,
              "max_position_embeddings": 512, "torch_dtype": "bfloat16"}
    tokenizer = {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []}}
    return {
        "config.json": json.dumps(config).encode(),
        "tokenizer.json": json.dumps(tokenizer).encode(),
        "tokenizer_config.json": b'{"eos_token": "b"}',
        "model.safetensors": safetensors_bytes(weight_values),
        "README.md": b"# not fetched: not a pattern a pull takes\n",
    }


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]]
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, Range header)
    cut_after: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before the connection drops, once
    ignore_range: bool = False
    corrupt: set[str] = field(default_factory=set)  # files served with a flipped byte

    def __post_init__(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return None

            def do_HEAD(self) -> None:
                hub._serve(self, body=False)

            def do_GET(self) -> None:
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def file_gets(self, name: str) -> list[str]:
        """The Range header of each GET of `name` ('' for a whole-file GET)."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + name)]

    # ------------------------------------------------------------------ routes

    def _serve(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append((h.command, path, h.headers.get("Range", "")))
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
        if api:
            return self._model_info(h, api.group(1))
        res = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if res and res.group(1) in self.repos and res.group(3) in self.repos[res.group(1)]:
            return self._file(h, res.group(1), res.group(3), body)
        self._send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})

    def _model_info(self, h: BaseHTTPRequestHandler, repo: str) -> None:
        if repo not in self.repos:
            return self._send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"})
        siblings = []
        for name, data in self.repos[repo].items():
            entry: dict[str, object] = {"rfilename": name, "size": len(data)}
            if name.endswith(".safetensors"):
                entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                entry["blobId"] = hashlib.sha1(b"lfs pointer").hexdigest()
            else:
                entry["blobId"] = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
            siblings.append(entry)
        info = {"id": repo, "modelId": repo, "sha": SHA, "private": False, "siblings": siblings}
        self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"})

    def _file(self, h: BaseHTTPRequestHandler, repo: str, name: str, body: bool) -> None:
        data = self.repos[repo][name]
        if name in self.corrupt:
            data = bytes([data[0] ^ 1]) + data[1:]
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": SHA, "Accept-Ranges": "bytes"}
        start = 0
        m = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))
        if m and not self.ignore_range:
            start = int(m.group(1))
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        part = data[start:]
        status = 206 if start else 200
        cut = self.cut_after.pop(name, None) if body else None
        if cut is None:
            return self._send(h, status, part if body else b"", headers, length=len(part))
        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(part))}.items():
            h.send_header(k, v)
        h.end_headers()
        h.wfile.write(part[:cut])
        h.wfile.flush()
        h.close_connection = True  # the rest never comes: the client sees a body cut short

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, headers: dict[str, str],
              length: int | None = None) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data) if length is None else length))
        h.end_headers()
        if data:
            h.wfile.write(data)
