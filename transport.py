"""Transport between a trainer and its rollout workers: an authenticated stdlib HTTP server, a
retrying client, and the payload codec (tensors <-> safetensors bytes with a SHA-256, never pickled).
Every request carries the shared secret NANORL_TOKEN as `Authorization: Bearer <token>`, checked in
constant time. A loopback bind without one generates it (`Server.token`) for the workers the trainer
spawns (a token-less server would let any local user push batches); any other bind refuses to start."""
import contextlib
import functools
import hashlib
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
import sys
import time
import threading
from collections import Counter, namedtuple
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qsl, urlsplit

import torch

import utils

log = logging.getLogger("nanorl.transport")

DEFAULT_MAX_BODY = 1 << 30  # 1 GiB: a full-model weight push fits, a 2 GB lie does not
# Whatever clients do, the server holds at most MAX_CONNS connections (and threads), gives each HEADER_S
# to send its headers, then BODY_S plus a second per BODY_RATE bytes that arrived to finish (not announced:
# a trickle claiming 1 GiB would hold a connection for 17 minutes), and holds at most max_body bytes of
# bodies at once, counted as they arrive: stalled uploads cannot reserve what they announce. A reply, whose
# size is ours, has BODY_S plus a second per BODY_RATE bytes of it to be read.
MAX_CONNS, HEADER_S, BODY_S, BODY_RATE = 64, 10.0, 30.0, 1 << 20


class ServeError(RuntimeError):
    """The peer could not be reached or did not answer in time (the caller decides to retry or exit)."""


# ---------------------------------------------------------------- HTTP: an authenticated server and a client
def _check_token(token: str) -> str:
    if not re.fullmatch(r"[\x21-\x7e]{16,}", token):  # 16 random characters: far beyond guessing over HTTP
        raise utils.ConfigError(f"NANORL_TOKEN must be at least 16 printable ASCII characters without spaces "
                                f"(got {len(token)}); make one with "
                                "python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return token


def serving_token(host: str, token: str | None = None, workers: int | None = None) -> str:
    """The token a server on `host` checks: `token`, else NANORL_TOKEN, else (loopback only) a fresh one,
    which only a trainer's own `workers` get (None: a server that is no trainer's)."""
    token = token or os.environ.get("NANORL_TOKEN")
    loopback = host == "localhost"
    with contextlib.suppress(ValueError):  # a host name other than localhost: treat as exposed
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    if not token and not loopback:
        raise utils.ConfigError(f"refusing to serve on {host!r} without a token: set NANORL_TOKEN to a "
                                "shared secret on the trainer and every worker, or bind 127.0.0.1")
    if not token and workers == 0:  # a trainer no worker could ever join: it would wait for batches forever
        raise utils.ConfigError("--role trainer without NANORL_TOKEN takes only its own --workers, and there "
                                "are none: set NANORL_TOKEN for workers to join, or pass --workers N")
    return _check_token(token or secrets.token_urlsafe(32))


# str, {name: value} of the query, bytes; crowded: over half of MAX_CONNS connections are open, so a route
# that would wait (a long poll) answers at once instead, leaving the cap room for every other request
Request = namedtuple("Request", "path query body crowded", defaults=[False])


class _Handler(BaseHTTPRequestHandler):
    timeout = 10  # per socket operation; the server's deadlines bound a whole request

    def log_message(self, fmt, *args):
        log.debug("%s " + fmt, self.client_address[0], *args)

    def _reply(self, status: int, body: bytes | dict | list | None):
        is_json = isinstance(body, (dict, list))
        body = json.dumps(body).encode() if is_json else body or b""
        if status >= 400:
            self.server.count(f"http_{status}")
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if is_json else "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        # The socket timeout bounds a whole sendall (Python >= 3.5): at 10 s, a 20 MB adapter was cut for any
        # reader under 2 MB/s, every time, and http.server logs a timeout at DEBUG only.
        self.server.admit(self.request, time.monotonic() + (seconds := BODY_S + len(body) / BODY_RATE))
        self.connection.settimeout(seconds)
        try:
            self.wfile.write(body)
        except OSError:  # the reader hung up, or was too slow for its deadline (a worker's link, say)
            self.server.count("replies_cut")
            raise

    def send_error(self, code, message=None, explain=None):
        # Every error, http.server's own (bad request line, 501, 431) included, is JSON. The body
        # (if any) was not read, so this connection cannot carry another request.
        self.close_connection = True
        self._reply(code, {"error": message or self.responses.get(code, ("error",))[0]})

    def _dispatch(self):
        srv, url, lengths = self.server, urlsplit(self.path), self.headers.get_all("Content-Length") or []
        length = lengths[0].strip() if lengths else "0"
        # Hashing both sides gives equal-length inputs (no length leak) and turns any header
        # text, non-ASCII included, into bytes that compare_digest accepts.
        sha = lambda text: hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        if not secrets.compare_digest(sha(self.headers.get("Authorization", "")), sha(f"Bearer {srv.token}")):
            return self.send_error(401, "missing or wrong token: send 'Authorization: Bearer $NANORL_TOKEN'")
        if all(path != url.path for _, path in srv.routes):
            return self.send_error(404, f"no route {url.path!r}")
        if (route := srv.routes.get((self.command, url.path))) is None:
            return self.send_error(405, f"{self.command} not allowed on {url.path}")
        if len(set(lengths)) > 1:
            return self.send_error(400, f"conflicting Content-Length headers: {lengths}")
        if not lengths and self.command == "POST":
            return self.send_error(411, "POST needs a Content-Length header (chunked bodies are not taken)")
        if not re.fullmatch(r"[0-9]{1,19}", length):
            return self.send_error(400, f"malformed Content-Length {length[:40]!r}; expected an integer >= 0")
        if (n := int(length)) > srv.max_body:
            return self.send_error(413, f"body of {n} bytes exceeds the server limit of {srv.max_body} bytes")
        # Evicted after its headers came (as the oldest not yet admitted): its client hears nothing and may
        # send it again (a /batch's copy, a /hello), so it must not run.
        if not srv.admit(self.request, base := time.monotonic() + BODY_S):
            self.close_connection = True
            return
        body = bytearray()  # filled as the bytes arrive, each chunk held against the server's budget first
        try:
            while len(body) < n and (chunk := self.rfile.read1(min(n - len(body), 1 << 20))):
                if not srv.hold(len(chunk)):
                    return self.send_error(503, f"the server holds {srv.max_body} bytes of uploads; "
                                                "retry shortly")
                body += chunk
                srv.admit(self.request, base + len(body) / BODY_RATE)
            if len(body) < n:
                return self.send_error(400, f"body truncated: got {len(body)} of {n} bytes")
            query = dict(parse_qsl(url.query, keep_blank_values=True))
            self._route(route, Request(url.path, query, body, crowded=len(srv.conns) > MAX_CONNS // 2))
        finally:
            srv.hold(-len(body))

    def _route(self, route, req: Request):
        try:
            status, out = route(req)
        except PayloadError as e:
            return self.send_error(400, f"bad payload: {e}")
        except Exception as e:  # a route bug must not take the server down; log it and answer 500
            log.exception("route %s %s failed", self.command, req.path)
            return self.send_error(500, f"internal error in {req.path}: {type(e).__name__}: {e}")
        self._reply(status, out)

    do_GET = do_POST = _dispatch


class Server(socketserver.ThreadingTCPServer):
    """Authenticated HTTP server in a background thread; a context manager. routes: {("GET" or "POST",
    path): fn}, fn(Request) -> (status, body: bytes, JSON dict/list or None). token: None reads NANORL_TOKEN.
    Not http.server's HTTPServer: its server_bind calls socket.getfqdn(), which can stall on bad DNS."""
    daemon_threads = True  # a stuck worker connection must not keep the trainer process alive
    allow_reuse_address = True  # as HTTPServer: a restarted trainer binds its port again at once
    request_queue_size = 128  # the listen backlog: a flood is accepted (and evicted) instead of stalling SYNs

    def __init__(self, routes: dict, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 max_body: int = DEFAULT_MAX_BODY):
        self.token = serving_token(host, token)  # checked before a socket is opened
        self.routes, self.max_body = dict(routes), max_body
        self.lock, self.conns, self.held, self.counts = threading.Lock(), {}, 0, Counter()
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET  # read by the socket's maker
        super().__init__((host, port), _Handler)
        host, port = self.server_address[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        # poll_interval 0.1 s: close() returns within that instead of serve_forever's 0.5 s default
        self._thread = threading.Thread(target=self.serve_forever, args=(0.1,), daemon=True)
        self._thread.start()

    def count(self, what: str):
        with self.lock:
            self.counts[what] += 1

    def process_request(self, request, client_address):
        """At MAX_CONNS, a new connection evicts the oldest one still sending its headers (a real
        client sends them at once); when all are past their headers it is closed."""
        with self.lock:
            if len(self.conns) >= MAX_CONNS:
                if not (waiting := [c for c, (_, admitted) in self.conns.items() if not admitted]):
                    self.counts["connections_refused"] += 1
                    return self.shutdown_request(request)
                self._drop(waiting[0], "connections_evicted")  # dicts keep order: the oldest
            self.conns[request] = (time.monotonic() + HEADER_S, False)
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        super().process_request_thread(request, client_address)  # catches what the handler raises
        with self.lock:
            self.conns.pop(request, None)

    def admit(self, request, deadline: float) -> bool:
        """An authenticated request has until `deadline` (monotonic) to send its body and read the reply;
        False if its connection was already dropped (evicted, or past its deadline)."""
        with self.lock:
            if request in self.conns:
                self.conns[request] = (deadline, True)
            return request in self.conns

    def hold(self, n: int) -> bool:
        """Accounts n more (or, negative, fewer) bytes of request bodies; False past max_body in all."""
        with self.lock:
            if n > 0 and self.held + n > self.max_body:
                self.counts["bodies_refused"] += 1
                return False
            self.held += n
            return True

    def service_actions(self):  # serve_forever calls it every poll interval (0.1 s)
        with self.lock:
            for c in [c for c, (deadline, _) in self.conns.items() if time.monotonic() > deadline]:
                self._drop(c, "connections_timed_out")

    def _drop(self, conn, why: str):  # under self.lock; its thread sees EOF or an error and ends
        self.counts[why] += 1
        del self.conns[conn]
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request, client_address):  # e.g. the peer hung up, or was dropped, mid-request
        self.count("connections_failed")  # one line: a flood of aborted connections must not flood the log
        e = sys.exc_info()[1]
        log.log(logging.DEBUG if isinstance(e, OSError) else logging.WARNING, "connection from %s failed: %r",
                client_address[0], e)

    def close(self, *exc):
        self.shutdown()
        self.server_close()
        self._thread.join()

    __exit__ = close


def split_url(url: str) -> tuple[str, int | None]:
    """(host, port or None) of an http://HOST[:PORT] url."""
    with contextlib.suppress(ValueError):  # urlsplit's: an unclosed [IPv6, a port past 65535
        if (u := urlsplit(url)).scheme == "http" and u.hostname:
            return u.hostname, u.port
    raise utils.ConfigError(f"--trainer-url must look like http://HOST:PORT, got {url!r}")


class Client:
    """Tiny HTTP client: one connection per request, bounded retries with linear backoff. Connection
    failures are retried for every request; failures after the request was sent are retried only
    for GET, because a POST /batch may have landed and must not be sent twice."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30.0, retries: int = 3,
                 backoff: float = 1.0, max_reply: int = DEFAULT_MAX_BODY):
        host, port = split_url(url)
        if not (token := token or os.environ.get("NANORL_TOKEN")):
            raise utils.ConfigError("no token: set NANORL_TOKEN to the trainer's (a trainer started without "
                                    "one takes only its own --workers: restart it with NANORL_TOKEN set)")
        self.url, self.host, self.port = url.rstrip("/"), host, port or 80
        self.token, self.timeout, self.retries, self.backoff = _check_token(token), timeout, retries, backoff
        self.answered = 0.0  # time.time() of the server's last answer, whatever its status
        # replies are read into memory whole: a peer announcing more is no nanorl server (a worker raises
        # it by the size of its model's trained weights, which a full-weight run's adapter carries)
        self.max_reply = max_reply

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytearray]:
        for attempt in range(1, self.retries + 1):
            conn, sent = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout), False
            try:
                conn.connect()
                sent = True
                # the server may refuse the body early (413, 401): its answer is still readable
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    conn.request(method, path, body=body, headers={"Authorization": f"Bearer {self.token}"})
                resp = conn.getresponse()
                self.answered = time.time()
                return resp.status, self._body(resp, f"{method} {self.url}{path}")
            except (OSError, http.client.HTTPException) as e:
                if attempt == self.retries or (sent and method != "GET"):
                    stage = "during" if sent else "connecting for"
                    cut = isinstance(e, http.client.IncompleteRead)  # its deadline passed, or it stopped
                    why = (f"the reply was cut: a trainer gives one {BODY_S:.0f} s plus 1 s per "
                           f"{BODY_RATE / 2**20:g} MiB to arrive, or it stopped" if cut
                           else f"is the trainer running at {self.url}?")
                    raise ServeError(f"{method} {self.url}{path} failed {stage} the request after {attempt} "
                                     f"tries: {type(e).__name__}: {e}; {why}") from e
                log.warning("%s %s: %s; retry %d/%d", method, path, e, attempt, self.retries - 1)
                time.sleep(self.backoff * attempt)
            finally:
                conn.close()

    def _body(self, resp: http.client.HTTPResponse, what: str) -> bytearray:
        """The reply's body. Past max_reply bytes it is no nanorl trainer's, and the error is not retried: a
        worker that allocated what such a peer announced said "out of memory; lower --micro-batch"."""
        if (size := resp.length) is None:  # no Content-Length: read to the end (a proxy's error page, say)
            out = bytearray()  # in chunks: read(max_reply + 1) would allocate all of that at once
            while len(out) <= self.max_reply and (chunk := resp.read1(1 << 20)):
                out += chunk
            size = len(out)
        if size > self.max_reply:
            raise utils.ConfigError(f"{what}: a reply of {size:,}{'' if resp.length else '+'} bytes is over "
                                    f"this client's cap of {self.max_reply:,}; {self.url} does not look like "
                                    "a nanorl trainer: check --trainer-url")
        if resp.length is None:
            return out
        out = bytearray(size)  # read in place: decode views these bytes, no copy
        if (got := resp.readinto(out)) < size:  # short only if the peer hung up
            raise http.client.IncompleteRead(memoryview(out)[:got], size - got)  # no copy
        return out

    get = functools.partialmethod(request, "GET")  # get(path)
    post = functools.partialmethod(request, "POST")  # post(path, body)


# ---------------------------------------------------------------- payloads: tensors <-> bytes, never pickled
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}  # safetensors name -> torch dtype; anything else on the wire is refused
NAMES = {t: n for n, t in DTYPES.items()}
MAX_HEADER, MAX_NDIM = 16 << 20, 8  # a LoRA state dict header is tens of KB; these bound the header we parse
FORMAT = "nanorl/1"


class PayloadError(ValueError):
    """A payload is malformed, tampered with, or uses something this format does not allow."""


def _digest(entries: dict, data) -> str:
    h = hashlib.sha256(json.dumps(entries, sort_keys=True).encode())
    h.update(data)
    return h.hexdigest()


def encode(tensors: dict[str, torch.Tensor], meta: dict) -> bytearray:
    """Tensors + a JSON-able `meta` dict as a safetensors blob (PEFT and vLLM read it as
    adapter_model.safetensors), written by hand: one copy of the tensor bytes, one hash over them."""
    if not isinstance(meta, dict):
        raise PayloadError(f"meta must be a JSON-able dict, got {type(meta).__name__}")
    entries, flat, offset = {}, {}, 0
    for k, t in sorted(tensors.items()):
        if not (isinstance(k, str) and isinstance(t, torch.Tensor) and t.dtype in NAMES):
            raise PayloadError(f"encode needs dict[str, Tensor] with dtypes {sorted(map(str, NAMES))}; "
                               f"got {k!r} -> {getattr(t, 'dtype', type(t).__name__)}")
        # contiguous(): a strided 1-D view (a column, an expand) has no byte view; reshape(-1): nor has 0-dim
        flat[k] = t.detach().contiguous().reshape(-1).view(torch.uint8)
        end = offset + len(flat[k])
        entries[k] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    # The digest goes in the header, before the data it covers: a placeholder of its length first,
    # so the tensors are copied once, straight into place (and off the GPU), then hashed there.
    head = json.dumps({"sha256": "0" * 64, "format": FORMAT, "meta": meta})
    header = json.dumps({"__metadata__": {"nanorl": head}, **entries}).encode()
    header += b" " * (-len(header) % 8)  # safetensors pads the header so the data starts 8-byte aligned
    out, start = bytearray(8 + len(header) + offset), 8 + len(header)
    out[:start] = len(header).to_bytes(8, "little") + header
    body = torch.frombuffer(out, dtype=torch.uint8)[start:]
    for k, b in flat.items():
        body[slice(*entries[k]["data_offsets"])] = b
    at = 8 + header.index(b"0" * 64)  # the first run of 64 zeros: the placeholder opens the header
    out[at : at + 64] = _digest(entries, memoryview(out)[start:]).encode()
    return out


def _check_header(data: bytearray) -> tuple[dict, dict, int]:
    """Checks the safetensors header ourselves: the tensors' bytes lie back to back in header order (as encode
    writes them) and cover the body exactly. Returns (nanorl header, {name: entry}, data start)."""
    if len(data) < 8:
        raise PayloadError(f"payload is {len(data)} bytes; a safetensors blob has at least 8")
    if (n := int.from_bytes(data[:8], "little")) > min(MAX_HEADER, len(data) - 8):
        raise PayloadError(f"header length {n} exceeds the payload ({len(data) - 8} bytes) or {MAX_HEADER}")
    try:  # ours is a JSON string in the safetensors header's __metadata__
        header = json.loads(data[8:8 + n].decode("utf-8"))
        head = json.loads(header["__metadata__"]["nanorl"])
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise PayloadError(f"safetensors or nanorl header is not valid JSON: {e}") from None
    except (KeyError, TypeError):  # not a dict, or no str at that place
        raise PayloadError("not a nanorl payload: safetensors metadata has no 'nanorl' header") from None
    if not (isinstance(head, dict) and head.get("format") == FORMAT and isinstance(head.get("sha256"), str)
            and isinstance(head.get("meta"), dict)):
        raise PayloadError(f"nanorl header must be an object with format={FORMAT!r}, sha256 and meta")
    entries, end = {name: info for name, info in header.items() if name != "__metadata__"}, 0
    for name, info in entries.items():
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise PayloadError(f"tensor {name!r}: dtype {dtype!r} not allowed; allowed: {sorted(DTYPES)}")
        shape, offs = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
                and all(type(d) is int and d >= 0 for d in shape)):
            raise PayloadError(f"tensor {name!r}: shape {shape!r} is not a list of <= {MAX_NDIM} sizes")
        if not (isinstance(offs, list) and all(type(o) is int for o in offs)
                and offs == [end, end + math.prod(shape) * DTYPES[dtype].itemsize]):
            raise PayloadError(f"tensor {name!r}: shape {shape} {dtype} does not match data_offsets "
                               f"{offs!r}; tensors must be back to back, this one from byte {end}")
        end = offs[1]
    if end != len(data) - 8 - n:
        raise PayloadError(f"the tensors cover {end} bytes but the body holds {len(data) - 8 - n}")
    return head, entries, 8 + n


def decode(data: bytes | bytearray, own: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """Inverse of `encode`: tensors viewing `data` (no copy). Raises only PayloadError, whatever the bytes.
    own: a payload this process encoded itself, whose hash need not be checked again."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"decode needs bytes, got {type(data).__name__}")
    data = data if isinstance(data, bytearray) else bytearray(data)  # writable: tensors view it in place
    head, entries, start = _check_header(data)
    if not own and _digest(entries, memoryview(data)[start:]) != head["sha256"]:  # integrity: == is fine
        raise PayloadError("sha256 mismatch: tensor bytes were corrupted or tampered with in transit")
    flat, tensors = torch.frombuffer(data, dtype=torch.uint8), {}
    for name, e in entries.items():  # _check_header vouched for every offset
        dtype, (a, b) = DTYPES[e["dtype"]], e["data_offsets"]
        x = flat[start + a:start + b]
        if dtype == torch.bool and x.numel() and x.max() > 1:  # undefined behaviour in torch
            raise PayloadError(f"bool tensor {name!r} holds bytes other than 0 and 1")
        x = x.clone() if (start + a) % dtype.itemsize else x  # a view must be aligned to its element size
        tensors[name] = x.view(dtype).reshape(e["shape"])
    return tensors, head["meta"]
