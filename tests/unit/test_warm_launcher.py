"""The warm launcher's wait on its sockets works in a process holding more than 1,024 open files
(a long test session does: a CI leg failed with select's 'filedescriptor out of range')."""
from __future__ import annotations

import os
import resource
import socket

import pytest

import warm_launcher


def test_readable_sees_a_socket_numbered_above_1023():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1100:
        pytest.skip(f"the open-file limit ({soft}) is too low to reach descriptor 1024")
    held = []
    try:
        while len(held) < 1030 and (not held or held[-1] < 1030):
            held.append(os.open(os.devnull, os.O_RDONLY))
        left, right = socket.socketpair()
        with left, right:
            assert left.fileno() > 1023
            assert warm_launcher._readable([left], 0.01) == []
            right.sendall(b"x")
            assert warm_launcher._readable([left], 5) == [left]
            right.close()
            left.recv(1)
            assert warm_launcher._readable([left], 5) == [left]  # the peer's end reads as ready
    finally:
        for fd in held:
            os.close(fd)
