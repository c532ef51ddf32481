"""PiDriver.plan: the launch spec (command line, environment, config files, prechecks)."""

from __future__ import annotations

import json

import pytest

from drivers.models import GatewayConfig, Locator, MemberPaths
from drivers.pi import PiDriver
from drivers.pi.launch import HERMETIC_FLAGS, KEY_ENV

SECRET = "sk-pi-canary-7f3a91"
PATHS = MemberPaths(home="/h/m1", workspace="/w/chat", run_dir="/r/m1")
GW = GatewayConfig(base_url="http://127.0.0.1:4000/", key=SECRET, model="fixture-model")


def files(launch) -> dict[str, dict]:
    return {f.path.rsplit("/", 1)[1]: json.loads(f.content) for f in launch.spec.files}


def test_new_plan() -> None:
    launch = PiDriver().plan(PATHS, GW, None)
    spec = launch.spec
    assert launch.expected is None and not launch.resume
    assert spec.argv[:3] == ["pi", "--mode", "rpc"] and all(f in spec.argv for f in HERMETIC_FLAGS)
    path = spec.argv[spec.argv.index("--session") + 1]
    assert path.startswith("/h/m1/.pi/agent/sessions/") and path.endswith(".jsonl")
    assert spec.argv[spec.argv.index("--session-dir") + 1] == "/h/m1/.pi/agent/sessions"
    assert spec.cwd == "/w/chat"
    assert spec.env["HOME"] == "/h/m1" and spec.env["PI_CODING_AGENT_DIR"] == "/h/m1/.pi/agent"
    assert spec.env["PI_OFFLINE"] == "1"
    assert spec.require_files == [] and spec.require_header is None
    assert PiDriver().plan(PATHS, GW, None).spec.argv != spec.argv  # a fresh path every time


def test_config_files() -> None:
    f = files(PiDriver().plan(PATHS, GW, None))
    provider = f["models.json"]["providers"]["gateway"]
    assert provider["api"] == "anthropic-messages" and provider["baseUrl"] == "http://127.0.0.1:4000"
    # the variable's name: pi looks it up in its environment on every request, without a shell
    # (`!printenv` cost an execSync per request); the value stays out of every file
    assert provider["apiKey"] == KEY_ENV
    assert provider["models"][0]["id"] == "fixture-model"
    settings = f["settings.json"]
    assert settings["defaultProvider"] == "gateway" and settings["defaultModel"] == "fixture-model"
    assert settings["enableInstallTelemetry"] is False and settings["quietStartup"] is True
    assert settings["shellCommandPrefix"] == f"unset {KEY_ENV}"
    assert settings["retry"] == {"enabled": True, "maxRetries": 3, "baseDelayMs": 1000, "provider": {"maxRetries": 0}}
    tuned = files(PiDriver(retry_max=1, retry_base_delay_ms=50, retry_enabled=False).plan(PATHS, GW, None))
    assert tuned["settings.json"]["retry"]["maxRetries"] == 1 and not tuned["settings.json"]["retry"]["enabled"]


def test_openai_shape() -> None:
    provider = files(PiDriver(api="openai-completions").plan(PATHS, GW, None))["models.json"]["providers"]["gateway"]
    assert provider["baseUrl"] == "http://127.0.0.1:4000/v1" and provider["compat"]["supportsDeveloperRole"] is False


def test_the_placeholder_key_only_in_its_env_variable() -> None:
    # SPEC 7: pi holds the sandbox's placeholder in its plain env; models.json reads it there
    launch = PiDriver().plan(PATHS, GW, Locator(id="01a2", path="/h/m1/.pi/agent/sessions/x.jsonl"))
    spec = launch.spec
    assert spec.env[KEY_ENV] == SECRET and not hasattr(spec, "secret_env")
    visible = json.dumps([spec.argv, [f.content for f in spec.files], spec.launcher_argv(pidfile="/r/p")])
    assert SECRET not in visible and "--secret-header" not in visible


def test_restored_plan_has_prechecks() -> None:
    loc = Locator(id="01a2-saved", path="/h/m1/.pi/agent/sessions/x.jsonl")
    launch = PiDriver().plan(PATHS, GW, loc)
    spec = launch.spec
    assert launch.resume and launch.expected == loc
    assert spec.argv[spec.argv.index("--session") + 1] == loc.path
    assert spec.require_files == [loc.path]
    assert (spec.require_header.path, spec.require_header.key, spec.require_header.value) == (loc.path, "id", loc.id)
    argv = spec.launcher_argv(pidfile="/r/p")
    assert argv[argv.index("--require-header") + 1: argv.index("--require-header") + 4] == [loc.path, "id", loc.id]
    assert PiDriver().plan_fork(PATHS, GW, loc).spec.require_header == spec.require_header


def test_locator_without_path_is_refused() -> None:
    with pytest.raises(ValueError):
        PiDriver().plan(PATHS, GW, Locator(id="01a2"))


def test_registry() -> None:
    from drivers.registry import get_driver

    assert isinstance(get_driver("pi"), PiDriver)
