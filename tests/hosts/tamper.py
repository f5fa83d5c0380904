"""A loopback TCP proxy that flips one bit of what the server sends, after a given number of bytes: a
faulty or hostile link between two hosts."""

from __future__ import annotations

import socket
import threading


class FlippingProxy:
    def __init__(self, target: str, flip_after: int) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.flip_after = flip_after
        self.flipped = False
        self._sent = 0
        self._lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"

    def __enter__(self) -> "FlippingProxy":
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, downstream: bool) -> None:
        try:
            while data := source.recv(65536):
                if downstream:
                    data = self._maybe_flip(bytearray(data))
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _maybe_flip(self, data: bytearray) -> bytes:
        with self._lock:
            start, self._sent = self._sent, self._sent + len(data)
            if not self.flipped and start <= self.flip_after < self._sent:
                data[self.flip_after - start] ^= 0x10
                self.flipped = True
        return bytes(data)
