"""A whole HTTP request read off a raw socket, and a peer that answers each with raw bytes: the tests'
hand-made servers."""
import contextlib
import re
import socket
import threading


def read_request(conn: socket.socket) -> bytes:
    """One whole HTTP request. Bytes left unread make close() reset the connection, and the client may see
    the reset instead of the reply: under load, 10 of 15 runs of the raw-reply test failed that way."""
    request = b""
    while chunk := conn.recv(65536):
        request += chunk
        head, blank, body = request.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        if blank and len(body) >= (int(length[1]) if length else 0):
            break
    return request


@contextlib.contextmanager
def bare_peer(reply: bytes):
    """An HTTP peer on 127.0.0.1 that reads each request whole, sends the raw bytes `reply` and hangs up;
    yields (its url, the requests it read)."""
    with socket.socket() as lis:
        lis.bind(("127.0.0.1", 0))
        lis.listen(8)
        lis.settimeout(0.05)
        seen, stop = [], threading.Event()

        def serve():
            while not stop.is_set():
                try:
                    conn, _ = lis.accept()
                except TimeoutError:
                    continue
                with conn:
                    seen.append(read_request(conn))
                    conn.sendall(reply)

        t = threading.Thread(target=serve)
        t.start()
        try:
            yield f"http://127.0.0.1:{lis.getsockname()[1]}", seen
        finally:
            stop.set()
            t.join()
