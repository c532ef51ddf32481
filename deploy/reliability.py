"""Deployment reliability check (SPEC section 9.4): is the intended revision serving jobs?

    python -m deploy.reliability HOST_URL --expect-sha SHA [--max-heartbeat-age S]
        [--max-probe-age S] [--allow-dirty] [--token-file PATH] [--json] [--smoke RUNTIMES]

The service token is read from ``--token-file`` or the file named by
``CLOUD_AGENT_SERVICE_TOKEN_FILE`` (never from an argument). A working model call does not
prove which revision serves; this reads the host's attestation document and checks:

  api            the daemon answers /v1/attestation with the token
  source_sha     the exact source SHA equals --expect-sha (and the tree was clean)
  helper_pin     the image in use carries exactly the pinned http-agent-live-bridge version
  reverse_probe  the daemon's last reverse probe of its sandbox path passed and is fresh
  heartbeat      the daemon's last beat is younger than --max-heartbeat-age

With ``--smoke claude,codex`` (opt-in: real model calls on the host's real gateway), once
those checks pass, it also runs a synthetic chat per runtime on the host — new chat, live
follow-up, idle stop, restore — and deletes it afterwards (``deploy.smoke``); one row per step.

It prints one table row per check; exit 0 only when every check passes, 1 when one fails
(the summary names each failed check), 2 on a usage or configuration error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from images.pins import load_pins

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_MAX_HEARTBEAT_AGE_S = 30.0
CHECKS = ("api", "source_sha", "helper_pin", "reverse_probe", "heartbeat")


@dataclass(frozen=True)
class Check:
    name: str
    result: str  # pass | fail | skip
    detail: str

    @property
    def passed(self) -> bool:
        return self.result == "pass"


def _check(name: str, ok: bool, detail: str) -> Check:
    return Check(name, "pass" if ok else "fail", detail)


def check_sha(doc: dict[str, Any], expect_sha: str, *, allow_dirty: bool) -> Check:
    src = doc.get("source") or {}
    sha, dirty = src.get("sha"), src.get("dirty")
    if not sha:
        return _check("source_sha", False, f"the host does not know its source SHA (origin {src.get('origin')})")
    if sha.lower() != expect_sha.lower():
        return _check("source_sha", False, f"expected {expect_sha}, the host serves {sha}")
    if dirty and not allow_dirty:
        return _check("source_sha", False, f"{sha} with a dirty tree (local changes on top of the commit)")
    state = {True: "dirty tree, allowed", False: "clean tree", None: f"tree state unknown ({src.get('origin')})"}
    return _check("source_sha", True, f"{sha} ({state[dirty]})")


def check_helper(doc: dict[str, Any]) -> Check:
    pins = load_pins()
    image = doc.get("image") or {}
    if "error" in image or not image.get("id"):
        return _check("helper_pin", False, f"image {image.get('ref')} unavailable: {image.get('error')}")
    required = (doc.get("required_helper") or {}).get("version")
    got = (image.get("labels") or {}).get(pins.helper.name)
    where = f"image {image.get('ref')} ({str(image['id'])[:19]})"
    if str(required) != str(pins.helper.version):
        return _check("helper_pin", False, f"the host requires {pins.helper.name}={required}, "
                                           f"this release pins {pins.helper.version}")
    if got != str(pins.helper.version):
        return _check("helper_pin", False, f"{where} has {pins.helper.name}={got}, the pin is {pins.helper.version}")
    return _check("helper_pin", True, f"{where} has {pins.helper.name}={got}")


def check_probe(doc: dict[str, Any], max_age_s: float | None) -> Check:
    probe = doc.get("reverse_probe")
    if not probe:
        return _check("reverse_probe", False, "no reverse probe has finished on the host yet")
    steps = probe.get("steps_ms") or {}
    timing = f"{steps.get('total', '?')} ms (" + ", ".join(f"{k} {v}" for k, v in steps.items() if k != "total") + ")"
    age = float(probe.get("age_s") or 0.0)
    if not probe.get("ok"):
        return _check("reverse_probe", False, f"failed at {probe.get('failed_step')}: {probe.get('error')}")
    bound = max_age_s if max_age_s is not None else float(probe.get("stale_after_s") or 0.0)
    if probe.get("stale") or (max_age_s is not None and age > max_age_s):
        return _check("reverse_probe", False, f"passed {age:.1f}s ago, older than {bound:g}s")
    return _check("reverse_probe", True, f"passed {age:.1f}s ago in {timing}")


def check_heartbeat(doc: dict[str, Any], max_age_s: float) -> Check:
    hb = doc.get("heartbeat") or {}
    age = hb.get("age_s")
    if age is None:
        return _check("heartbeat", False, "the host has recorded no beat")
    detail = f"last beat {age:.1f}s ago (interval {hb.get('interval_s')}s, max age {max_age_s:g}s)"
    return _check("heartbeat", age <= max_age_s, detail)


def run_checks(doc: dict[str, Any], *, expect_sha: str, max_heartbeat_age_s: float,
               max_probe_age_s: float | None = None, allow_dirty: bool = False) -> list[Check]:
    """Every check on one attestation document (the api check is made by the caller)."""
    return [check_sha(doc, expect_sha, allow_dirty=allow_dirty), check_helper(doc),
            check_probe(doc, max_probe_age_s), check_heartbeat(doc, max_heartbeat_age_s)]


def fetch(url: str, token: str, timeout_s: float = 30.0) -> tuple[Check, dict[str, Any] | None]:
    endpoint = url.rstrip("/") + "/v1/attestation"
    try:
        resp = httpx.get(endpoint, headers={"authorization": f"Bearer {token}"}, timeout=timeout_s,
                         follow_redirects=False)
    except httpx.HTTPError as exc:
        return _check("api", False, f"{endpoint} unreachable: {type(exc).__name__}: {exc}"), None
    if resp.status_code == 401:
        return _check("api", False, f"{endpoint} refused the service token (HTTP 401)"), None
    if resp.status_code != 200:
        return _check("api", False, f"{endpoint} answered HTTP {resp.status_code}"), None
    try:
        doc = resp.json()
    except ValueError:
        return _check("api", False, f"{endpoint} answered something that is not JSON"), None
    return _check("api", True, f"{endpoint} answered (api version {doc.get('api_version')})"), doc


def render(checks: list[Check], notes: tuple[str, ...] = ()) -> str:
    width = max(len("CHECK"), *(len(c.name) for c in checks))
    lines = [f"{'CHECK':<{width}}  RESULT  DETAIL"]
    lines += [f"{c.name:<{width}}  {c.result:<6}  {c.detail}" for c in checks]
    lines += list(notes)
    failed = [c.name for c in checks if not c.passed]
    lines.append("all checks passed" if not failed else "FAILED: " + ", ".join(failed))
    return "\n".join(lines)


def parse_runtimes(value: str) -> list[str]:
    known = list(load_pins().cli)  # the pinned CLIs are the runtimes
    runtimes = [r.strip() for r in value.split(",") if r.strip()]
    bad = [r for r in runtimes if r not in known]
    if not runtimes or bad or len(set(runtimes)) != len(runtimes):
        raise argparse.ArgumentTypeError(f"a comma-separated list of distinct runtimes of {', '.join(known)} "
                                          f"(got {value!r})")
    return runtimes


def smoke_checks(url: str, token: str, runtimes: list[str]) -> tuple[list[Check], str, dict[str, Any]]:
    """The smoke chat's rows (step timing in the detail), its cost line, and its JSON."""
    import anyio

    from deploy.smoke import run_smoke

    result = anyio.run(run_smoke, url, token, runtimes)
    checks = [Check(r.name, r.result, r.detail if r.seconds is None else f"{r.detail} ({r.seconds:.1f} s)")
              for r in result.rows]
    if result.interrupted:
        checks.append(Check("smoke", "fail", "interrupted: the remaining steps did not run (chats deleted)"))
    cost = (f"smoke cost: {result.requests} model requests ({result.side_requests} side requests) "
            f"for {len(runtimes)} runtime(s)")
    return checks, cost, {"requests": result.requests, "side_requests": result.side_requests,
                          "interrupted": result.interrupted,
                          "steps": [{"name": r.name, "result": r.result, "detail": r.detail, "seconds": r.seconds}
                                    for r in result.rows]}


def read_token(path: str | None) -> str:
    path = path or os.environ.get("CLOUD_AGENT_SERVICE_TOKEN_FILE")
    if not path:
        raise ValueError("no service token: pass --token-file or set CLOUD_AGENT_SERVICE_TOKEN_FILE")
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from None
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.reliability", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", metavar="HOST_URL")
    p.add_argument("--expect-sha", required=True, help="the exact git SHA the host must serve")
    p.add_argument("--max-heartbeat-age", type=float, default=DEFAULT_MAX_HEARTBEAT_AGE_S, metavar="S")
    p.add_argument("--max-probe-age", type=float, default=None, metavar="S",
                   help="default: the host's own staleness bound (2 probe intervals + the probe timeout)")
    p.add_argument("--allow-dirty", action="store_true", help="accept a host whose tree had local changes")
    p.add_argument("--token-file", help="default: $CLOUD_AGENT_SERVICE_TOKEN_FILE")
    p.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    p.add_argument("--smoke", type=parse_runtimes, metavar="RUNTIMES", default=None,
                   help="also run a synthetic chat per runtime (e.g. claude,codex): real model calls, opt-in")
    args = p.parse_args(argv)
    try:
        token = read_token(args.token_file)
    except ValueError as exc:
        print(f"deploy.reliability: {exc}", file=sys.stderr)
        return EXIT_USAGE
    api, doc = fetch(args.url, token)
    checks = [api]
    if doc is None:
        checks += [Check(name, "skip", "not checked: no attestation document") for name in CHECKS[1:]]
    else:
        checks += run_checks(doc, expect_sha=args.expect_sha, max_heartbeat_age_s=args.max_heartbeat_age,
                             max_probe_age_s=args.max_probe_age, allow_dirty=args.allow_dirty)
    notes: tuple[str, ...] = ()
    extra: dict[str, Any] = {}
    if args.smoke:
        if all(c.passed for c in checks):
            rows, cost, extra["smoke"] = smoke_checks(args.url, token, args.smoke)
            checks += rows
            notes = (cost,)
        else:  # never spend model calls on a host that is not the intended revision
            checks.append(Check("smoke", "skip", "not run: the attestation checks failed"))
    ok = all(c.passed for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [asdict(c) for c in checks],
                          "failed": [c.name for c in checks if not c.passed], **extra}, indent=2))
    else:
        print(render(checks, notes))
    return EXIT_OK if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
