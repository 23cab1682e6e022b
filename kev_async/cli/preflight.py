"""Checks a service command makes before it loads a model: a port another process holds, brokers that
nobody answers at. Each problem is one sentence the command prints as `kev <command>: ...` (exit 1, as
for any start the host's state refuses; a config refused is exit 2), so a mistake costs neither the
model's load time nor a traceback. Not a command: COMMANDS does not
list it."""

from __future__ import annotations

import socket

BROKER_CONNECT_S = 3.0


def port_problem(host: str, port: int, what: str, fix: str) -> str | None:
    """Why `what` cannot listen on host:port (None: it can, or port 0 asks for any free port).

    Bound with SO_REUSEADDR, as the listeners themselves are, so a port in TIME_WAIT is not called taken."""
    if not port:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            return f"cannot listen on {host}:{port} for {what} ({error.strerror or error}); {fix}"
    return None


def broker_problem(bootstrap_servers: str, timeout_s: float = BROKER_CONNECT_S) -> str | None:
    """Why no broker of `bootstrap_servers` (HOST:PORT[,HOST:PORT]) can be reached: None once one accepts a
    TCP connection (whether it speaks Kafka is the client's to find out, with its own error)."""
    tried = []
    for address in (a.strip() for a in bootstrap_servers.split(",") if a.strip()):
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit():
            return f"kafka.bootstrap_servers: {address!r} is not HOST:PORT"
        try:
            socket.create_connection((host, int(port)), timeout=timeout_s).close()
            return None
        except OSError as error:
            tried.append(f"{address}: {error.strerror or type(error).__name__}")
    return (f"cannot reach the brokers at {bootstrap_servers} ({'; '.join(tried)}); start them, or fix "
            "--bootstrap-servers / kafka.bootstrap_servers")
