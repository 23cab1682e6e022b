"""A user's mistake on the command line is one line on stderr and exit 2, never a traceback."""

from __future__ import annotations

import time

from kev_async.cli import main


def test_a_bad_sampling_argument_is_refused_before_the_model_loads(capsys):
    started = time.monotonic()
    assert main(["ask", "--temperature", "-1", "hi"]) == 2
    assert time.monotonic() - started < 5  # the model (seconds to load) was never touched
    assert capsys.readouterr().err == "kev ask: --temperature: -1 is below 0 (allowed: 0 to 10)\n"


def test_an_unknown_model_is_one_line(capsys):
    assert main(["ask", "--model", "nosuchmodel", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kev ask: model 'nosuchmodel' is not") and err.count("\n") == 1


def test_a_bad_config_key_is_one_line_per_problem(capsys, tmp_path):
    bad = tmp_path / "kev.yaml"
    bad.write_text("core:\n  nosuch: 1\n")
    for command in ("serve", "demo"):
        assert main([command, "--config", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kev {command}: {bad}: core.nosuch: unknown key") and "Traceback" not in err


def _kev(*args: str, **env: str):
    import subprocess

    from serve_fixtures import KEV, ROOT, kev_env

    return subprocess.run([str(KEV), *args], cwd=ROOT, env=kev_env(**env), capture_output=True, text=True,
                          timeout=120)


def test_a_port_taken_or_no_broker_is_one_line_before_the_model_loads():
    """Said before anything starts: exit 1 (the host refuses the start, not the config), one line. Found after
    the model loaded, each was a traceback of 40 to 120 lines."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = [
            (("serve",), {"KEV_METRICS__PORT": port},
             f"kev serve: cannot listen on 127.0.0.1:{port} for the metrics endpoint (Address already in use); "
             "set metrics.port"),
            (("serve", "--bootstrap-servers", "127.0.0.1:1"), {},
             "kev serve: cannot reach the brokers at 127.0.0.1:1 (127.0.0.1:1: Connection refused)"),
            (("serve",), {"KEV_BROKER__PORT": port},
             f"kev serve: cannot listen on 127.0.0.1:{port} for the embedded broker (Address already in use)"),
            (("demo", "--http", "--port", port), {},
             f"kev demo: cannot listen on 127.0.0.1:{port} for the gateway (Address already in use)"),
        ]
        for args, env, said in cases:
            done = _kev(*args, **env)
            assert (done.returncode, done.stderr.count("\n")) == (1, 1), done.stderr
            assert done.stderr.startswith(said), done.stderr
