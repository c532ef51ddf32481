"""Fork-point resolver for Claude Code, run INSIDE the sandbox (standard library only).

    python3 claude-fork-at.py --transcript PATH --turn N -- claude ARGS...

Claude Code 2.1.220 can fork at a historical point natively with the hidden flag
``--resume-session-at <uuid>``: it keeps the transcript "up to and including the assistant
message" with that transcript uuid (the same ``uuid`` the stream-json ``assistant`` event
carried). This script finds that uuid for "the first N user prompts and their answers" in
the parent's transcript, then execs the CLI with the flag appended. On failure it prints one
``{"type":"launch_error",...}`` line (the launcher's convention) and exits 3.

What counts as a user prompt: a main-chain ``user`` entry typed by the user — not a tool
result, not CLI metadata (``isMeta``), not a compaction summary, not an interruption marker,
not a local slash-command record. A prompt that reached the CLI but whose turn never settled
(interrupted, killed) is part of the native history and counts.
"""

from __future__ import annotations

import json
import os
import sys

EXIT_PRECHECK = 3
_MARKERS = ("[Request interrupted by user", "<command-name>", "<local-command-", "<command-message>")


def fail(reason: str, **detail: str) -> None:
    sys.stdout.write(json.dumps({"type": "launch_error", "reason": reason, **detail}) + "\n")
    sys.stdout.flush()
    raise SystemExit(EXIT_PRECHECK)


def _prompt_text(entry: dict) -> str | None:
    message = entry.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    texts = []
    for block in content:
        if not isinstance(block, dict):
            continue
        if block.get("type") == "tool_result":
            return None
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
    return "".join(texts) if texts else None


def is_prompt(entry: dict) -> bool:
    if entry.get("type") != "user" or entry.get("isMeta") or entry.get("isCompactSummary"):
        return False
    text = _prompt_text(entry)
    return text is not None and not text.lstrip().startswith(_MARKERS)


def fork_anchor(lines: list[str], turn: int) -> str | None:
    """The uuid of the last assistant entry answering the ``turn``-th prompt, else None."""
    seen: set[str] = set()
    prompts = 0
    anchor = None
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict) or entry.get("isSidechain"):
            continue
        uid = entry.get("uuid")
        if not isinstance(uid, str) or uid in seen:
            continue  # compaction re-writes earlier entries; the first copy is the history
        seen.add(uid)
        if is_prompt(entry):
            prompts += 1
            if prompts > turn:
                break
            anchor = None
        elif entry.get("type") == "assistant" and prompts == turn:
            anchor = uid
    return anchor if prompts >= turn else None


def main(argv: list[str]) -> None:
    transcript = turn = None
    i = 0
    while i < len(argv) and argv[i] != "--":
        if argv[i] == "--transcript":
            transcript, i = argv[i + 1], i + 2
        elif argv[i] == "--turn":
            turn, i = argv[i + 1], i + 2
        else:
            fail("usage", detail=f"unknown option {argv[i]!r}")
    command = argv[i + 1:]
    if transcript is None or turn is None or not turn.isdigit() or int(turn) < 1 or not command:
        fail("usage", detail="--transcript PATH --turn N(>=1) -- COMMAND...")
    try:
        with open(transcript, encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
    except OSError as exc:
        fail("missing_file", path=transcript, detail=exc.strerror or str(exc))
    anchor = fork_anchor(lines, int(turn))
    if anchor is None:
        fail("fork_point_missing", path=transcript, detail=f"no answered user prompt #{turn} in the transcript")
    try:
        os.execvp(command[0], [*command, "--resume-session-at", anchor])
    except OSError as exc:
        fail("exec_failed", command=command[0], detail=exc.strerror or str(exc))


if __name__ == "__main__":
    main(sys.argv[1:])
