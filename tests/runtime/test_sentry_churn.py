"""The agent's heap churn (aenv/guest/sentry.py) on a Linux kernel, as in a microVM: one thread
sends and then reads, so each piece must fit the socket buffer Linux grants (capped by
net.core.wmem_max: 208 KiB on a stock kernel, far below gVisor's). A 1 MiB piece once never
returned in a microVM, and a freeze waiting for the churn to stop waited for ever."""

from __future__ import annotations

import socket
import threading

import pytest

from aenv.guest import sentry

pytestmark = pytest.mark.fast
STOCK_WMEM_MAX = 212992  # a stock kernel's net.core.wmem_max (this host's may be raised)
SOCKETPAIR = socket.socketpair


class _StockBuffers(socket.socket):
    """A socket whose buffers are capped as a stock kernel caps them."""

    def setsockopt(self, level: int, option: int, value: int | bytes, *rest: object) -> None:  # type: ignore[override]
        if level == socket.SOL_SOCKET and option in (socket.SO_SNDBUF, socket.SO_RCVBUF) and isinstance(value, int):
            value = min(value, STOCK_WMEM_MAX)
        super().setsockopt(level, option, value)


def _stock_pair() -> tuple[socket.socket, socket.socket]:
    a, b = SOCKETPAIR()
    return tuple(_StockBuffers(s.family, s.type, s.proto, fileno=s.detach()) for s in (a, b))  # type: ignore[return-value]


@pytest.mark.parametrize("stock", [False, True], ids=["this-host", "stock-kernel-buffers"])
def test_the_churn_moves_everything_on_a_linux_kernel(stock: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if stock:
        monkeypatch.setattr(sentry.socket, "socketpair", _stock_pair)
    stop, moved = threading.Event(), []
    # A daemon thread: a send that never returns must fail the test, not hang the run.
    churn = threading.Thread(target=lambda: moved.append(sentry.churn_socket_buffers(stop, 16 << 20)), daemon=True)
    churn.start()
    churn.join(30)
    stop.set()
    assert not churn.is_alive(), "the churn's send never returned"
    assert moved[0] >= 16 << 20


def test_a_stopped_churn_moves_nothing() -> None:
    stop = threading.Event()
    stop.set()
    assert sentry.churn_socket_buffers(stop, 16 << 20) == 0
