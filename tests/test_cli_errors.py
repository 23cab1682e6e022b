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
