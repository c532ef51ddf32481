"""Pi launch configuration: paths, ``models.json``, ``settings.json`` and the command line.

Decisions (measured on 0.73.1 against the loopback fixture, tests/cli/test_pi_driver.py):

* **API shape: ``anthropic-messages``** (``baseUrl`` = the gateway root; the SDK POSTs
  ``/v1/messages``). With ``openai-completions`` a stream that ends without
  ``finish_reason``/``[DONE]`` is taken as ``stopReason:"stop"`` — a truncated reply would
  settle as a success. The Anthropic provider reports the same cut as an error
  ("Anthropic stream ended before message_stop"). ``openai-completions`` stays available
  (``PiSettings.api``) for gateways without the Messages route.
* **API key: ``"CA_PI_GATEWAY_KEY"``, the variable's name.** pi resolves a ``models.json``
  ``apiKey`` on *every request* and without a cache (``model-registry`` calls
  ``resolveConfigValueUncached``). A name is looked up in ``process.env``; the ``!cmd`` form
  runs ``execSync`` in a shell each time, blocking pi's event loop: measured 6.3 ms of a 15 ms
  LIVE turn (the driver used ``!printenv`` until stop 26). A missing variable makes pi send the
  name itself as the key; that costs nothing now: the model proxy drops every credential a
  sandbox sends and sets the real key (SPEC 7), and the variable holds only the sandbox's
  placeholder.
* **Retries: pi's auto-retry stays on, bounded** (``retry.maxRetries``, ``baseDelayMs``
  doubling), and the SDK's own HTTP retries are off (``retry.provider.maxRetries: 0``) so every
  retry is a visible ``auto_retry_start`` inside the same native turn: a transient 5xx never
  forces the runner to resend the user's message, and the driver's barrier waits it out.
* ``shellCommandPrefix: "unset CA_PI_GATEWAY_KEY"``: pi's ``bash`` tool runs every command
  with pi's own environment, so a model-run ``env`` would copy the key into the tool
  result, the session file and the next model request. The prefix removes it from tool
  shells (a same-uid tool can still read ``/proc/<pi pid>/environ``: env delivery's limit).
* Static settings are rewritten on every launch: RPC ``set_*`` commands persist into
  ``settings.json`` (protocols/pi.md §8); the driver never sends them.
"""

from __future__ import annotations

import json
import posixpath
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict

from drivers.base import Launch
from drivers.launch import FileSpec, HeaderCheck, LaunchSpec
from drivers.models import GatewayConfig, Locator, MemberPaths

RUNTIME = "pi"
KEY_ENV = "CA_PI_GATEWAY_KEY"
PROVIDER = "gateway"
# Hermetic: no extensions/skills/prompt templates/AGENTS.md/themes from the workspace or home.
# --no-prompt-templates matters for fidelity: without it an RPC prompt "/name args" is
# expanded from <cwd>/.pi/prompts/name.md or <agentDir>/prompts/name.md (seen on 0.73.1).
HERMETIC_FLAGS = ("--no-extensions", "--no-skills", "--no-prompt-templates", "--no-context-files", "--no-themes")


class PiSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    binary: str = "pi"
    api: Literal["anthropic-messages", "openai-completions"] = "anthropic-messages"
    context_window: int = 200_000
    max_tokens: int = 8192
    retry_enabled: bool = True
    retry_max: int = 3
    retry_base_delay_ms: int = 1000
    handshake_timeout_s: float = 60.0
    abort_grace_s: float = 5.0  # how long a timed-out/cancelled turn waits for the abort to land
    extra_env: dict[str, str] = {}  # e.g. PATH for a CLI outside the image (host tests)


def agent_dir(paths: MemberPaths) -> str:
    """``PI_CODING_AGENT_DIR``: pi's default place relative to HOME (= paths.home)."""
    return posixpath.join(paths.home, ".pi", "agent")


def sessions_dir(paths: MemberPaths) -> str:
    return posixpath.join(agent_dir(paths), "sessions")


def new_session_path(paths: MemberPaths) -> str:
    """A fresh path: pi creates the NEW session at exactly this path (header written lazily)."""
    return posixpath.join(sessions_dir(paths), f"{uuid.uuid4().hex}.jsonl")


def models_json(gateway: GatewayConfig, settings: PiSettings) -> str:
    base = gateway.base_url.rstrip("/")
    provider: dict[str, object] = {
        "api": settings.api,
        "baseUrl": base if settings.api == "anthropic-messages" else f"{base}/v1",
        "apiKey": KEY_ENV,  # looked up in pi's environment per request: no shell (module docstring)
        "models": [{"id": gateway.model, "name": gateway.model, "reasoning": False, "input": ["text"],
                    "contextWindow": settings.context_window, "maxTokens": settings.max_tokens}],
    }
    if settings.api == "openai-completions":
        provider["compat"] = {"supportsDeveloperRole": False, "supportsReasoningEffort": False}
    return json.dumps({"providers": {PROVIDER: provider}}, indent=2) + "\n"


def settings_json(gateway: GatewayConfig, settings: PiSettings, *, compaction: bool = False) -> str:
    return json.dumps({
        "defaultProvider": PROVIDER,
        "defaultModel": gateway.model,
        "enableInstallTelemetry": False,
        "quietStartup": True,
        # pi's bash tool inherits pi's environment; drop the key variable from every tool
        # shell so an `env` run by the model never copies it into the transcript.
        "shellCommandPrefix": f"unset {KEY_ENV}",
        "retry": {"enabled": settings.retry_enabled, "maxRetries": settings.retry_max,
                  "baseDelayMs": settings.retry_base_delay_ms, "provider": {"maxRetries": 0}},
        # Off: neither the overflow recovery (a summary request, then the prompt re-run on the
        # compacted history) nor threshold compaction runs; a context-window 400 ends the turn.
        "compaction": {"enabled": compaction},
    }, indent=2) + "\n"


def config_files(paths: MemberPaths, gateway: GatewayConfig, settings: PiSettings, *,
                 compaction: bool = False) -> list[FileSpec]:
    root = agent_dir(paths)
    return [
        FileSpec(path=posixpath.join(root, "models.json"), content=models_json(gateway, settings)),
        FileSpec(path=posixpath.join(root, "settings.json"),
                 content=settings_json(gateway, settings, compaction=compaction)),
    ]


def environment(paths: MemberPaths, settings: PiSettings) -> dict[str, str]:
    return {
        **settings.extra_env,
        "HOME": paths.home,
        "PI_CODING_AGENT_DIR": agent_dir(paths),
        # No version check, no telemetry, no rg/fd downloads (protocols/pi.md §8).
        "PI_OFFLINE": "1",
        "PI_SKIP_VERSION_CHECK": "1",
        "PI_TELEMETRY": "0",
    }


def argv(settings: PiSettings, session_path: str, session_dir: str) -> list[str]:
    # --session-dir: where fork/clone write their new file (the member's own dir); it does not
    # move the --session file itself.
    return [settings.binary, "--mode", "rpc", *HERMETIC_FLAGS, "--session", session_path, "--session-dir", session_dir]


def planned_path(spec: LaunchSpec) -> str | None:
    """The ``--session`` path of a planned command line."""
    args = spec.argv
    for i, a in enumerate(args[:-1]):
        if a == "--session":
            return args[i + 1]
    return None


def plan(settings: PiSettings, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None, *,
         compaction: bool = False) -> Launch:
    if resume is not None and not resume.path:
        raise ValueError(f"a pi locator needs the session file path: {resume!r}")
    path = resume.path if resume is not None else new_session_path(paths)
    assert path is not None
    spec = LaunchSpec(
        runtime=RUNTIME,
        argv=argv(settings, path, sessions_dir(paths)),
        cwd=paths.workspace,
        # the placeholder the model proxy swaps for the real key (SPEC 7): not a secret
        env={**environment(paths, settings), KEY_ENV: gateway.key.get_secret_value()},
        files=config_files(paths, gateway, settings, compaction=compaction),
        dirs=[paths.home, agent_dir(paths), sessions_dir(paths), paths.workspace, paths.run_dir],
        # RESTORED: the file must exist and carry the saved id, or pi would start a new
        # session at that path (protocols/pi.md §5) — the launcher refuses first.
        require_files=[path] if resume is not None else [],
        require_header=HeaderCheck(path=path, key="id", value=resume.id) if resume is not None else None,
    )
    return Launch(spec=spec, expected=resume, resume=resume is not None)
