"""Transport for disaggregated training: a trainer process serves, generation workers call it.

Standard library HTTP only (http.server / http.client). Everything that crosses the wire is a
safetensors blob made by `encode` and read back by `decode`: tensors plus one JSON header (the
caller's meta and a SHA-256 of the tensors) in the safetensors string metadata. Network bytes are
never unpickled; `decode` turns every malformed input into `PayloadError`.

Security model: one shared secret, env NANORL_TOKEN, sent as `Authorization: Bearer <token>` on
every request and checked in constant time. The server always requires it. On a loopback bind
with no token configured it generates one (`Server.token`) for the trainer to hand to the workers
it spawns; a token-less loopback server would let any local user of a shared machine push
batches or read the adapter. A bind to any other address without NANORL_TOKEN refuses to start.
"""
import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qsl, urlsplit

import safetensors.torch
import torch

log = logging.getLogger("nanorl.serve")

DTYPES = {  # safetensors name -> torch dtype; anything else on the wire is refused
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
MAX_HEADER = 16 << 20  # a LoRA state dict header is tens of KB; this bounds the JSON we parse
MAX_NDIM = 8
DEFAULT_MAX_BODY = 1 << 30  # 1 GiB: a full-model weight push fits, a 2 GB lie does not
FORMAT = "nanorl/1"


class PayloadError(ValueError):
    """A payload is malformed, tampered with, or uses something this format does not allow."""


class ServeError(RuntimeError):
    """The peer could not be reached or did not answer in time (the caller decides to retry or exit)."""


# ---------------------------------------------------------------- payloads

def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode() + b"\n")
        # reshape(-1) first: a 0-dim tensor cannot be viewed as bytes; bool views as uint8 as-is
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def encode(tensors: dict[str, torch.Tensor], meta: dict) -> bytes:
    """Serialize tensors + a small JSON-able `meta` dict (kind, version, worker id, ...)."""
    if not isinstance(meta, dict):
        raise PayloadError(f"meta must be a JSON-able dict, got {type(meta).__name__}")
    allowed = set(DTYPES.values())
    for k, t in tensors.items():
        if not isinstance(k, str) or not isinstance(t, torch.Tensor):
            raise PayloadError(f"encode needs dict[str, Tensor]; got {type(k).__name__} -> {type(t).__name__}")
        if t.dtype not in allowed:
            raise PayloadError(f"tensor {k!r} has dtype {t.dtype}; allowed: {sorted(map(str, allowed))}")
    tensors = {k: t.detach().cpu().contiguous() for k, t in tensors.items()}
    header = json.dumps({"format": FORMAT, "sha256": _digest(tensors), "meta": meta})
    return safetensors.torch.save(tensors, metadata={"nanorl": header})


def _check_header(data: bytes) -> dict:
    """Validate the safetensors JSON header ourselves, before the library allocates anything."""
    if len(data) < 8:
        raise PayloadError(f"payload is {len(data)} bytes; a safetensors blob has at least 8")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(MAX_HEADER, len(data) - 8):
        raise PayloadError(f"header length {n} exceeds the payload ({len(data) - 8} bytes) or {MAX_HEADER}")
    try:
        header = json.loads(data[8:8 + n].decode("utf-8"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise PayloadError(f"safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise PayloadError("safetensors header is not a JSON object")
    body = len(data) - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise PayloadError(f"tensor {name!r}: dtype {dtype!r} not allowed; allowed: {sorted(DTYPES)}")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM and all(type(d) is int and d >= 0 for d in shape)):
            raise PayloadError(f"tensor {name!r}: shape {shape!r} is not a list of <= {MAX_NDIM} sizes")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
                and 0 <= offs[0] <= offs[1] <= body
                and offs[1] - offs[0] == math.prod(shape) * DTYPES[dtype].itemsize):
            raise PayloadError(f"tensor {name!r}: shape {shape} {dtype} does not match data_offsets {offs!r} "
                               f"within {body} data bytes")
    return header


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    """Inverse of `encode`. Raises only PayloadError, whatever the bytes are."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"decode needs bytes, got {type(data).__name__}")
    data = bytes(data)
    meta_s = _check_header(data).get("__metadata__", {})
    if not isinstance(meta_s, dict) or not isinstance(meta_s.get("nanorl"), str):
        raise PayloadError("not a nanorl payload: safetensors metadata has no 'nanorl' header")
    try:
        head = json.loads(meta_s["nanorl"])
    except (ValueError, RecursionError) as e:
        raise PayloadError(f"nanorl header is not valid JSON: {e}") from None
    if not (isinstance(head, dict) and head.get("format") == FORMAT and isinstance(head.get("sha256"), str)
            and isinstance(head.get("meta"), dict)):
        raise PayloadError(f"nanorl header must be an object with format={FORMAT!r}, sha256 and meta")
    try:
        tensors = safetensors.torch.load(data)
    except Exception as e:  # hostile input into a native parser: any failure is the payload's fault
        raise PayloadError(f"safetensors rejected the payload: {type(e).__name__}: {e}") from None
    if _digest(tensors) != head["sha256"]:  # integrity, not a secret: no constant-time compare needed
        raise PayloadError("sha256 mismatch: tensor bytes were corrupted or tampered with in transit")
    for k, t in tensors.items():  # a bool byte other than 0/1 is undefined behaviour in torch
        if t.dtype == torch.bool and t.numel() and t.view(torch.uint8).max() > 1:
            raise PayloadError(f"bool tensor {k!r} holds bytes other than 0 and 1")
    return tensors, head["meta"]


# ---------------------------------------------------------------- auth

def _token_ok(got: str | None, token: str) -> bool:
    # Hashing both sides gives equal-length inputs (no length leak) and turns any header
    # text, non-ASCII included, into bytes that compare_digest accepts.
    if got is None:
        return False
    want = hashlib.sha256(f"Bearer {token}".encode()).digest()
    return hmac.compare_digest(hashlib.sha256(got.encode("utf-8", "surrogatepass")).digest(), want)


def _check_token(token: str) -> str:
    if not re.fullmatch(r"[\x21-\x7e]+", token):
        raise ValueError("NANORL_TOKEN must be non-empty printable ASCII without spaces "
                         "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return token


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name other than localhost: treat as exposed
        return False


# ---------------------------------------------------------------- server

@dataclass
class Request:
    path: str
    query: dict[str, str]
    body: bytes
    peer: str


# A route returns (status, body): bytes go out as octet-stream, dict/list as JSON, None as empty.
Route = Callable[[Request], tuple[int, bytes | dict | list | None]]


class _Handler(BaseHTTPRequestHandler):
    timeout = 60  # socket timeout: a client that stalls mid-request cannot hold a thread forever

    def log_message(self, fmt, *args):
        log.debug("%s " + fmt, self.client_address[0], *args)

    def _reply(self, status: int, body: bytes | dict | list | None):
        is_json = isinstance(body, (dict, list))
        body = json.dumps(body).encode() if is_json else body or b""
        self.send_response(status)
        if body:
            self.send_header("Content-Type", "application/json" if is_json else "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_error(self, code, message=None, explain=None):
        # Every error, http.server's own (bad request line, 501, 431) included, is JSON. The body
        # (if any) was not read, so this connection cannot carry another request.
        self.close_connection = True
        self._reply(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def _body_length(self) -> int | None:
        values = self.headers.get_all("Content-Length") or []
        if len(set(values)) > 1:
            return self.send_error(400, f"conflicting Content-Length headers: {values}")
        if not values:
            if self.command == "POST":
                return self.send_error(411, "POST needs a Content-Length header (chunked bodies are not supported)")
            return 0
        if not re.fullmatch(r"[0-9]{1,19}", values[0].strip()):
            return self.send_error(400, f"malformed Content-Length {values[0][:40]!r}; expected a non-negative integer")
        n, limit = int(values[0]), self.server.max_body
        if n > limit:
            return self.send_error(413, f"body of {n} bytes exceeds the server limit of {limit} bytes")
        return n

    def _dispatch(self):
        srv = self.server
        if not _token_ok(self.headers.get("Authorization"), srv.token):
            return self.send_error(401, "missing or wrong token: send 'Authorization: Bearer $NANORL_TOKEN'")
        url = urlsplit(self.path)
        if url.path not in srv.paths:
            return self.send_error(404, f"no route {url.path!r}")
        route = srv.routes.get((self.command, url.path))
        if route is None:
            return self.send_error(405, f"{self.command} not allowed on {url.path}")
        n = self._body_length()
        if n is None:
            return
        body = self.rfile.read(n)
        if len(body) < n:
            return self.send_error(400, f"body truncated: got {len(body)} of {n} bytes")
        req = Request(url.path, dict(parse_qsl(url.query, keep_blank_values=True)), body, self.client_address[0])
        try:
            status, out = route(req)
        except PayloadError as e:
            return self.send_error(400, f"bad payload: {e}")
        except Exception as e:  # a route bug must not take the server down; log it and answer 500
            log.exception("route %s %s failed", self.command, url.path)
            return self.send_error(500, f"internal error in {url.path}: {type(e).__name__}: {e}")
        self._reply(status, out)

    do_GET = do_POST = _dispatch


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True  # a stuck worker connection must not keep the trainer process alive

    def __init__(self, addr, family, token: str, max_body: int, routes: dict):
        self.address_family = family  # read by TCPServer.__init__ when it creates the socket
        self.token, self.max_body, self.routes = token, max_body, routes
        self.paths = {p for _, p in routes}
        super().__init__(addr, _Handler)

    def server_bind(self):
        # Skip HTTPServer.server_bind: its socket.getfqdn() can stall for seconds on a bad DNS setup.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def handle_error(self, request, client_address):  # e.g. the peer hung up mid-response
        log.warning("connection from %s failed", client_address[0], exc_info=True)


class Server:
    """Generic authenticated HTTP server in a background thread.

    routes: {("GET", "/hello"): fn, ("POST", "/batch"): fn, ...}, fn(Request) -> (status, body).
    token: None reads NANORL_TOKEN; if that is unset too, loopback binds generate one (see
    `.token`) and any other bind raises before a socket is opened.
    """

    def __init__(self, routes: dict[tuple[str, str], Route], host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, max_body: int = DEFAULT_MAX_BODY):
        bad = [m for m, _ in routes if m not in ("GET", "POST")]
        if bad:
            raise ValueError(f"routes support GET and POST only; got {bad}")
        token = token or os.environ.get("NANORL_TOKEN") or None
        if token is None and not _is_loopback(host):
            raise ValueError(f"refusing to serve on {host!r} without a token: set NANORL_TOKEN to a shared "
                             "secret on the trainer and every worker, or bind 127.0.0.1")
        self.token = _check_token(token or secrets.token_urlsafe(32))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._httpd = _HTTPServer((host, port), family, self.token, max_body, dict(routes))
        # poll_interval 0.1 s: close() returns within that instead of serve_forever's 0.5 s default
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.1,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def close(self):
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------- client

class Client:
    """Tiny HTTP client: one connection per request, bounded retries with linear backoff.

    Connection failures are retried for every request; failures after the request was sent
    are retried only for GET, because a POST /batch may have landed and must not be sent twice.
    """

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0,
                 retries: int = 3, backoff: float = 1.0):
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"server url must look like http://HOST:PORT, got {url!r}")
        token = token or os.environ.get("NANORL_TOKEN")
        if not token:
            raise ValueError("no token: set NANORL_TOKEN to the trainer's token (Server.token)")
        self.url, self.host, self.port = url.rstrip("/"), u.hostname, u.port or 80
        self.token, self.timeout, self.retries, self.backoff = _check_token(token), timeout, retries, backoff

    def get(self, path: str) -> tuple[int, bytes]:
        return self._request("GET", path, None)

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {self.token}"}
        for attempt in range(1, self.retries + 1):
            conn, sent = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout), False
            try:
                conn.connect()
                sent = True
                try:
                    conn.request(method, path, body=body, headers=headers)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the server refused the body early (413, 401): its answer is still readable
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (OSError, http.client.HTTPException) as e:
                if attempt == self.retries or (sent and method != "GET"):
                    stage = "during" if sent else "connecting for"
                    raise ServeError(f"{method} {self.url}{path} failed {stage} the request after {attempt} "
                                     f"tries: {type(e).__name__}: {e}; is the trainer running at {self.url}?") from e
                log.warning("%s %s: %s; retry %d/%d", method, path, e, attempt, self.retries - 1)
                time.sleep(self.backoff * attempt)
            finally:
                conn.close()
