"""Where a rank group meets: a TCP port on this host, chosen by whoever starts the ranks.

Torch-free: the API process (supervisor.py) picks the port before it spawns the ranks, and never loads torch.
"""

from __future__ import annotations

import socket

RENDEZVOUS_HOST = "127.0.0.1"


def free_port() -> int:
    """A port the OS says is free now; rank 0 binds it moments later (a race that a retry would cover)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((RENDEZVOUS_HOST, 0))
        return int(s.getsockname()[1])
