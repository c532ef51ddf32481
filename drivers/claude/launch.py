"""Claude Code launch plans: command line, environment, directories, prechecks (pinned 2.1.220).

* NEW: the driver mints the session id (``--session-id``), so ``expected`` is known up front.
* RESTORED: ``--resume <id>`` from the ORIGINAL cwd (2.1.220 keys transcripts by cwd and does
  not find them from elsewhere), behind a launcher precheck that the transcript file exists —
  a missing transcript therefore fails before the CLI starts, with no model request at all.
* fork: ``--resume <parent> --fork-session --session-id <new>``; at a historical turn also
  ``--resume-session-at <assistant uuid>`` (a hidden 2.1.220 flag), resolved from the
  transcript inside the sandbox by :mod:`drivers.claude.fork_at`.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from drivers.base import Launch
from drivers.claude.wire import is_uuid, transcript_path
from drivers.launch import FileSpec, LaunchSpec
from drivers.models import GatewayConfig, Locator, MemberPaths

RUNTIME = "claude"
KEY_ENV = "ANTHROPIC_API_KEY"
FORK_RESOLVER = "claude-fork-at.py"


class ClaudeSettings(BaseModel):
    """Knobs of the Claude driver (defaults are what the integration tests run)."""

    model_config = ConfigDict(frozen=True)

    binary: str = "claude"
    max_retries: int = 2  # CLAUDE_CODE_MAX_RETRIES; the CLI's default 10 means minutes of backoff
    state_events: bool = True  # CLAUDE_CODE_EMIT_SESSION_STATE_EVENTS: settlement waits for idle
    # The container is the security boundary: no permission prompts (nobody could answer
    # them) and no auto-denials. As uid 1000 this needs no IS_SANDBOX (checked on 2.1.220).
    permission_mode: str = "bypassPermissions"
    handshake_timeout_s: float = 60.0
    interrupt_grace_s: float = 5.0  # after a timeout: how long to let the interrupt land
    # 2.1.220 batches transcript appends on a 100 ms timer (FLUSH_INTERVAL_MS) and prints
    # result/idle without waiting for it: measured up to ~80 ms later. A process killed in
    # that window loses the turn's tail (a resume then shows "No response requested.").
    # The stream carries no flush signal, so the settlement is returned only after the
    # process has stayed alive through this window (EOF inside it = not settled); 0 disables
    # it (only safe when processes are always retired by stdin EOF, which flushes).
    persist_grace_s: float = 0.2
    path: str | None = None  # PATH for the CLI; None = the image's default
    python: str = "python3"  # runs the fork-point resolver inside the sandbox


def config_dir(paths: MemberPaths) -> str:
    return f"{paths.home.rstrip('/')}/.claude"


def tmp_dir(paths: MemberPaths) -> str:
    return f"{paths.home.rstrip('/')}/tmp"


def safe_id(value: str) -> str:
    """A locator id usable inside a path (a non-UUID can never name a transcript anyway)."""
    return value if is_uuid(value) else re.sub(r"[^A-Za-z0-9-]", "_", value) or "_"


def transcript(paths: MemberPaths, locator: Locator) -> str:
    """Where the CLI keeps ``locator``'s transcript (keyed by the ORIGINAL cwd)."""
    return transcript_path(config_dir(paths), paths.workspace, safe_id(locator.id))


def argv(settings: ClaudeSettings, gateway: GatewayConfig) -> list[str]:
    return [settings.binary, "-p", "--output-format", "stream-json", "--input-format", "stream-json",
            "--verbose", "--model", gateway.model, "--permission-mode", settings.permission_mode]


def environment(settings: ClaudeSettings, paths: MemberPaths, gateway: GatewayConfig, *,
                compaction: bool = False) -> dict[str, str]:
    tmp = tmp_dir(paths)
    env = {
        "HOME": paths.home,
        "CLAUDE_CONFIG_DIR": config_dir(paths),
        # otherwise it writes /tmp/claude-<uid>/ and /tmp/cc-socks/ (task output files too)
        "TMPDIR": tmp,
        "CLAUDE_CODE_TMPDIR": tmp,
        "ANTHROPIC_BASE_URL": gateway.base_url.rstrip("/"),
        # the one that stops DNS lookups and side traffic; 2.1.220 still sends one HEAD
        # /api/hello preconnect to the base URL (not a model request)
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # subagents in the foreground: their events arrive before the parent's one result
        "CLAUDE_CODE_DISABLE_BACKGROUND_TASKS": "1",
        "CLAUDE_CODE_MAX_RETRIES": str(settings.max_retries),
    }
    if not compaction:
        # 2.1.220 compacts reactively on a prompt-too-long 400 (a summary request, then the
        # request retried on a rewritten history) and proactively near the window; both are
        # gated on these (DISABLE_COMPACT also removes /compact, which the driver never sends).
        env["DISABLE_AUTO_COMPACT"] = "1"
        env["DISABLE_COMPACT"] = "1"
    if settings.state_events:
        env["CLAUDE_CODE_EMIT_SESSION_STATE_EVENTS"] = "1"
    if settings.path:
        env["PATH"] = settings.path
    return env


def spec(settings: ClaudeSettings, paths: MemberPaths, gateway: GatewayConfig, command: list[str], *,
         require: list[str] | None = None, files: list[FileSpec] | None = None, compaction: bool = False) -> LaunchSpec:
    return LaunchSpec(
        runtime=RUNTIME,
        argv=command,
        cwd=paths.workspace,
        # the placeholder the model proxy swaps for the real key (SPEC 7): not a secret
        env={**environment(settings, paths, gateway, compaction=compaction), KEY_ENV: gateway.key.get_secret_value()},
        files=files or [],
        dirs=[paths.home, config_dir(paths), tmp_dir(paths), paths.workspace, paths.run_dir],
        require_files=require or [],
    )


def plan(settings: ClaudeSettings, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None, *,
         compaction: bool = False) -> Launch:
    command = argv(settings, gateway)
    if resume is None:
        expected = Locator(id=str(uuid.uuid4()))
        return Launch(spec=spec(settings, paths, gateway, command + ["--session-id", expected.id],
                                compaction=compaction),
                      expected=expected, resume=False)
    # The precheck turns a missing transcript into launch_error before the CLI (and its
    # preconnect) ever starts: HandshakeFailed(native_state_missing), zero requests.
    return Launch(spec=spec(settings, paths, gateway, command + ["--resume", safe_id(resume.id)],
                            require=[transcript(paths, resume)], compaction=compaction),
                  expected=resume, resume=True)


def plan_fork(settings: ClaudeSettings, paths: MemberPaths, gateway: GatewayConfig, parent: Locator,
              at_turn: int | None, *, at_message: str | None = None, compaction: bool = False) -> Launch:
    """A NEW session id branched from ``parent`` (same ``paths``: same cwd and config dir).

    ``at_turn=None`` forks the whole history. ``at_turn=N`` keeps the first N user prompts
    of the parent's transcript and what answered them: the CLI's hidden
    ``--resume-session-at <uuid of an assistant message>`` does the cut natively; the
    uuid is found inside the sandbox by :mod:`drivers.claude.fork_at` (a launch_error when
    the transcript has fewer turns). ``at_message`` names that assistant uuid directly
    (e.g. :attr:`ClaudeSession.last_assistant_uuid` of an earlier turn).

    The parent's transcript is never modified; the fork writes ``<new id>.jsonl``.
    """
    new = Locator(id=str(uuid.uuid4()))
    parent_file = transcript(paths, parent)
    command = argv(settings, gateway) + ["--resume", safe_id(parent.id), "--fork-session", "--session-id", new.id]
    files: list[FileSpec] = []
    if at_message is not None:
        command += ["--resume-session-at", at_message]
    elif at_turn is not None:
        if at_turn < 1:
            raise ValueError("at_turn counts kept user prompts and must be >= 1")
        resolver = f"{paths.run_dir.rstrip('/')}/{FORK_RESOLVER}"
        # The resolver runs inside the sandbox, so it ships as a file of the launch.
        source = Path(__file__).with_name("fork_at.py").read_text()
        files.append(FileSpec(path=resolver, content=source, mode=0o644))
        command = [settings.python, resolver, "--transcript", parent_file, "--turn", str(at_turn), "--", *command]
    return Launch(spec=spec(settings, paths, gateway, command, require=[parent_file], files=files,
                            compaction=compaction),
                  expected=new, resume=True)
