"""`kev demo` serves its worker's metrics as `kev serve` does, and says where: `kev top` can watch it."""

from __future__ import annotations

import re
import signal
import socket

import pytest

pytest.register_assert_rewrite("gateway_fixtures")
from gateway_fixtures import SESSION_ENV  # noqa: E402
from polling import eventually_sync  # noqa: E402

from kev_async.cli import main as kev_main  # noqa: E402
from kev_async.cli.demo import _metrics_port  # noqa: E402
from schemas import MetricsConfig  # noqa: E402

pytest_plugins = ["serve_fixtures", "gateway_fixtures"]


def test_the_demo_keeps_a_free_metrics_port_and_moves_off_a_taken_one():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        moved = _metrics_port(MetricsConfig(port=port))
        assert moved not in (0, port)  # a running worker holds the configured port: the demo takes another
    assert _metrics_port(MetricsConfig(port=port)) == port
    assert _metrics_port(MetricsConfig(port=0)) == 0  # metrics off stays off


@pytest.mark.kafka
def test_kev_top_watches_kev_demo(tiny_model_dir, tmp_path, capsys):
    from serve_fixtures import KevProcess, kev_env, kev_processes, says

    args = ["demo", "--http", "--port", "0", "--questions", "2", "--max-new-tokens", "4",
            "--model", str(tiny_model_dir)]
    with socket.socket() as taken, kev_processes() as children:
        taken.bind(("127.0.0.1", 0))  # metrics.port held by someone else, as by a running `kev serve`
        taken.listen()
        env = kev_env(**SESSION_ENV, KEV_METRICS__PORT=str(taken.getsockname()[1]))
        demo = KevProcess(args, env, tmp_path / "demo.log")
        children.append(demo)
        eventually_sync(lambda: says(demo, "kev: serving until Ctrl-C"), timeout=120, every=0.2, what=demo.describe)
        said = re.search(r"kev: worker metrics on (\S+) \(watch them: kev top --url (\S+)\)", demo.log())
        assert said and said[1] == said[2], demo.describe()
        assert f":{taken.getsockname()[1]}/" not in said[1]
        assert kev_main(["top", "--once", "--url", said[1], "--interval", "0.05"]) == 0
        frame = capsys.readouterr().out
        assert re.search(r"kv blocks\s+used \d+\s+free \d+", frame), frame
        assert re.search(r"tokens\s+generated [1-9]", frame), frame
        demo.signal(signal.SIGINT)
        assert demo.wait(60) == 0, demo.describe()
