"""transport.py: payload codec and the authenticated HTTP transport, over real 127.0.0.1 sockets."""
import contextlib
import hashlib
import io
import json
import pickle
import re
import resource
import socket
import struct
import threading
import time
from urllib.parse import urlsplit

import pytest
import torch
from hypothesis import given, settings, strategies as st

import transport
from conftest import free_url
from flood import flood
from rawhttp import bare_peer
from transport import Client, PayloadError, Request, ServeError, Server, decode, encode

TOKEN = "test-token-0123456789abcdef"
MAX_BODY = 1 << 20


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "logp": torch.randn(3, 5, generator=g),                                  # [N, T] float32
        "lora_A": torch.randn(4, 8, generator=g).to(torch.bfloat16),
        "tokens": torch.arange(15, dtype=torch.int64).reshape(3, 5) - 7,         # negatives survive
        "truncated": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),                        # 0-dim
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }


META = {"kind": "batch", "version": 7, "worker": "w-3", "extra": {"ü": [1, 2.5, None]}}
VALID = encode(sample_tensors(), META)


def raw_safetensors(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


# ---------------------------------------------------------------- codec

def test_encode_decode_round_trip_preserves_dtype_shape_values_and_meta():
    src = sample_tensors()
    out, meta = decode(VALID)
    assert meta == META
    assert sorted(out) == sorted(src)
    for k, t in src.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape
        assert torch.equal(out[k], t), k


def test_encode_detaches_and_makes_noncontiguous_tensors_contiguous():
    w = torch.randn(4, 6, requires_grad=True)
    out, _ = decode(encode({"wT": w.t()}, {}))
    assert not out["wT"].requires_grad and torch.equal(out["wT"], w.detach().t())
    # 1-D views with a stride (reshape(-1) keeps those views, which have no byte view): a column of a
    # [N, T] tensor (the last token's reward), every other element, a broadcast (stride 0)
    views = {"col": torch.arange(12.0).reshape(3, 4)[:, -1], "odd": torch.arange(7, dtype=torch.int16)[1::2],
             "same": torch.tensor([2.5]).expand(3)}
    out, _ = decode(encode(views, {}))
    assert {k: v.tolist() for k, v in out.items()} == {"col": [3.0, 7.0, 11.0], "odd": [1, 3, 5],
                                                       "same": [2.5, 2.5, 2.5]}


def test_encode_refuses_dtypes_outside_the_wire_set():
    with pytest.raises(PayloadError, match="complex64"):
        encode({"z": torch.zeros(2, dtype=torch.complex64)}, {})


def test_decode_detects_flipped_tensor_byte_by_sha():
    data = bytearray(VALID)
    data[-1] ^= 0x01  # last byte belongs to the tensor data section, not the header
    with pytest.raises(PayloadError, match="sha256 mismatch"):
        decode(bytes(data))


def test_decode_rejects_truncated_blob():
    with pytest.raises(PayloadError):
        decode(VALID[:-3])
    with pytest.raises(PayloadError, match="at least 8"):
        decode(VALID[:5])


def test_decode_rejects_bad_header_json_and_foreign_safetensors():
    with pytest.raises(PayloadError, match="not valid JSON"):
        decode(struct.pack("<Q", 4) + b"{no}")
    with pytest.raises(PayloadError, match="not valid JSON"):  # RecursionError must not escape
        decode(struct.pack("<Q", 200_000) + b"[" * 200_000)
    import safetensors.torch
    plain = safetensors.torch.save({"x": torch.zeros(2)})  # valid safetensors, not ours
    with pytest.raises(PayloadError, match="no 'nanorl' header"):
        decode(plain)


def test_decode_rejects_unexpected_dtype_and_absurd_shape_before_allocating():
    meta = {"__metadata__": {"nanorl": json.dumps({"format": transport.FORMAT, "sha256": "0" * 64, "meta": {}})}}
    with pytest.raises(PayloadError, match="dtype 'C64' not allowed"):
        decode(raw_safetensors({**meta, "z": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8)))
    with pytest.raises(PayloadError, match="does not match data_offsets"):  # 2**62 floats claimed, 8 bytes sent
        decode(raw_safetensors({**meta, "x": {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 8]}},
                               bytes(8)))
    with pytest.raises(PayloadError, match="shape"):
        decode(raw_safetensors({**meta, "x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}}, b""))
    with pytest.raises(PayloadError, match="header length"):
        decode(struct.pack("<Q", 2**63) + b"{}")


def test_decode_refuses_overlapping_gapped_or_short_tensor_layouts():
    meta = {"__metadata__": {"nanorl": json.dumps({"format": transport.FORMAT, "sha256": "0" * 64, "meta": {}})}}
    f32 = lambda a, b: {"dtype": "F32", "shape": [(b - a) // 4], "data_offsets": [a, b]}
    with pytest.raises(PayloadError, match="back to back"):  # y re-reads x's bytes
        decode(raw_safetensors({**meta, "x": f32(0, 8), "y": f32(0, 8)}, bytes(16)))
    with pytest.raises(PayloadError, match="back to back"):  # bytes 8..16 belong to nobody
        decode(raw_safetensors({**meta, "x": f32(0, 8), "y": f32(16, 24)}, bytes(24)))
    with pytest.raises(PayloadError, match="cover 8 bytes but the body holds 12"):
        decode(raw_safetensors({**meta, "x": f32(0, 8)}, bytes(12)))


def test_payload_is_a_safetensors_file_and_misaligned_tensors_round_trip():
    import safetensors.torch
    # 3 bool bytes put the int64 that follows at an odd offset: decode must copy it, not view it
    src = {"a_done": torch.tensor([True, False, True]), "b_ids": torch.arange(5) * 10**12, "c_x": torch.randn(2, 3)}
    blob = encode(src, {"k": 1})
    theirs, (ours, _) = safetensors.torch.load(bytes(blob)), decode(blob)
    assert all(torch.equal(theirs[k], t) and torch.equal(ours[k], t) for k, t in src.items())


def test_decode_rejects_bool_bytes_other_than_0_and_1_even_with_valid_sha():
    odd = torch.tensor([0, 1, 2], dtype=torch.uint8).view(torch.bool)
    with pytest.raises(PayloadError, match="other than 0 and 1"):
        decode(encode({"done": odd}, {}))


def test_encode_refuses_a_meta_that_decode_would_refuse():
    for meta in ([1, 2], "v7", None):  # the sender fails, naming the type, not the trainer that decodes it
        with pytest.raises(PayloadError, match=f"meta must be a JSON-able dict, got {type(meta).__name__}$"):
            encode({"x": torch.zeros(2)}, meta)


@pytest.mark.parametrize("head", [[1], None, {"format": "nanorl/2", "sha256": "0" * 64, "meta": {}},
                                  {"format": transport.FORMAT, "meta": {}},
                                  {"format": transport.FORMAT, "sha256": 0, "meta": {}},
                                  {"format": transport.FORMAT, "sha256": "0" * 64, "meta": [1]}])
def test_decode_refuses_a_nanorl_header_without_format_sha256_and_meta_object(head):
    blob = raw_safetensors({"__metadata__": {"nanorl": json.dumps(head)}}, b"")
    with pytest.raises(PayloadError, match="nanorl header must be an object with format='nanorl/1', sha256"):
        decode(blob)


def test_decode_of_a_non_bytes_object_raises_payload_error_and_a_memoryview_decodes():
    for obj in ("not bytes", None, 12, [1, 2]):  # bytearray() of these raises TypeError or invents bytes
        with pytest.raises(PayloadError, match=f"decode needs bytes, got {type(obj).__name__}$"):
            decode(obj)
    assert decode(memoryview(bytes(VALID)))[1] == META


def test_the_sha256_is_over_the_entries_as_sorted_key_json_then_the_tensor_bytes():
    # the wire format: a worker of another version (or language) must compute the same digest
    blob = encode({"x": torch.tensor([1.0, 2.0])}, {})
    n = int.from_bytes(blob[:8], "little")
    entries = b'{"x": {"data_offsets": [0, 8], "dtype": "F32", "shape": [2]}}'
    want = hashlib.sha256(entries + struct.pack("<2f", 1.0, 2.0)).hexdigest()
    assert json.loads(json.loads(blob[8:8 + n])["__metadata__"]["nanorl"])["sha256"] == want


@pytest.mark.parametrize("pad", range(8))  # meta grows a byte at a time: every header length mod 8
def test_encode_pads_the_header_with_under_8_spaces_so_the_data_starts_8_byte_aligned(pad):
    blob = encode({"x": torch.tensor([1.5])}, {"s": "a" * pad})
    n = int.from_bytes(blob[:8], "little")
    header = bytes(blob[8:8 + n])
    assert n % 8 == 0 and n - len(header.rstrip(b" ")) < 8 and header.rstrip(b" ").endswith(b"}")
    assert len(blob) == 8 + n + 4 and decode(blob)[0]["x"].tolist() == [1.5]


def test_decode_of_fewer_than_8_bytes_is_refused_by_size_and_8_reads_a_header_length():
    with pytest.raises(PayloadError, match="^payload is 7 bytes; a safetensors blob has at least 8$"):
        decode(bytes(7))
    with pytest.raises(PayloadError, match="^safetensors or nanorl header is not valid JSON: Expecting val"):
        decode(bytes(8))  # a header length of 0: an empty header


def test_a_header_length_one_past_the_payload_is_refused_naming_both():
    blob = encode({}, {})  # no tensors: the header ends the payload
    n = len(blob) - 8
    assert int.from_bytes(blob[:8], "little") == n and decode(blob) == ({}, {})
    with pytest.raises(PayloadError, match=rf"^header length {n + 1} exceeds the payload \({n} bytes\) or "
                                           rf"{transport.MAX_HEADER}$"):
        decode(struct.pack("<Q", n + 1) + blob[8:])


@pytest.mark.parametrize("shape", [[-1], [True], [2.0], "1", None, [1] * 9])
def test_decode_refuses_a_shape_that_is_not_a_list_of_at_most_8_non_negative_ints(shape):
    # each would otherwise reach the offsets check (or math.prod) with a misleading message, or pass it
    head = json.dumps({"format": transport.FORMAT, "sha256": "0" * 64, "meta": {}})
    blob = raw_safetensors({"__metadata__": {"nanorl": head},
                            "x": {"dtype": "U8", "shape": shape, "data_offsets": [0, 1]}}, b"\x07")
    said = f"tensor 'x': shape {shape!r} is not a list of <= 8 sizes"
    with pytest.raises(PayloadError, match=re.escape(said) + "$"):
        decode(blob)


def test_a_tensor_of_exactly_8_dimensions_round_trips():
    x = torch.arange(2 * 3, dtype=torch.int16).reshape(1, 2, 1, 3, 1, 1, 1, 1)
    out, _ = decode(encode({"x": x}, {}))
    assert out["x"].shape == (1, 2, 1, 3, 1, 1, 1, 1) and torch.equal(out["x"], x)


def test_decode_views_aligned_tensors_in_place_and_copies_misaligned_ones_after_any_header_length():
    blob = encode({"x": torch.tensor([1.0, 2.0])}, {})
    out, _ = decode(blob)
    blob[-4:] = struct.pack("<f", 7.0)  # the tensors view the payload: a weight push is not copied again
    assert out["x"].tolist() == [1.0, 7.0]
    # Another writer need not pad its header: the data starts at byte 13 here, so "b" lies at byte 14.
    entries = {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
               "b": {"dtype": "F32", "shape": [1], "data_offsets": [1, 5]}}
    data = b"\x07" + struct.pack("<f", 1.5)
    sha = hashlib.sha256(json.dumps(entries, sort_keys=True).encode() + data).hexdigest()
    head = {"__metadata__": {"nanorl": json.dumps({"format": transport.FORMAT, "sha256": sha, "meta": {}})}}
    header = json.dumps({**head, **entries}).encode()
    header += b" " * ((5 - len(header)) % 4)  # 8 + len(header) = 1 (mod 4)
    out, meta = decode(struct.pack("<Q", len(header)) + header + data)
    assert (out["a"].tolist(), out["b"].tolist(), meta) == ([7], [1.5], {})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_decode_of_random_bytes_raises_only_payload_error(blob):
    for data in (blob, struct.pack("<Q", len(blob)) + blob):  # second form gets past the length check
        try:
            decode(data)
        except PayloadError:
            pass


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                    max_leaves=8)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), st.fixed_dictionaries(
    {"dtype": st.sampled_from(["F32", "BF16", "I64", "BOOL", "C64", ""]) | JSON,
     "shape": st.lists(st.integers(-2, 2**40), max_size=3) | JSON,
     "data_offsets": st.lists(st.integers(-2, 64), min_size=2, max_size=2) | JSON}), max_size=3),
    st.binary(max_size=64))
def test_decode_of_hostile_headers_raises_only_payload_error(header, data):
    try:
        decode(raw_safetensors(header, data))
    except PayloadError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)), min_size=1, max_size=4),
       st.integers(0, len(VALID)))
def test_decode_of_mutated_valid_payload_raises_only_payload_error(flips, cut):
    flipped = bytearray(VALID)
    for i, x in flips:
        flipped[i] ^= x
    for data in (bytes(flipped), VALID[:cut], bytes(flipped)[:cut]):
        try:
            decode(data)
        except PayloadError:
            pass


# ---------------------------------------------------------------- server

@pytest.fixture(scope="module")
def server():
    received = []

    def batch(req: Request):
        tensors, meta = decode(req.body)
        received.append((tensors, meta))
        return 200, {"rows": int(tensors["logp"].shape[0]), "received": len(received)}

    def adapter(req: Request):
        if int(req.query.get("have", "-1")) >= 3:
            return 204, None
        return 200, encode({"lora_A": torch.ones(2, 2)}, {"kind": "adapter", "version": 3})

    def boom(req: Request):
        raise RuntimeError("kaboom")

    routes = {("GET", "/hello"): lambda req: (200, {"fingerprint": "abc"}), ("POST", "/batch"): batch,
              ("GET", "/adapter"): adapter, ("GET", "/boom"): boom}
    with Server(routes, token=TOKEN, max_body=MAX_BODY) as srv:
        srv.received = received
        yield srv


def raw(srv, head: bytes, body: bytes = b"", hang_up: bool = False) -> tuple[int, bytes]:
    """Send bytes on a bare socket, read until the server closes; returns (status, body)."""
    u = urlsplit(srv.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:  # 10 s only guards a hang
        s.sendall(head + body)
        if hang_up:
            s.shutdown(socket.SHUT_WR)
        resp = b""
        while chunk := s.recv(65536):
            resp += chunk
    status_line, _, rest = resp.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def post_head(length: str | None, token: str | None = TOKEN, path="/batch") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x"]
    lines += [f"Authorization: Bearer {token}"] if token is not None else []
    lines += [f"Content-Length: {length}"] if length is not None else []
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def assert_still_serves_valid_batch(srv):
    n = len(srv.received)
    status, body = Client(srv.url, TOKEN).post("/batch", VALID)
    assert status == 200 and json.loads(body) == {"rows": 3, "received": n + 1}
    assert srv.received[-1][1] == META


def test_valid_batch_is_decoded_by_route_and_adapter_honours_have(server):
    assert_still_serves_valid_batch(server)
    c = Client(server.url, TOKEN)
    assert c.get("/hello") == (200, b'{"fingerprint": "abc"}')
    status, body = c.get("/adapter?have=1")
    assert status == 200 and decode(body)[1] == {"kind": "adapter", "version": 3}
    assert c.get("/adapter?have=3") == (204, b"")


@pytest.mark.parametrize("token", [None, "wrong-token-0123456789abcde", "short", TOKEN + "x", TOKEN[:-1]])
def test_missing_wrong_or_wrong_length_token_gets_401(server, token):
    n = len(server.received)
    status, body = raw(server, post_head(str(len(VALID)), token=token), VALID)
    assert status == 401 and "NANORL_TOKEN" in json.loads(body)["error"]
    assert len(server.received) == n  # the route never ran
    assert_still_serves_valid_batch(server)


@pytest.mark.parametrize("value", ["Bearer t\u00e9st".encode(), b"Bearer \xff\xfe", b"bearer " + TOKEN.encode(), b""])
def test_non_ascii_or_malformed_authorization_gets_401_not_a_crash(server, value):
    head = b"GET /hello HTTP/1.1\r\nHost: x\r\nAuthorization: " + value + b"\r\n\r\n"
    assert raw(server, head)[0] == 401
    assert_still_serves_valid_batch(server)


def test_2gb_content_length_gets_413_without_reading_body(server):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    # Only the headers are sent: if the server tried to read the 2 GB body, raw() would hang
    # until its socket timeout instead of seeing the 413 and the close.
    status, body = raw(server, post_head(str(2 * 1024**3)))
    assert status == 413 and str(MAX_BODY) in json.loads(body)["error"]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024
    assert_still_serves_valid_batch(server)


def test_client_sees_413_even_when_server_hangs_up_mid_upload(server):
    status, body = Client(server.url, TOKEN, retries=1).post("/batch", bytes(16 * MAX_BODY))
    assert status == 413 and "exceeds the server limit" in json.loads(body)["error"]
    assert_still_serves_valid_batch(server)


def test_post_without_content_length_gets_411(server):
    status, body = raw(server, post_head(None))
    assert status == 411 and "Content-Length" in json.loads(body)["error"]
    assert_still_serves_valid_batch(server)


@pytest.mark.parametrize("length", ["abc", "-5", "1e3", "0x10", "", "99999999999999999999999"])
def test_malformed_content_length_gets_400(server, length):
    status, body = raw(server, post_head(length))
    assert status == 400 and "Content-Length" in json.loads(body)["error"]
    assert_still_serves_valid_batch(server)


def test_conflicting_content_lengths_get_400(server):
    head = post_head("10").replace(b"\r\n\r\n", b"\r\nContent-Length: 20\r\n\r\n")
    status, body = raw(server, head, bytes(20))
    assert (status, json.loads(body)) == (400, {"error": "conflicting Content-Length headers: ['10', '20']"})
    assert_still_serves_valid_batch(server)


def test_body_shorter_than_content_length_gets_400(server):
    status, body = raw(server, post_head("100"), bytes(10), hang_up=True)  # client gives up mid-body
    assert status == 400 and "truncated" in json.loads(body)["error"]
    assert_still_serves_valid_batch(server)


def test_corrupt_payload_gets_400_naming_sha_mismatch(server):
    data = bytearray(VALID)
    data[-1] ^= 0x80
    status, body = Client(server.url, TOKEN).post("/batch", bytes(data))
    assert status == 400 and "sha256 mismatch" in json.loads(body)["error"]
    assert_still_serves_valid_batch(server)


def test_truncated_safetensors_gets_400(server):
    status, body = Client(server.url, TOKEN).post("/batch", VALID[: len(VALID) // 2])
    assert status == 400 and json.loads(body)["error"].startswith("bad payload")
    assert_still_serves_valid_batch(server)


class CreatesFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this calls open(path, "w"), creating the file
        return open, (self.path, "w")


def test_pickle_payload_is_rejected_and_never_unpickled(server, tmp_path):
    target = tmp_path / "pwned"
    as_torch = io.BytesIO()
    torch.save(CreatesFile(str(target)), as_torch)  # torch.save wraps the same pickle in a zip
    for blob in (pickle.dumps(CreatesFile(str(target))), as_torch.getvalue()):
        status, body = Client(server.url, TOKEN).post("/batch", blob)
        assert status == 400 and "error" in json.loads(body)
        assert not target.exists()
    assert_still_serves_valid_batch(server)


def test_route_exception_gets_json_500_and_server_survives(server):
    status, body = Client(server.url, TOKEN).get("/boom")
    assert status == 500 and "kaboom" in json.loads(body)["error"]
    assert_still_serves_valid_batch(server)


def test_unknown_path_404_wrong_method_405_unsupported_method_501_all_json(server):
    c = Client(server.url, TOKEN)
    status, body = c.get("/nope")
    assert (status, json.loads(body)) == (404, {"error": "no route '/nope'"})
    assert c.post("/hello", b"")[0] == 405
    status, body = raw(server, b"PUT /batch HTTP/1.1\r\nContent-Length: 0\r\n\r\n")  # http.server's own error
    assert status == 501 and "PUT" in json.loads(body)["error"]
    assert_still_serves_valid_batch(server)


def test_a_payload_of_another_format_version_gets_400_naming_the_expected_format(server):
    head = json.dumps({"format": "nanorl/2", "sha256": "0" * 64, "meta": {}})  # from a newer worker
    blob = raw_safetensors({"__metadata__": {"nanorl": head}}, b"")
    status, body = Client(server.url, TOKEN).post("/batch", blob)
    assert (status, json.loads(body)) == (400, {"error": "bad payload: nanorl header must be an object with "
                                                         "format='nanorl/1', sha256 and meta"})
    assert_still_serves_valid_batch(server)


@pytest.fixture(scope="module")
def echo():
    """A server whose bodies are limited to 64 bytes and whose route answers what it was given."""
    answer = lambda req: (200, {"bytes": len(req.body), "query": req.query})
    with Server({("POST", "/echo"): answer}, token=TOKEN, max_body=64) as srv:
        yield srv


def wait_idle(srv):
    """Until the handler threads of earlier requests have given back their bytes and connections: each does
    so just after its reply."""
    for _ in range(500):
        with srv.lock:
            if srv.held == 0 and not srv.conns:
                return
        time.sleep(0.01)
    raise AssertionError(f"the server still holds {srv.held} bytes and {len(srv.conns)} connections")


def test_a_body_of_exactly_max_body_is_taken_and_one_byte_more_gets_413(echo):
    c = Client(echo.url, TOKEN)
    assert c.post("/echo", b"x" * 64) == (200, b'{"bytes": 64, "query": {}}')
    status, body = c.post("/echo", b"x" * 65)
    assert (status, json.loads(body)) == (413, {"error": "body of 65 bytes exceeds the server limit of 64 "
                                                         "bytes"})


def test_the_byte_budget_holds_exactly_max_body_in_all_and_refuses_one_byte_more(echo):
    wait_idle(echo)
    refused = echo.counts["bodies_refused"]
    # exactly max_body fits; a 1-byte chunk past it is refused like any other
    assert (echo.hold(63), echo.hold(1), echo.hold(1)) == (True, True, False)
    assert (echo.held, echo.counts["bodies_refused"] - refused) == (64, 1)
    assert echo.hold(-64) and echo.held == 0


def test_query_values_reach_the_route_blank_ones_included(echo):
    assert json.loads(Client(echo.url, TOKEN).post("/echo?have=&v=3", b"")[1]) == {
        "bytes": 0, "query": {"have": "", "v": "3"}}


def test_the_body_is_read_to_content_length_and_not_a_byte_further(echo):
    u = urlsplit(echo.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(post_head("5", path="/echo") + b"hel")
        time.sleep(0.2)  # the server reads those 3 bytes first, then asks for the 2 still missing
        s.sendall(b"lo" + b"EXTRA")  # bytes past Content-Length (a pipelined request) are not the body's
        reply = b""
        with contextlib.suppress(ConnectionResetError):  # the server closes with EXTRA unread: a reset
            while chunk := s.recv(65536):
                reply += chunk
    assert reply.startswith(b"HTTP/1.0 200 ") and reply.endswith(b'{"bytes": 5, "query": {}}')


def test_an_authenticated_upload_is_given_body_s_plus_a_second_per_body_rate_bytes_arrived(echo, monkeypatch):
    monkeypatch.setattr(transport, "BODY_S", 5.0)
    monkeypatch.setattr(transport, "BODY_RATE", 10)  # 60 bytes announced, 10 arrived: 5 + 1 = 6 s to finish
    u = urlsplit(echo.url)
    wait_idle(echo)  # the one admitted connection below is then this test's
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(post_head("60", path="/echo") + b"x" * 10)
        for _ in range(200):
            with echo.lock:
                left = [until - time.monotonic() for until, admitted in echo.conns.values() if admitted]
            if left and left[0] > 5.1:  # past BODY_S alone: the 10 bytes were read
                break
            time.sleep(0.01)
        assert len(left) == 1 and 5.1 < left[0] <= 6.0


def test_an_upload_that_trickles_below_body_rate_is_dropped_whatever_length_it_announced(echo, monkeypatch):
    """The deadline came from the announced Content-Length: a token holder announcing 1 GiB and sending a
    byte every few seconds held one of the MAX_CONNS connections for 17 minutes; 64 of them, every one."""
    monkeypatch.setattr(transport, "BODY_S", 1.0)
    monkeypatch.setattr(transport, "BODY_RATE", 10)  # 64 bytes announced: 1 + 6.4 s under the old rule
    u, timed_out = urlsplit(echo.url), echo.counts["connections_timed_out"]
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(post_head("64", path="/echo") + b"x" * 10)
        started = time.monotonic()
        while echo.counts["connections_timed_out"] == timed_out and time.monotonic() - started < 20:
            with contextlib.suppress(OSError):  # dropped: the server shut the socket
                s.sendall(b"x")  # 2 bytes/s: its deadline, 1 + (10 + 2 t) / 10 s, passes at t = 2.5 s
            time.sleep(0.5)
        assert echo.counts["connections_timed_out"] == timed_out + 1 and time.monotonic() - started < 4.5


def test_a_long_malformed_content_length_is_quoted_cut_to_40_characters(server):
    status, body = raw(server, post_head("1" * 50))  # 50 digits: more than an int64 holds
    assert (status, json.loads(body)) == (400, {"error": f"malformed Content-Length {'1' * 40!r}; "
                                                         "expected an integer >= 0"})
    assert_still_serves_valid_batch(server)


# ---------------------------------------------------------------- binding and tokens

def test_non_loopback_bind_without_token_refuses_before_opening_socket(monkeypatch):
    monkeypatch.delenv("NANORL_TOKEN", raising=False)

    def no_socket(*a, **k):
        raise AssertionError("a socket was opened")

    monkeypatch.setattr(socket, "socket", no_socket)
    for host in ("0.0.0.0", "::", "", "192.168.1.10", "trainer.example"):
        with pytest.raises(ValueError, match="NANORL_TOKEN"):
            Server({}, host=host)


def test_loopback_without_token_generates_one_and_still_requires_it(monkeypatch):
    monkeypatch.delenv("NANORL_TOKEN", raising=False)
    with Server({("GET", "/hello"): lambda req: (200, {"ok": 1})}) as srv:
        assert len(srv.token) >= 32
        assert raw(srv, b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 401
        assert Client(srv.url, srv.token).get("/hello") == (200, b'{"ok": 1}')


def test_a_trainer_whose_token_no_worker_but_its_own_could_have_and_that_has_none_is_refused(monkeypatch):
    """--role trainer --workers 0 without NANORL_TOKEN waited for batches for ever: its fresh token reaches
    only the workers it starts, and a worker started by hand stops without a token."""
    monkeypatch.delenv("NANORL_TOKEN", raising=False)
    with pytest.raises(ValueError) as refused:
        transport.serving_token("127.0.0.1", workers=0)
    assert str(refused.value) == ("--role trainer without NANORL_TOKEN takes only its own --workers, and there "
                                  "are none: set NANORL_TOKEN for workers to join, or pass --workers N")
    assert len(transport.serving_token("127.0.0.1", workers=1)) == 43  # its own worker gets a fresh one
    monkeypatch.setenv("NANORL_TOKEN", TOKEN)
    assert transport.serving_token("127.0.0.1", workers=0) == TOKEN  # workers started by hand join with it


def test_env_token_is_used_by_server_and_client(monkeypatch):
    monkeypatch.setenv("NANORL_TOKEN", "env-token-abcdefghijklmnop")
    with Server({("GET", "/hello"): lambda req: (200, None)}) as srv:
        assert srv.token == "env-token-abcdefghijklmnop"
        assert Client(srv.url).get("/hello") == (200, b"")


def test_unsendable_token_is_refused_with_a_hint(monkeypatch):
    monkeypatch.setenv("NANORL_TOKEN", "has space")
    with pytest.raises(ValueError, match="printable ASCII"):
        Client("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="NANORL_TOKEN"):
        Server({}, token="t\u00e9st")


# ---------------------------------------------------------------- client

@pytest.mark.parametrize("url,expected", [("http://10.0.0.2:8000", ("10.0.0.2", 8000)),
                                          ("http://[::1]:8000/", ("::1", 8000)),
                                          ("http://trainer", ("trainer", None))])
def test_split_url_gives_the_host_and_port_of_an_http_url(url, expected):
    assert transport.split_url(url) == expected


@pytest.mark.parametrize("url", ["https://trainer:8000", "http://:8000", "trainer:8000", "http://[::1:8000",
                                 "http://trainer:65536"])
def test_split_url_refuses_anything_but_http_host_port_naming_the_url(url):
    # a scheme other than http, no host, an unclosed [IPv6 or a port past 65535: said at start-up, not later
    said = f"--trainer-url must look like http://HOST:PORT, got {url!r}"
    with pytest.raises(ValueError, match=re.escape(said) + "$"):
        transport.split_url(url)


def test_client_raises_serve_error_when_nothing_listens():
    c = Client(free_url(), TOKEN, retries=2, backoff=0)
    with pytest.raises(ServeError, match="after 2 tries.*ConnectionRefused"):
        c.get("/hello")


def test_client_raises_serve_error_on_read_timeout():
    with socket.socket() as lis:  # accepts connections (backlog) but never answers
        lis.bind(("127.0.0.1", 0))
        lis.listen(4)
        c = Client(f"http://127.0.0.1:{lis.getsockname()[1]}", TOKEN, timeout=0.2, retries=1)
        with pytest.raises(ServeError, match="timed out"):
            c.get("/hello")


@pytest.mark.parametrize("method,attempts", [("GET", 3), ("POST", 1)])
def test_client_retries_get_but_never_resends_a_delivered_post(method, attempts):
    with bare_peer(b"") as (url, seen):  # hangs up on every request after reading it
        c = Client(url, TOKEN, retries=3, backoff=0)
        with pytest.raises(ServeError):
            c.get("/hello") if method == "GET" else c.post("/batch", VALID)
    assert len(seen) == attempts


def test_client_reads_a_reply_without_content_length_to_the_end():
    # e.g. a proxy's error page in front of the trainer: HTTP/1.0, no Content-Length, ended by the close
    page = b"HTTP/1.0 502 Bad Gateway\r\nContent-Type: text/html\r\n\r\n<h1>bad gateway</h1>"
    with bare_peer(page) as (url, seen):
        assert Client(url, TOKEN, retries=1).get("/hello") == (502, b"<h1>bad gateway</h1>")
    assert len(seen) == 1 and seen[0].startswith(b"GET /hello HTTP/1.1\r\n")


@pytest.mark.parametrize("method,attempts", [("GET", 3), ("POST", 1)])
def test_a_peer_hanging_up_mid_body_is_an_incomplete_read_retried_for_get_only(method, attempts):
    with bare_peer(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10) as (url, seen):
        c = Client(url, TOKEN, retries=3, backoff=0)
        said = rf"^{method} {url}/p failed during the request after {attempts} tries: IncompleteRead: "
        with pytest.raises(ServeError, match=said + r"IncompleteRead\(10 bytes read, 90 more expected\)"):
            c.get("/p") if method == "GET" else c.post("/p", b"body")
    assert len(seen) == attempts and all(r.endswith(b"\r\n\r\n" + b"body" * (method == "POST"))
                                         for r in seen)


@pytest.mark.parametrize("head, size", [(b"Content-Length: 100000000000000\r\n", "100,000,000,000,000"),
                                        (b"", "65+")])  # no Content-Length: read to the end, one byte past
def test_a_reply_over_the_clients_cap_is_refused_in_one_line_without_retry_or_allocating_it(head, size):
    """A peer announcing 1e14 bytes made the client allocate them: a worker pointed at it said "out of
    memory; lower --micro-batch". What a peer sends without a Content-Length is capped as it arrives."""
    with bare_peer(b"HTTP/1.0 200 OK\r\n" + head + b"\r\n" + b"x" * 65) as (url, seen):
        said = (f"GET {url}/adapter: a reply of {size} bytes is over this client's cap of 64; {url} does not "
                "look like a nanorl trainer: check --trainer-url")
        with pytest.raises(ValueError, match="^" + re.escape(said) + "$"):
            Client(url, TOKEN, retries=3, backoff=0, max_reply=64).get("/adapter")
    assert len(seen) == 1


def test_a_reply_of_exactly_the_clients_cap_is_read_whole_with_or_without_a_content_length():
    for head in (b"Content-Length: 64\r\n", b""):
        with bare_peer(b"HTTP/1.0 200 OK\r\n" + head + b"\r\n" + b"x" * 64) as (url, _):
            assert Client(url, TOKEN, retries=1, max_reply=64).get("/adapter") == (200, b"x" * 64)


# ---------------------------------------------------------------- whatever clients do, the server keeps serving
def rss_mb() -> int:
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) >> 10


def requests_per_s(srv, seconds: float) -> tuple[float, int]:
    """A real client's GET rate against `srv` for `seconds`, and how many requests failed."""
    client, n, failed, end = Client(srv.url, TOKEN, timeout=5, retries=1), 0, 0, time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            n += client.get("/hello")[0] == 200
        except ServeError:
            failed += 1
    return n / seconds, failed


def test_slow_connection_flood_at_the_cap_leaves_a_real_client_served_with_bounded_threads(server):
    undisturbed, _ = requests_per_s(server, 2.0)
    u, stop, opened = urlsplit(server.url), threading.Event(), []
    before = server.counts["connections_evicted"]
    flooder = threading.Thread(target=lambda: opened.append(flood(u.hostname, u.port, stop)))
    flooder.start()
    try:
        time.sleep(1.0)
        threads = threading.active_count()
        flooded, failed = requests_per_s(server, 3.0)
    finally:
        stop.set()
        flooder.join()
    print(f"real client: {flooded:.0f} req/s under the flood vs {undisturbed:.0f} undisturbed; "
          f"{opened[0]} flood connections")
    assert failed == 0 and flooded >= 0.1 * undisturbed
    assert threads <= 3 + 2 * transport.MAX_CONNS  # the server's handlers, this flood's thread, pytest's
    assert server.counts["connections_evicted"] - before >= opened[0] - transport.MAX_CONNS - 10


def test_at_the_cap_with_every_connection_admitted_a_new_one_is_refused_and_counted(monkeypatch):
    monkeypatch.setattr(transport, "MAX_CONNS", 2)
    with Server({("POST", "/batch"): lambda req: (200, {"bytes": len(req.body)})}, token=TOKEN) as srv:
        u = urlsplit(srv.url)
        uploads = [socket.create_connection((u.hostname, u.port), timeout=10) for _ in range(2)]
        try:
            for s in uploads:  # authenticated, so admitted: past their headers, mid-body
                s.sendall(post_head("1000") + b"x" * 10)
            for _ in range(500):
                if [a for _, a in srv.conns.values()] == [True, True]:
                    break
                time.sleep(0.01)
            with socket.create_connection((u.hostname, u.port), timeout=10) as late:
                assert late.recv(100) == b""  # closed unanswered: an admitted upload is never evicted for it
            assert (srv.counts["connections_refused"], srv.counts["connections_evicted"]) == (1, 0)
            for s in uploads:  # both uploads still finish
                s.sendall(b"x" * 990)
                s.shutdown(socket.SHUT_WR)
                reply = b""
                while chunk := s.recv(65536):
                    reply += chunk
                assert reply.startswith(b"HTTP/1.0 200 ") and reply.endswith(b'{"bytes": 1000}')
        finally:
            for s in uploads:
                s.close()


def test_a_request_evicted_after_its_headers_came_but_before_it_was_admitted_never_runs(monkeypatch):
    """The eviction takes the oldest connection not yet admitted, which may be one whose headers were just
    read: its route ran, its reply was lost, and the client's resend found the work done (a /hello's id
    wasted, a /batch answered "duplicate"). Here its handler is held at the token check, past its headers."""
    monkeypatch.setattr(transport, "MAX_CONNS", 2)
    ran, held, go, check = [], threading.Event(), threading.Event(), transport.secrets.compare_digest

    def gate(a, b):  # the first request's handler waits here until the test lets it go on
        if not held.is_set():
            held.handler = threading.current_thread()
            held.set()
            go.wait(10)
        return check(a, b)

    monkeypatch.setattr(transport.secrets, "compare_digest", gate)
    with Server({("POST", "/hello"): lambda req: (200, ran.append(req.query["who"]))}, token=TOKEN) as srv:
        u, hello = urlsplit(srv.url), lambda who: post_head("0", path=f"/hello?who={who}")
        with contextlib.ExitStack() as stack:
            connect = lambda: stack.enter_context(socket.create_connection((u.hostname, u.port), timeout=10))
            (first := connect()).sendall(hello("first"))
            assert held.wait(10)  # its headers are read, it is not admitted
            connect()  # an idle one: the cap is full
            late = connect()
            for _ in range(500):  # the third connection at a cap of 2 evicts the oldest unadmitted: first
                if srv.counts["connections_evicted"]:
                    break
                time.sleep(0.01)
            go.set()
            held.handler.join(10)
            assert first.recv(100) == b"" and srv.counts["connections_evicted"] == 1
            assert ran == []  # unanswered, so never run: its client may send it again
            late.sendall(hello("late"))
            reply = b""
            while chunk := late.recv(65536):
                reply += chunk
            assert reply.startswith(b"HTTP/1.0 200 ") and ran == ["late"]


def test_headers_and_bodies_have_overall_deadlines(server, monkeypatch):
    monkeypatch.setattr(transport, "HEADER_S", 0.5)
    monkeypatch.setattr(transport, "BODY_S", 0.5)
    u, start = urlsplit(server.url), time.monotonic()
    with socket.create_connection((u.hostname, u.port)) as slow, socket.create_connection((u.hostname, u.port)) as stall:
        stall.sendall(post_head(str(MAX_BODY // 2)) + b"x" * 1000)  # authenticated, then stalls
        for _ in range(100):  # one byte every 0.1 s keeps every read inside its 10 s socket timeout
            try:
                slow.send(b"G")
            except OSError:
                break
            time.sleep(0.1)
        # Both closed by the server near its 0.5 s deadlines; without them the trickle lasts 10 s.
        assert stall.recv(100) == b"" and time.monotonic() - start < 5.0
    time.sleep(0.2)  # for the handler thread to give its bytes back
    assert server.held == 0
    assert_still_serves_valid_batch(server)


def test_stalled_uploads_hold_only_what_they_sent_and_all_bodies_stay_under_max_body(monkeypatch):
    monkeypatch.setattr(transport, "BODY_S", 2.0)
    monkeypatch.setattr(transport, "BODY_RATE", 1 << 40)
    with Server({("POST", "/batch"): lambda req: (200, None)}, token=TOKEN, max_body=1 << 30) as srv:
        u, base = urlsplit(srv.url), rss_mb()
        socks = [socket.create_connection((u.hostname, u.port)) for _ in range(4)]
        for s in socks:  # 4 uploads announce 1 GiB - 1 MiB each and send 8 MiB, then stall
            s.sendall(post_head(str((1 << 30) - (1 << 20))) + b"x" * (8 << 20))
        time.sleep(1.0)
        held, grew = srv.held, rss_mb() - base
        print(f"4 stalled 1 GiB uploads: {held >> 20} MiB held, RSS +{grew} MiB")
        assert held == 4 * (8 << 20) and grew < 100
        time.sleep(1.5)  # past BODY_S the stalled uploads are dropped
        assert srv.held == 0 and srv.counts["connections_timed_out"] == 4
        for s in socks:
            s.close()


def test_an_upload_past_the_servers_byte_budget_gets_503_while_others_hold_it():
    with Server({("POST", "/batch"): lambda req: (200, None)}, token=TOKEN, max_body=32 << 20) as srv:
        u = urlsplit(srv.url)
        with socket.create_connection((u.hostname, u.port)) as stalled:
            stalled.sendall(post_head(str(30 << 20)) + b"x" * (20 << 20))
            time.sleep(0.5)
            status, body = Client(srv.url, TOKEN, retries=1).post("/batch", b"x" * (16 << 20))
            assert status == 503 and "retry" in json.loads(body)["error"] and srv.counts["bodies_refused"] == 1
            time.sleep(0.2)  # for the refused request's thread to give back what it held
            assert srv.held == 20 << 20
            assert Client(srv.url, TOKEN).post("/batch", b"x" * (8 << 20))[0] == 200  # what fits still lands


@pytest.mark.parametrize("token", ["", "short-token", "x" * 15])
def test_tokens_under_16_characters_are_refused_at_start_up(token):
    with pytest.raises(ValueError, match="at least 16"):
        Server({}, token=token or "t" * 15)
    with pytest.raises(ValueError, match="at least 16"):
        Client("http://127.0.0.1:1", token=token or "t" * 15)


def test_aborted_connections_log_one_line_each_not_a_traceback(server, caplog):
    u = urlsplit(server.url)
    with caplog.at_level("DEBUG", logger="nanorl.transport"):
        for _ in range(20):
            s = socket.create_connection((u.hostname, u.port))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
            s.sendall(post_head(str(MAX_BODY // 2)) + b"x" * 100)
            s.close()
        time.sleep(0.5)
    assert all("Traceback" not in r.getMessage() and r.exc_info is None for r in caplog.records)
    assert sum(len(r.getMessage()) for r in caplog.records) < 20 * 200


def read_reply(sock: socket.socket) -> tuple[bytes, int]:
    """The status line and the number of body bytes a raw socket got before the server closed it."""
    data = b""
    with contextlib.suppress(OSError):  # a reply cut by the server may end in a reset
        while chunk := sock.recv(1 << 20):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], len(body)


def slow_reader(srv, path: str) -> socket.socket:
    """A GET sent on a socket with a small receive buffer: the kernel holds little of a reply left unread."""
    u = urlsplit(srv.url)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    s.settimeout(10)  # a hang guard
    s.connect((u.hostname, u.port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
    return s


def test_a_reply_has_body_s_plus_a_second_per_body_rate_bytes_to_be_read_not_one_socket_timeout(monkeypatch):
    """The socket timeout (10 s) bounded a whole sendall: a 20 MB adapter was cut for every worker reading
    under 2 MB/s, and nothing said so. Here the timeout is 0.5 s and the reader stalls for 1 s."""
    monkeypatch.setattr(transport._Handler, "timeout", 0.5)
    monkeypatch.setattr(transport, "BODY_S", 1.5)
    monkeypatch.setattr(transport, "BODY_RATE", 16 << 20)  # a reply of 24 MiB: 1.5 + 24 / 16 = 3 s
    payload = bytes(24 << 20)
    with Server({("GET", "/big"): lambda req: (200, payload)}, token=TOKEN) as srv:
        with slow_reader(srv, "/big") as s:
            for _ in range(300):
                with srv.lock:
                    left = [until - time.monotonic() for until, admitted in srv.conns.values() if admitted]
                if left and left[0] > 1.6:  # past the request's BODY_S: the reply's deadline
                    break
                time.sleep(0.01)
            assert len(left) == 1 and 2.5 < left[0] <= 3.0
            time.sleep(1.0)  # twice the socket timeout, a third of the reply's deadline
            assert read_reply(s) == (b"HTTP/1.0 200 OK", 24 << 20)
        assert "replies_cut" not in srv.counts


def test_a_reply_not_read_within_its_deadline_is_cut_and_counted(monkeypatch):
    monkeypatch.setattr(transport, "BODY_S", 0.5)
    monkeypatch.setattr(transport, "BODY_RATE", 16 << 20)  # a reply of 16 MiB: 0.5 + 16 / 16 = 1.5 s
    payload = bytes(16 << 20)  # more than the kernel buffers of both ends hold
    with Server({("GET", "/big"): lambda req: (200, payload)}, token=TOKEN) as srv:
        with slow_reader(srv, "/big") as s:
            start = time.monotonic()
            while not srv.counts["replies_cut"] and time.monotonic() - start < 8:
                time.sleep(0.01)
            cut_after = time.monotonic() - start
            status, got = read_reply(s)
        assert srv.counts["replies_cut"] == 1 and 1.3 < cut_after < 3.0
        assert status == b"HTTP/1.0 200 OK" and got < 16 << 20
