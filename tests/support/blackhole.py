"""A loopback TCP proxy that can black-hole its traffic, as a dead switch or route does.

``cut()`` stops forwarding in both directions without closing anything: no RST, no FIN,
the peers see silence. The proxy stops *reading* (it does not read and drop), so what the
peers send waits in the kernel's buffers and is delivered on ``heal()``, as TCP
retransmission would deliver it after a partition heals: the byte streams stay intact.
Connections accepted during a cut are held, unconnected upstream, until it heals (a peer
that connects meanwhile waits for its server's greeting, bounded by its connect timeout).

One limit, by construction: the proxy's own kernel still acknowledges what the peers send
(up to its buffers) and answers their TCP keepalive probes, so TCP-level bounds
(``tcp_user_timeout``, keepalives) do not fire through it as they would on a real dead
route. It proves what must hold without them: the keeper's fence by its own clock and the
server-side ``idle_in_transaction_session_timeout``.

Usage::

    with BlackholeProxy("127.0.0.1", 5432) as proxy:
        ... connect to 127.0.0.1:proxy.port ...
        proxy.cut(); ...; proxy.heal()

Pure Python (threads), for tests and the chaos runner.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import TracebackType


class BlackholeProxy:
    """Forward ``127.0.0.1:<port>`` to ``(host, port)``; ``cut()`` / ``heal()`` the traffic."""

    def __init__(self, host: str, port: int, *, listen: str = "127.0.0.1") -> None:
        self.target = (host, port)
        self._listener = socket.create_server((listen, 0))
        self.port: int = self._listener.getsockname()[1]
        self._open = threading.Event()  # set: traffic flows
        self._open.set()
        self._closed = False
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        #: Monotonic times of the cuts and heals, for reports.
        self.cuts: list[float] = []
        self.heals: list[float] = []
        #: Connections accepted so far (a test checks its peer really goes through).
        self.accepted = 0
        self._acceptor = threading.Thread(target=self._accept, name="blackhole-accept", daemon=True)
        self._acceptor.start()

    # ------------------------------------------------------------------ control
    @property
    def is_cut(self) -> bool:
        return not self._open.is_set()

    def cut(self) -> None:
        """Stop forwarding (both directions, every connection, new ones held)."""
        self.cuts.append(time.monotonic())
        self._open.clear()

    def heal(self) -> None:
        """Forward again; what waited in the buffers is delivered."""
        self.heals.append(time.monotonic())
        self._open.set()

    def close(self) -> None:
        """Close the listener and every connection (ends the peers' sessions)."""
        with self._lock:
            self._closed = True
            sockets, self._sockets = list(self._sockets), set()
        self._open.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (Linux)
        with contextlib.suppress(OSError):
            self._listener.close()
        for sock in sockets:
            # shutdown first: close() alone neither wakes a thread blocked in recv() on the
            # socket nor sends the FIN while that call holds the file.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> BlackholeProxy:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ forwarding
    def _track(self, sock: socket.socket) -> bool:
        """Remember ``sock`` to close it with the proxy; False (and closed) if closed."""
        with self._lock:
            if not self._closed:
                self._sockets.add(sock)
                return True
        with contextlib.suppress(OSError):
            sock.close()
        return False

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._track(client):
                return
            self.accepted += 1
            threading.Thread(
                target=self._connect, args=(client,), name="blackhole-conn", daemon=True
            ).start()

    def _connect(self, client: socket.socket) -> None:
        self._open.wait()  # a connection made during a cut waits for the heal
        if self._closed:
            return  # closed with the proxy
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            with contextlib.suppress(OSError):
                client.close()
            return
        if not self._track(upstream):
            return
        for src, dst in ((client, upstream), (upstream, client)):
            threading.Thread(
                target=self._pump, args=(src, dst), name="blackhole-pump", daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while not self._closed:
            self._open.wait()  # cut: stop reading; the bytes wait in the kernel
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                return
            self._open.wait()  # read just before a cut: held, not dropped
            if self._closed:
                return
            try:
                dst.sendall(data)
            except OSError:
                with contextlib.suppress(OSError):
                    src.shutdown(socket.SHUT_RD)
                return
