"""ops/compose.gateway.yml, checked by reading it (no docker here) and by running the one command of it
that makes its trust keys: no secret is written in the file, the gateway is published on the loopback
only, and the key files it makes let the gateway sign questions and cancels that workers verify, while
workers cannot sign anything and the gateway cannot command the fleet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from schemas import TrustConfig
from schemas.signing import CANCEL, CONTROL, QUESTION, Signer, TrustKeyError, Verifier

COMPOSE = Path(__file__).resolve().parents[1] / "ops" / "compose.gateway.yml"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_no_trust_secret_is_written_in_the_file_and_the_gateway_listens_on_the_hosts_loopback(compose):
    services = compose["services"]
    for name, service in services.items():
        env = service.get("environment", {})
        assert "KEV_KAFKA__TRUST__KEYS" not in env, f"{name} carries a trust key in the compose file"
    assert services["gateway"]["ports"] == ["127.0.0.1:8000:8000"]
    assert "ports" not in services["kafka"] and "ports" not in services["worker"]
    # The private half only where it signs, the public half only where it verifies.
    assert services["gateway"]["volumes"] == ["gateway-key:/gateway-key:ro"]
    assert services["worker"]["volumes"] == ["worker-keys:/worker-keys:ro"]
    for name in ("gateway", "worker"):
        assert services[name]["depends_on"]["trust-keys"] == {"condition": "service_completed_successfully"}


def test_the_keys_the_compose_file_makes_sign_and_verify_as_it_says(compose, tmp_path):
    services = compose["services"]
    command = services["trust-keys"]["command"]
    mounts = {volume.split(":")[1]: tmp_path / volume.split(":")[0] for volume in services["trust-keys"]["volumes"]}
    for folder in mounts.values():
        folder.mkdir()

    def here(path: str) -> str:  # a path inside the container, on this machine
        for inside, outside in mounts.items():
            if path.startswith(inside + "/"):
                return str(outside / path[len(inside) + 1:])
        return path

    argv = [sys.executable, "-m", "kev_async.cli", *command[1:]]
    argv = [here(arg) if arg.startswith("/") else arg for arg in argv]
    first = subprocess.run(argv, capture_output=True, text=True, check=True)
    made = {p: p.read_text() for p in tmp_path.rglob("keys.yaml")}
    again = subprocess.run(argv, capture_output=True, text=True, check=True)  # a second `up`: the pair is kept
    assert "kept" in again.stdout and made == {p: p.read_text() for p in tmp_path.rglob("keys.yaml")}, first.stdout

    gateway = TrustConfig(keys_file=here(services["gateway"]["environment"]["KEV_KAFKA__TRUST__KEYS_FILE"]))
    worker = TrustConfig(keys_file=here(services["worker"]["environment"]["KEV_KAFKA__TRUST__KEYS_FILE"]))
    assert oct(Path(gateway.keys_file).stat().st_mode & 0o777) == "0o600"
    signer, verifier = Signer.from_config(gateway), Verifier.from_config(worker)
    for purpose in (QUESTION, CANCEL):
        headers = signer.headers(purpose, "kev.questions", b"q1", b"{}")
        assert verifier.verify(purpose, "kev.questions", b"q1", b"{}", headers).trusted
    with pytest.raises(TrustKeyError):
        signer.headers(CONTROL, "kev.control", b"defaults:temperature", b"{}")
    with pytest.raises(TrustKeyError, match="cannot sign"):
        Signer.from_config(worker)
