"""The documented list behind SPEC 9.1's "the supervisor adds nothing" (SPEC 1: it passes the
user's message through unchanged and never adds a "continue from before" note).

The history audit (deploy/loopback/audit.py) compares only the user's and assistant's words: it
strips CLI annotations (``<system-reminder>`` blocks, Codex context messages, Kilo's
``<environment_details>``) and ignores system prompts. A note the supervisor slipped into any of
those would pass it. So three more things are checked, against the lists below:

1. **Launch inputs** (argv, environment, config files of every driver's launch and fork plan,
   tests/unit/test_supervisor_adds_nothing.py): every piece of prose — a string with
   whitespace in it — is in :data:`LAUNCH_PROSE` (a program the launch itself runs is code:
   :data:`LAUNCH_PROGRAMS`). A system-prompt flag, an ``instructions`` key, an AGENTS.md would
   be prose that is not.
2. **The wire to the CLI** (every frame the supervisor writes to a CLI's stdin, recorded by
   :class:`tests.regression.supervisor_text.WireRecorder` in every regression daemon): every
   prose string is the job's message, exactly, or matches :data:`WIRE_PROSE`.
3. **What the model saw** (every request the loopback fixture recorded for a turn): each
   annotation the audit strips matches one of the pinned CLI's own :data:`CLI_ANNOTATIONS`.

Anything new here needs a reason, and must never be a note about earlier turns.
"""

from __future__ import annotations

import re

# 1. Launch inputs: prose the drivers write into a CLI's arguments, environment or config files.
LAUNCH_PROSE: dict[str, str] = {
    # Pi runs this before every bash tool command: the gateway key must not reach tool processes.
    "unset CA_PI_GATEWAY_KEY": "pi settings.json shellCommandPrefix (a shell prefix, never model text)",
    "cloud-agent gateway": "codex config.toml model provider display name (a label, never model text)",
}

# Programs a launch writes and runs itself (the file's path is in the launch's argv): code, never
# text a CLI reads as instructions.
LAUNCH_PROGRAMS: dict[str, str] = {
    "claude-fork-at.py": "the fork-point resolver a Claude fork at a historical turn runs with python3",
}

# 2. The wire: prose the supervisor writes to a CLI besides the job's message. Both answer a
#    request the CLI should never make under the pinned settings (SPEC 6); the model may see
#    them as a tool's error, which is the truth about the refusal.
WIRE_PROSE: dict[str, re.Pattern[str]] = {
    "claude control_request refusal": re.compile(r"not supported by this supervisor"),
    "codex server-request refusal": re.compile(r"cloud-agent does not serve '[\w/]+'"),
}

# 3. The annotations each pinned CLI adds to user-role text (measured on the pinned versions).
_DATE = r"\d{4}-\d{2}-\d{2}"
CLI_ANNOTATIONS: dict[str, list[re.Pattern[str]]] = {
    "claude": [
        re.compile(r"<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
                   rf"# currentDate\nToday's date is {_DATE}\.\n\n      IMPORTANT: this context may or may not be "
                   r"relevant to your tasks\. You should not respond to this context unless it is highly relevant "
                   r"to your task\.\n</system-reminder>"),
        # Claude 2.1.332 (the upgrade test's second image, SPEC 15) on its first turn of a session
        # an older version began: its own git attribution guidance (measured; not supervisor text)
        re.compile(r"<system-reminder>\nAttribution for git commits and pull requests you create from here on "
                   r"\(this replaces Claude Code's own earlier attribution guidance[^<]*"
                   r"Co-Authored-By: Claude Code <noreply@anthropic\.com>\n[^<]*Generated with "
                   r"\[Claude Code\]\(https://claude\.com/claude-code\)\n</system-reminder>"),
    ],
    "codex": [
        re.compile(r"<environment_context>\n  <cwd>[^<\n]*</cwd>\n  <shell>\w+</shell>\n"
                   rf"  <current_date>{_DATE}</current_date>\n  <timezone>[^<\n]*</timezone>\n"
                   r"  <filesystem>[^\n]*</filesystem>\n</environment_context>"),
        # after an interrupted turn (protocols/codex.md: the next request carries the marker)
        re.compile(r"<turn_aborted>[^<]*The user interrupted the previous turn on purpose[^<]*</turn_aborted>"),
    ],
    "pi": [],
    "opencode": [],
    "kilo": [
        re.compile(r"\s*<environment_details>\nMessage time: \d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z\n"
                   r"Working directory: [^\n]*\nWorkspace root folder: [^\n]*\n</environment_details>\s*"),
        # after its own compaction (CLOUD_AGENT_NATIVE_COMPACTION=on): the switch back from its
        # compaction agent, on the user messages of the retried request (measured on Kilo 7.7.7)
        re.compile(r"<system-reminder>\nThe active agent has changed from compaction to code\.\n"
                   r"This supersedes earlier agent-switch reminders\. [^<]*</system-reminder>"),
    ],
}


def is_prose(value: str) -> bool:
    """Words a model could read as an instruction: any string with whitespace between non-space
    characters (ids, paths, flags, URLs and protocol constants have none)."""
    return re.search(r"\S\s+\S", value) is not None
