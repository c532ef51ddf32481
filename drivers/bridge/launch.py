"""OpenCode / Kilo: the launch of the in-sandbox live bridge (``http-agent-live-bridge``).

OpenCode and Kilo have no stdio protocol: each serves a local HTTP API plus one SSE stream.
The bridge (images/sandbox/helpers/http-agent-live-bridge) runs inside the sandbox, starts
the server offline and speaks JSON lines, so this driver works over the same
:class:`~drivers.transport.Transport` as every other one. The session logic (handshake,
turns, settlement mapping) is in :mod:`drivers.bridge.session`, the line parsing in
:mod:`drivers.bridge.wire`.

Offline configuration (protocols/opencode-kilo.md sections 3-4, 11): HOME and every XDG_*
directory under the member home; the config arrives inline (``*_CONFIG_CONTENT``) with one
``@ai-sdk/openai-compatible`` provider on the gateway, whose key is referenced as
``{env:CA_GATEWAY_KEY}`` and delivered only through the launcher's secret header; model
catalogue fetch, autoupdate, LSP downloads and sharing are off; OpenCode's config dir carries
a pre-seeded plugin lockfile so it never calls registry.npmjs.org; Kilo's telemetry, session
ingest and daemon are off.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from drivers.base import Launch
from drivers.launch import FileSpec, LaunchSpec
from drivers.models import GatewayConfig, Locator, MemberPaths

BRIDGE_COMMAND = "http-agent-live-bridge"
KEY_ENV = "CA_GATEWAY_KEY"
PROVIDER_ID = "gateway"
IMAGE_PATH = "/usr/local/bin:/usr/local/sbin:/usr/bin:/usr/sbin:/bin:/sbin"
# OpenCode's @opencode-ai/plugin dependency install (arborist, network) is skipped when the
# config dir's lockfile already lists the plugin (protocols/opencode-kilo.md section 4).
PLUGIN_VERSION = "1.18.33"
DEFAULT_LIMITS = {"context": 128000, "output": 8192}


def xdg_env(home: str) -> dict[str, str]:
    return {
        "HOME": home,
        "XDG_CONFIG_HOME": f"{home}/.config",
        "XDG_DATA_HOME": f"{home}/.local/share",
        "XDG_CACHE_HOME": f"{home}/.cache",
        "XDG_STATE_HOME": f"{home}/.local/state",
    }


def native_db(runtime: str, home: str) -> str:
    """The CLI's SQLite store: a RESTORED member's native state must exist before the start."""
    name = "opencode" if runtime == "opencode" else "kilo"
    return f"{home}/.local/share/{name}/{name}.db"


def server_config(gateway: GatewayConfig, *, limits: Mapping[str, int] | None = None,
                  overrides: Mapping[str, Any] | None = None, compaction: bool = False) -> dict[str, Any]:
    model = gateway.model
    config: dict[str, Any] = {
        "$schema": "https://opencode.ai/config.json",
        "model": f"{PROVIDER_ID}/{model}",
        "small_model": f"{PROVIDER_ID}/{model}",
        "autoupdate": False,
        "share": "disabled",
        "enabled_providers": [PROVIDER_ID],
        # Both CLIs answer a context-window refusal by compacting on their own (summary requests,
        # a synthetic "What did we do so far?" user message, a retry), which rewrites the history
        # the next request carries and hides the refusal. Off (CLOUD_AGENT_NATIVE_COMPACTION): the
        # refusal settles the turn as context_too_long and the history stays verbatim; pruning old
        # tool output is part of it. On: the CLIs' defaults.
        "compaction": {"auto": compaction, "prune": compaction},
        "provider": {
            PROVIDER_ID: {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Gateway",
                "options": {"baseURL": gateway.base_url.rstrip("/") + "/v1", "apiKey": "{env:" + KEY_ENV + "}"},
                "models": {model: {"name": model, "tool_call": True, "limit": dict(limits or DEFAULT_LIMITS)}},
            }
        },
    }
    config.update(overrides or {})
    return config


def plan(runtime: str, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None, *,
         bridge_args: Sequence[str] = (), config_overrides: Mapping[str, Any] | None = None, path: str = IMAGE_PATH,
         limits: Mapping[str, int] | None = None, bridge_command: Sequence[str] = (BRIDGE_COMMAND,),
         compaction: bool = False) -> Launch:
    home = paths.home
    xdg = xdg_env(home)
    prefix = "OPENCODE" if runtime == "opencode" else "KILO"
    config = server_config(gateway, limits=limits, overrides=config_overrides, compaction=compaction)
    env = {"PATH": path, "LANG": "C.UTF-8", **xdg,
           f"{prefix}_CONFIG_CONTENT": json.dumps(config),
           f"{prefix}_DISABLE_MODELS_FETCH": "1", f"{prefix}_DISABLE_AUTOUPDATE": "1",
           f"{prefix}_DISABLE_LSP_DOWNLOAD": "1", f"{prefix}_DISABLE_SHARE": "1"}
    files: list[FileSpec] = []
    dirs = [home, *xdg.values(), paths.workspace, paths.run_dir]
    if runtime == "opencode":
        cfg_dir = f"{xdg['XDG_CONFIG_HOME']}/opencode"
        dirs.append(f"{cfg_dir}/node_modules")
        dep = {"@opencode-ai/plugin": PLUGIN_VERSION}
        files += [
            FileSpec(path=f"{cfg_dir}/package.json", content=json.dumps({"dependencies": dep}) + "\n"),
            FileSpec(path=f"{cfg_dir}/package-lock.json",
                     content=json.dumps({"lockfileVersion": 3, "packages": {"": {"dependencies": dep}}}) + "\n"),
        ]
    else:
        env.update(KILO_TELEMETRY_LEVEL="off", KILO_DISABLE_SESSION_INGEST="1", KILO_NO_DAEMON="1")
    spec = LaunchSpec(
        runtime=runtime,
        argv=[*bridge_command, "--runtime", runtime, *bridge_args],
        cwd=paths.workspace,
        # the placeholder the model proxy swaps for the real key (SPEC 7): not a secret
        env={**env, KEY_ENV: gateway.key.get_secret_value()},
        files=files,
        dirs=dirs,
        require_files=[native_db(runtime, home)] if resume is not None else [],
    )
    return Launch(spec=spec, expected=resume, resume=resume is not None)
