"""Trim fixture recordings (``--record`` JSONL) of the real CLIs into small test data.

Usage: ``python tests/data/loopback/trim.py IN.jsonl OUT.jsonl``

Kept whole: every message text a CLI sent in ``messages`` / ``input`` (user text, annotations,
tool results), so the audit tests run on the real shapes. Shortened: system prompts, developer
instructions and tool definitions (only the shell tools keep their schema). The keys in these
recordings were dummies and auth headers are never recorded.
"""

from __future__ import annotations

import json
import sys

LONG = 1500
SHELL = {"bash", "exec_command"}


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "…[trimmed]"


def _trim_texts(obj, limit):
    if isinstance(obj, str):
        return _cut(obj, limit)
    if isinstance(obj, list):
        return [_trim_texts(x, limit) for x in obj]
    if isinstance(obj, dict):
        return {k: _trim_texts(v, limit) for k, v in obj.items()}
    return obj


def trim_body(body: dict) -> dict:
    out = dict(body)
    if "system" in out:
        out["system"] = _trim_texts(out["system"], 300)
    if "instructions" in out:
        out["instructions"] = _cut(out["instructions"])
    tools = []
    for t in out.get("tools") or []:
        name = t.get("name") or (t.get("function") or {}).get("name")
        if name and name.lower() in SHELL:
            tools.append(_trim_texts(t, 200))
        else:
            keep = {k: t[k] for k in ("type", "name") if k in t}
            if "function" in t:
                keep["function"] = {"name": name}
            tools.append(keep)
    if "tools" in out:
        out["tools"] = tools
    for key in ("messages", "input"):
        items = out.get(key)
        if not isinstance(items, list):
            continue
        trimmed = []
        for m in items:
            if isinstance(m, dict) and m.get("role") in ("system", "developer"):
                m = _trim_texts(m, 300)
            else:
                m = _trim_texts(m, LONG)
            trimmed.append(m)
        out[key] = trimmed
    return out


def main(src: str, dst: str) -> None:
    with open(src) as f, open(dst, "w") as g:
        for line in f:
            rec = json.loads(line)
            if isinstance(rec.get("body"), dict):
                rec["body"] = trim_body(rec["body"])
            g.write(json.dumps(rec, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
