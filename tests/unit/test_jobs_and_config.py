"""Job validation at the edge, configuration loading."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from runner.config import load_settings
from state.jobs import Job

BASE = {"job_id": "j-1", "user_id": "u1", "chat_id": "c1", "member_id": "m1", "runtime": "codex", "message": "hi"}


def fields_of(exc: ValidationError) -> list[str]:
    return [".".join(map(str, e["loc"])) for e in exc.errors()]


@pytest.mark.parametrize("field,value", [
    ("user_id", ""), ("chat_id", "../x"), ("member_id", "a b"), ("job_id", "a/b"), ("user_id", "$(id)"),
    ("chat_id", "x" * 129), ("runtime", "gpt"), ("message", ""), ("chat_id", "a..b"), ("user_id", "-leading"),
])
def test_bad_fields_are_named(field, value) -> None:
    with pytest.raises(ValidationError) as err:
        Job.model_validate({**BASE, field: value})
    assert field in fields_of(err.value)


def test_unknown_and_missing_fields_are_named() -> None:
    with pytest.raises(ValidationError) as err:
        Job.model_validate({**BASE, "extra": 1})
    assert fields_of(err.value) == ["extra"]
    body = dict(BASE)
    del body["member_id"]
    with pytest.raises(ValidationError) as err:
        Job.model_validate(body)
    assert fields_of(err.value) == ["member_id"]


def test_message_is_kept_byte_for_byte() -> None:
    msg = "  leading\n\n多段落 🎉\t{\"looks\": \"json\"}\n/help  \n"
    assert Job.model_validate({**BASE, "message": msg}).message == msg


def test_digest_distinguishes_bodies() -> None:
    a = Job.model_validate(BASE)
    assert a.digest() == Job.model_validate(dict(BASE)).digest()
    assert a.digest() != Job.model_validate({**BASE, "message": "hi "}).digest()


def test_settings_env_and_file(tmp_path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('turn_timeout_s = 12.5\n[models]\ncodex = "from-file"\n')
    s = load_settings({"CLOUD_AGENT_CONFIG": str(cfg), "CLOUD_AGENT_HOME": str(tmp_path),
                       "CLOUD_AGENT_MODEL_PI": "pi-env", "CLOUD_AGENT_TURN_TIMEOUT_S": "30"})
    assert (s.turn_timeout_s, s.models["codex"], s.models["pi"]) == (30.0, "from-file", "pi-env")
    assert s.socket_root == tmp_path / "sockets"
    long_home = tmp_path / ("h" * 80)
    with pytest.raises(ValueError, match=r"^home \(CLOUD_AGENT_HOME\): the model socket path would be \d+ bytes"):
        load_settings({"CLOUD_AGENT_HOME": str(long_home)}).check_socket_root()
    short = load_settings({"CLOUD_AGENT_HOME": str(long_home), "CLOUD_AGENT_SOCKET_DIR": "/tmp/s"})
    assert short.check_socket_root() == Path("/tmp/s")


@pytest.mark.parametrize("value", ["host", "none", "agents"])
def test_there_is_no_sandbox_network_setting(value, tmp_path) -> None:
    # SPEC 7/10: every sandbox is sealed; a leftover setting is an error, never ignored
    with pytest.raises(ValueError, match="CLOUD_AGENT_SANDBOX_NETWORK: removed"):
        load_settings({"CLOUD_AGENT_SANDBOX_NETWORK": value, "CLOUD_AGENT_HOME": str(tmp_path)})
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'sandbox_network = "{value}"\n')
    with pytest.raises(ValueError, match="sandbox_network"):
        load_settings({"CLOUD_AGENT_CONFIG": str(cfg), "CLOUD_AGENT_HOME": str(tmp_path)})


def test_secrets_never_in_repr(tmp_path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-very-secret-value\n")
    s = load_settings({"CLOUD_AGENT_GATEWAY_KEY_FILE": str(key), "CLOUD_AGENT_HOME": str(tmp_path)})
    assert s.gateway_key().get_secret_value() == "sk-very-secret-value"
    assert "sk-very-secret-value" not in repr(s.gateway_key()) + repr(s) + s.model_dump_json()
