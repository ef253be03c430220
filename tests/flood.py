"""A slow-header flood, shared by the transport test and bench/attacks.py (a live trainer)."""
import socket
import threading

import transport


def flood(host: str, port: int, stop: threading.Event) -> int:
    """Until `stop`: 3x the server's connection cap of sockets, each sending a byte of headers every
    0.5 s, reopening the ones the server drops. Returns how many connections it opened."""
    socks, opened = [], 0
    while not stop.is_set():
        while len(socks) < 3 * transport.MAX_CONNS:
            socks.append(socket.create_connection((host, port)))
            opened += 1
        for s in list(socks):
            try:
                s.send(b"G")
            except OSError:
                socks.remove(s)
                s.close()
        stop.wait(0.5)
    for s in socks:
        s.close()
    return opened
