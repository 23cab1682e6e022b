"""metrics.host: the endpoint binds where the config says (review finding: it bound 127.0.0.1 only)."""

import socket

import anyio
import pytest

from kev_async.observe.metrics import Metrics
from schemas import config_from_dict

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


def outward_address() -> str | None:
    """This host's address on its default route (no packet is sent), or None with loopback only."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


async def get_metrics(host: str, port: int) -> bytes:
    stream = await anyio.connect_tcp(host, port)
    async with stream:
        await stream.send(b"GET /metrics HTTP/1.0\r\n\r\n")
        chunks = []
        try:
            while True:
                chunks.append(await stream.receive())
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    return b"".join(chunks)


def test_config_has_metrics_host_defaulting_to_loopback():
    assert config_from_dict({}).metrics.host == "127.0.0.1"
    assert config_from_dict({"metrics": {"host": "0.0.0.0"}}).metrics.host == "0.0.0.0"


async def test_metrics_host_all_interfaces_is_reachable_from_outside_loopback():
    address = outward_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 address on this host")
    async with Metrics().endpoint(_free_port(), host="0.0.0.0") as port:
        response = await get_metrics(address, port)
    assert response.startswith(b"HTTP/1.1 200") and b"kev_kv_blocks_free" in response
    # The default stays loopback only: the same request from outside is refused.
    async with Metrics().endpoint(_free_port()) as port:
        with pytest.raises(OSError):
            await get_metrics(address, port)
        assert (await get_metrics("127.0.0.1", port)).startswith(b"HTTP/1.1 200")


def test_serve_passes_metrics_host_to_the_endpoint():
    # The wiring is one line in kev_async/app.py; read it rather than start a whole worker.
    import inspect

    from kev_async import app

    assert "metrics.endpoint(cfg.metrics.port, cfg.metrics.host)" in inspect.getsource(app.serve)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
