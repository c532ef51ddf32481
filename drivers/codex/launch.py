"""The Codex launch plan: where its state lives and the ``config.toml`` it runs with.

Decisions (protocols/codex.md §2, §7, §10; re-measured on 0.171.0):

* **CODEX_HOME** is ``<paths.home>/.codex``, a fixed absolute path: the sqlite side-state
  pins absolute rollout paths, so a relocated home silently resumes the wrong file or loses
  the thread. ``HOME`` is ``paths.home`` too (never /tmp: Codex refuses helper binaries there).
* **config.toml is owned by the driver and rewritten at every launch** (``overwrite=True``).
  Keeping the first write (``overwrite=False``) would freeze the gateway URL, key variable
  name and retry budget of the first launch: a sandbox restored after the gateway moved
  would talk to the old address. Codex's own write — the ``[projects."<cwd>"]`` trust entry
  it appends on ``thread/start`` in a git workspace — is *answered in advance*: the file
  already names the workspace, and 0.171 then leaves the file byte-for-byte unchanged
  (measured). Nothing else was seen appended, so the rewrite loses nothing.
* The workspace is declared ``untrusted`` by default. Measured on 0.171: a *trusted*
  project loads ``<workspace>/.codex/config.toml``, which overrode ``model`` (and could
  override the provider's ``base_url`` — sending the gateway key elsewhere). The workspace
  is shared by a chat's members and written by models, so it must not configure Codex.
  Side effect: ``AGENTS.md`` in the workspace is not loaded either (``trust_workspace=True``
  restores Codex's default behaviour).
* **Model slug**: ``gateway.model`` verbatim. The gateway routes on the name, so a bundled
  Codex slug would be a lie to it; the price is one ``warning`` notification per turn
  ("Model metadata for … not found"), surfaced as a ``Notice`` and never as a failure.
* The gateway key reaches Codex only as the environment variable named by ``env_key``,
  set in its plain environment: it is the sandbox's placeholder, the model proxy holds the real key.
"""

from __future__ import annotations

import json
import posixpath

from pydantic import BaseModel, ConfigDict, Field

from drivers.base import Launch
from drivers.launch import FileSpec, LaunchSpec
from drivers.models import GatewayConfig, Locator, MemberPaths

RUNTIME = "codex"
KEY_ENV = "CLOUD_AGENT_CODEX_API_KEY"
PROVIDER_ID = "cloud_agent"


class CodexSettings(BaseModel):
    """Tunables of the Codex launch (all bounded: Codex's defaults retry for ~25 s per turn)."""

    model_config = ConfigDict(frozen=True)

    binary: str = "codex-native"  # the musl binary itself: no Node launcher in between
    model: str | None = None  # None: gateway.model
    # Codex caps both retry counts at 100 and retries with exponential backoff from 200 ms;
    # with 3/3 a dead gateway fails the turn in seconds instead of ~25 s (defaults 4/5).
    request_max_retries: int = Field(default=3, ge=0, le=100)
    stream_max_retries: int = Field(default=3, ge=0, le=100)
    stream_idle_timeout_ms: int = Field(default=120_000, ge=1_000)
    trust_workspace: bool = False
    client_name: str = "cloud_agent"  # clientInfo.name; Codex sends it upstream as `originator`
    handshake_timeout_s: float = 60.0
    interrupt_grace_s: float = 5.0


def codex_home(paths: MemberPaths) -> str:
    if not posixpath.isabs(paths.home):
        raise ValueError(f"paths.home must be absolute (Codex pins absolute rollout paths): {paths.home!r}")
    return posixpath.join(paths.home, ".codex")


def toml_str(value: str) -> str:
    """A TOML basic string (JSON escapes minus the ones TOML lacks; DEL must be escaped)."""
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


# Codex 0.171 has no switch for its compaction: after a context-window refusal it marks its usage
# as the full model window, and the next turn's pre-sampling check compacts because the usage is
# past min(model_auto_compact_token_limit, 90% of the window): the configured limit is clamped
# (measured with it at i64::MAX, with and without model_auto_compact_token_limit_scope "total":
# the summary request still came; tests/regression/test_compaction.py). With native compaction off the driver therefore
# cannot prevent it; the turn that compacted says so (Settlement.compacted) and the receipt shows it.


def render_config(paths: MemberPaths, gateway: GatewayConfig, settings: CodexSettings) -> str:
    base_url = gateway.base_url.rstrip("/") + "/v1"
    model = settings.model or gateway.model
    trust = "trusted" if settings.trust_workspace else "untrusted"
    lines = [
        "# Written by cloud-agent at every launch; edits are overwritten.",
        f"model = {toml_str(model)}",
        f"model_provider = {toml_str(PROVIDER_ID)}",
        'approval_policy = "never"',
        # bubblewrap cannot create namespaces in an unprivileged container: the container
        # is the boundary (protocols/codex.md §10).
        'sandbox_mode = "danger-full-access"',
        'web_search = "disabled"',
        "",
        "[features]",
        "plugins = false  # no plugin sync with github.com / chatgpt.com",
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[shell_environment_policy]",
        "# tool commands never see the gateway key (Codex already drops *KEY* names; be explicit)",
        f"exclude = [{toml_str(KEY_ENV)}]",
        "",
        f"[model_providers.{PROVIDER_ID}]",
        'name = "cloud-agent gateway"',
        f"base_url = {toml_str(base_url)}",
        'wire_api = "responses"',
        f"env_key = {toml_str(KEY_ENV)}",
        f"request_max_retries = {int(settings.request_max_retries)}",
        f"stream_max_retries = {int(settings.stream_max_retries)}",
        f"stream_idle_timeout_ms = {int(settings.stream_idle_timeout_ms)}",
        "",
        "# Pre-answers the trust entry Codex would append on thread/start (see drivers/codex/launch.py).",
        f"[projects.{toml_str(paths.workspace)}]",
        f"trust_level = {toml_str(trust)}",
        "",
    ]
    return "\n".join(lines)


def config_file(paths: MemberPaths, gateway: GatewayConfig, settings: CodexSettings) -> FileSpec:
    # 0644: it holds no secret (the key is only an env var name here), and whoever writes
    # it (sandbox manager, test harness) may not be the uid Codex runs as.
    return FileSpec(path=posixpath.join(codex_home(paths), "config.toml"),
                    content=render_config(paths, gateway, settings), mode=0o644, overwrite=True)


def plan(settings: CodexSettings, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
    home = codex_home(paths)
    spec = LaunchSpec(
        runtime=RUNTIME,
        # --strict-config: a config field this version does not know fails the launch
        # instead of being silently ignored.
        argv=[settings.binary, "app-server", "--strict-config"],
        cwd=paths.workspace,
        # the placeholder the model proxy swaps for the real key (SPEC 7): not a secret
        env={"CODEX_HOME": home, "HOME": paths.home, KEY_ENV: gateway.key.get_secret_value()},
        files=[config_file(paths, gateway, settings)],
        dirs=[paths.home, home, paths.workspace, paths.run_dir],
    )
    return Launch(spec=spec, expected=resume, resume=resume is not None)
