"""kev.yaml loading, KEV_* overrides, and `kev config check` as an operator sees them."""

from pathlib import Path

import pytest
import yaml

from engine.model.loader import BUILTIN_MODELS
from kev_async.cli import main
from kev_async.settings import load_config, resolved_dict
from schemas import DEFAULT_MODEL, ConfigError, KevConfig, SchedulerConfig, config_from_dict

EXAMPLE = Path(__file__).resolve().parent.parent / "ops" / "kev.yaml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kev.yaml"
    path.write_text(text)
    return path


def problems(error: pytest.ExceptionInfo) -> dict[str, str]:
    return dict(error.value.problems)


def test_no_file_and_empty_file_mean_defaults(tmp_path):
    assert load_config(env={}) == KevConfig()
    assert load_config(write(tmp_path, ""), env={}) == KevConfig()
    assert config_from_dict({}) == KevConfig()


def test_the_default_model_is_the_built_in_one():
    assert KevConfig().core.model_path == DEFAULT_MODEL and DEFAULT_MODEL in BUILTIN_MODELS


def test_section_with_every_key_commented_out_means_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "scheduler:\n  # batch_window_ms: 5\n"), env={})
    assert cfg.scheduler == SchedulerConfig()


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="file not found") as error:
        load_config(tmp_path / "nope.yaml", env={})
    assert error.value.source.endswith("nope.yaml")


def test_broken_yaml_names_the_line(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML at line 2"):
        load_config(write(tmp_path, "scheduler:\n  policy: a: b\n"), env={})


def test_an_unquoted_off_is_told_to_be_quoted(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, "speculative:\n  method: off\n"), env={})
    assert problems(error) == {"speculative.method": "expected str, got bool false (YAML reads unquoted off, on, no "
                                                     "and yes as booleans: quote the word, e.g. 'off')"}


def test_example_config_loads_and_documents_every_key():
    cfg = load_config(EXAMPLE, env={})
    assert cfg == KevConfig()  # the example spells out the defaults
    assert yaml.safe_load(EXAMPLE.read_text()) == resolved_dict(cfg)


def test_bad_value_names_its_key_path(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, "scheduler: {batch_window_ms: -1}\n"), env={})
    assert problems(error) == {"scheduler.batch_window_ms": "-1 is below 0 (allowed: 0 to 1000)"}


def test_typo_is_rejected_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, "kafka:\n  secruity: {}\n"), env={})
    assert "did you mean 'security'" in problems(error)["kafka.secruity"]


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as error:
        config_from_dict({"router": {"strategy": "random"}, "metrics": {"port": 70000}, "colour": 1})
    assert set(problems(error)) == {"router.strategy", "metrics.port", "colour"}
    assert "'random' is not one of" in problems(error)["router.strategy"]


def test_env_overrides_file_values(tmp_path):
    path = write(tmp_path, "scheduler: {batch_window_ms: 20}\nsampling: {temperature: 0.2}\n")
    env = {
        "KEV_SCHEDULER__BATCH_WINDOW_MS": "5",
        "KEV_TEMPERATURE": "0.7",
        "KEV_MODEL": "/models/tiny",
        "KEV_BOOTSTRAP_SERVERS": "broker:9092",
        "KEV_LOG_LEVEL": "debug",
        "KEV_KAFKA__SECURITY__SASL_MECHANISM": "PLAIN",
        "KEV_ISOLATION__DETERMINISTIC": "true",
        "KEV_CACHE_DIR": "/tmp/not-a-config-key",  # plain KEV_ names are someone else's
    }
    cfg = load_config(path, env=env)
    assert cfg.scheduler.batch_window_ms == 5.0
    assert cfg.sampling.temperature == 0.7
    assert cfg.core.model_path == "/models/tiny"
    assert cfg.kafka.bootstrap_servers == "broker:9092"
    assert cfg.logging.level == "debug"
    assert cfg.kafka.security.sasl_mechanism == "PLAIN"
    assert cfg.isolation.deterministic is True


def test_env_strings_that_look_like_numbers_stay_strings():
    cfg = load_config(env={"KEV_KAFKA__GROUP_ID": "007", "KEV_KAFKA__SECURITY__SASL_PLAIN_PASSWORD": "123456"})
    assert cfg.kafka.group_id == "007"
    assert cfg.kafka.security.sasl_plain_password == "123456"
    assert resolved_dict(cfg)["kafka"]["security"]["sasl_plain_password"] == "***"


def test_bad_env_value_names_key_and_variable():
    with pytest.raises(ConfigError) as error:
        load_config(env={"KEV_TEMPERATURE": "hot"})
    reason = problems(error)["sampling.temperature"]
    assert "got str 'hot'" in reason and "KEV_TEMPERATURE" in reason


def test_env_naming_an_unknown_key_is_an_error():
    with pytest.raises(ConfigError) as error:
        load_config(env={"KEV_SCHEDULER__BATCH_WINDOW": "5"})
    assert "KEV_SCHEDULER__BATCH_WINDOW" in problems(error)["scheduler.batch_window"]


def test_config_check_prints_resolved_yaml(capsys):
    assert main(["config", "check", str(EXAMPLE), "--no-env"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["scheduler"]["batch_window_ms"] == 10.0
    assert printed["kafka"]["security"]["security_protocol"] == "PLAINTEXT"


def test_config_check_reports_broken_file_and_exits_2(tmp_path, capsys):
    path = write(tmp_path, "scheduler: {batch_window_ms: -1}\nlogging: {level: loud}\n")
    assert main(["config", "check", str(path), "--no-env"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(f"{path}: scheduler.batch_window_ms: -1 is below 0")
    assert lines[1].startswith(f"{path}: logging.level: 'loud' is not one of")


def test_cli_help_and_version(capsys):
    assert main(["--help"]) == 0
    assert "language model" in capsys.readouterr().out
    assert main(["version"]) == 0
    assert capsys.readouterr().out.startswith("kev ")
    assert main([]) == 2
