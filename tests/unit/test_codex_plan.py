"""The Codex launch plan and config.toml (no process)."""

from __future__ import annotations

import tomllib

import pytest

from drivers.codex import CodexDriver
from drivers.codex.wire import resume_failure
from drivers.codex.launch import KEY_ENV, PROVIDER_ID, CodexSettings, render_config
from drivers.models import GatewayConfig, HandshakeReason, Locator, MemberPaths
from drivers.registry import get_driver

KEY = "sk-unit-canary-3f9a"
PATHS = MemberPaths(home="/home/agent/members/m1", workspace="/home/agent/workspace", run_dir="/home/agent/run/m1")
GW = GatewayConfig(base_url="http://127.0.0.1:8931", key=KEY, model="fixture-codex")


def config(paths: MemberPaths = PATHS, gw: GatewayConfig = GW, **kw) -> dict:
    return tomllib.loads(render_config(paths, gw, CodexSettings(**kw)))


def test_registry_returns_the_codex_driver() -> None:
    assert isinstance(get_driver("codex"), CodexDriver)


def test_new_plan_runs_the_native_binary_with_an_isolated_fixed_home() -> None:
    launch = CodexDriver().plan(PATHS, GW, None)
    spec = launch.spec
    assert launch.expected is None and launch.resume is False
    assert spec.argv == ["codex-native", "app-server", "--strict-config"]
    assert spec.cwd == PATHS.workspace
    assert spec.env == {"CODEX_HOME": "/home/agent/members/m1/.codex", "HOME": PATHS.home, KEY_ENV: KEY}
    assert [f.path for f in spec.files] == ["/home/agent/members/m1/.codex/config.toml"]
    assert spec.files[0].overwrite is True
    assert {"/home/agent/members/m1/.codex", PATHS.workspace, PATHS.run_dir} <= set(spec.dirs)


def test_restored_plan_expects_the_saved_thread() -> None:
    loc = Locator(id="01a2297e-8a4e-7f20-ac95-05a8773a5d02")
    launch = CodexDriver().plan(PATHS, GW, loc)
    assert launch.expected == loc and launch.resume is True
    assert CodexDriver().plan_fork(PATHS, GW, loc) == launch


def test_the_placeholder_key_travels_only_in_the_env_key_variable() -> None:
    # SPEC 7: the key a CLI holds is the sandbox's placeholder, set in its plain env (no stdin
    # secret header any more); it stays off the command line and out of every file
    spec = CodexDriver().plan(PATHS, GW, None).spec
    assert spec.env[KEY_ENV] == KEY and not hasattr(spec, "secret_env")
    visible = " ".join([*spec.argv, *(f.content for f in spec.files), " ".join(spec.launcher_argv(pidfile="/p"))])
    assert KEY not in visible and "--secret-header" not in visible
    assert config()["model_providers"][PROVIDER_ID]["env_key"] == KEY_ENV


def test_config_contents() -> None:
    cfg = config(request_max_retries=2, stream_max_retries=1, stream_idle_timeout_ms=4321)
    assert cfg["model"] == "fixture-codex" and cfg["model_provider"] == PROVIDER_ID
    assert cfg["approval_policy"] == "never" and cfg["sandbox_mode"] == "danger-full-access"
    assert cfg["web_search"] == "disabled"
    assert cfg["features"] == {"plugins": False}
    assert cfg["analytics"] == {"enabled": False}
    assert KEY_ENV in cfg["shell_environment_policy"]["exclude"]
    provider = cfg["model_providers"][PROVIDER_ID]
    assert provider["base_url"] == "http://127.0.0.1:8931/v1"
    assert provider["wire_api"] == "responses"
    assert (provider["request_max_retries"], provider["stream_max_retries"], provider["stream_idle_timeout_ms"]) == (
        2, 1, 4321)
    assert cfg["projects"] == {PATHS.workspace: {"trust_level": "untrusted"}}
    assert config(trust_workspace=True)["projects"][PATHS.workspace]["trust_level"] == "trusted"


def test_base_url_with_trailing_slash_and_model_override() -> None:
    gw = GatewayConfig(base_url="http://127.0.0.1:8931/", key=KEY, model="m")
    cfg = config(gw=gw, model="gpt-5.5")
    assert cfg["model_providers"][PROVIDER_ID]["base_url"] == "http://127.0.0.1:8931/v1"
    assert cfg["model"] == "gpt-5.5"


@pytest.mark.parametrize("workspace", ['/w/with "quotes" and \\back', "/w/中文 😀", "/w/del\x7f/tab\t", "/w/]]=x"])
def test_odd_workspace_paths_round_trip_through_toml(workspace: str) -> None:
    paths = MemberPaths(home="/h", workspace=workspace, run_dir="/r")
    assert list(config(paths=paths)["projects"]) == [workspace]


def test_relative_home_is_refused() -> None:
    with pytest.raises(ValueError, match="absolute"):
        CodexDriver().plan(MemberPaths(home="rel/home", workspace="/w", run_dir="/r"), GW, None)


def test_driver_overrides() -> None:
    d = CodexDriver(binary="/opt/codex", stream_idle_timeout_ms=1000)
    assert d.plan(PATHS, GW, None).spec.argv[0] == "/opt/codex"
    assert d.settings.stream_idle_timeout_ms == 1000


@pytest.mark.parametrize(("message", "reason"), [
    ("no rollout found for thread id 01a2297e-8a4e-7000-8000-000000000000", HandshakeReason.NATIVE_STATE_MISSING),
    ("invalid session id: invalid character: expected an optional prefix of `urn:uuid:`",
     HandshakeReason.NATIVE_STATE_MISSING),
    ("thread 01a2297e-8a4e-7000 already has an active writer", HandshakeReason.PROCESS_FAILED),
    ("Not initialized", HandshakeReason.PROCESS_FAILED),
])
def test_resume_failure_mapping(message: str, reason: HandshakeReason) -> None:
    assert resume_failure(message) is reason
