"""`cloud-agent`: a client of the daemon, plus `serve`, `demo` and `image build`.

Exit codes: 0 succeeded · 2 failed · 3 refused · 4 not_settled · 1 usage/connection error.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any

import structlog

from state.receipts import Outcome
from telemetry.logs import configure_logging

EXIT_ERROR = 1
EXIT_CODES = {Outcome.SUCCEEDED: 0, Outcome.FAILED: 2, Outcome.REFUSED: 3, Outcome.NOT_SETTLED: 4}


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


def _receipt_summary(r: dict[str, Any]) -> str:
    rows = [
        ("job", r["job_id"]), ("member", f"{r['user_id']}/{r['chat_id']}/{r['member_id']} ({r['runtime']})"),
        ("context", r.get("context_status")), ("outcome", r["outcome"]), ("reason", r.get("reason")),
        ("locator", f"{r.get('locator_before')} -> {r.get('locator_after')}"),
        ("evidence", (r.get("settlement") or {}).get("evidence")),
        ("container", ((r.get("sandbox") or {}).get("container_id") or "")[:12]),
        ("cli", r.get("cli_version")),
        ("timings ms", " ".join(f"{k}={v}" for k, v in (r.get("timings_ms") or {}).items())),
    ]
    return "\n".join(f"  {k:<11} {v}" for k, v in rows if v not in (None, ""))


def cmd_run(args: argparse.Namespace, client: Any) -> int:
    message = sys.stdin.read() if args.message == "-" else args.message
    job = {"job_id": args.job_id or f"job-{uuid.uuid4().hex[:12]}", "user_id": args.user, "chat_id": args.chat,
           "member_id": args.member, "runtime": args.runtime, "message": message}
    if args.locator:
        job["locator"] = args.locator
    receipt = None
    for ev in client.run_job(job):
        if args.json:
            print(json.dumps(ev, ensure_ascii=False), flush=True)
        elif ev.get("type") == "event" and ev.get("kind") == "text":
            print(ev["text"], end="", flush=True)
        elif ev.get("type") == "status":
            print(f"[{ev.get('context_status')}]", file=sys.stderr, flush=True)
        elif ev.get("type") == "queued":
            print(f"[queued: position {ev.get('position')}]", file=sys.stderr, flush=True)
        elif ev.get("type") == "cut":
            print(f"[stream cut: {ev.get('dropped')} events dropped; the receipt follows]", file=sys.stderr,
                  flush=True)
        if ev.get("type") == "receipt":
            receipt = ev["receipt"]
    if receipt is None:
        print("no receipt received", file=sys.stderr)
        return EXIT_ERROR
    if not args.json:
        print("\n" + _receipt_summary(receipt), file=sys.stderr)
    return EXIT_CODES[Outcome(receipt["outcome"])]


def cmd_proxy_service(args: argparse.Namespace) -> int:
    """Local, like serve: the service's control socket under CLOUD_AGENT_HOME (SPEC 14)."""
    import anyio

    from runner.config import load_settings
    from runner.proxy_client import service_status, stop_service
    from runner.proxy_protocol import ServicePaths

    paths = ServicePaths(load_settings().home)
    if args.action == "stop":
        pid = anyio.run(lambda: stop_service(paths, drain_s=args.drain))
        print("no model proxy service was running" if pid is None else f"stopped the model proxy service (pid {pid})")
        return 0
    hello = anyio.run(service_status, paths)
    if hello is None:
        print(f"no model proxy service answers at {paths.control}", file=sys.stderr)
        return EXIT_ERROR
    _print_json(hello.model_dump(mode="json"))
    return 0


def cmd_inspect(args: argparse.Namespace, client: Any) -> int:
    from runner.diagnosis import Diagnosis, render_text

    if args.turn is not None and args.turn < 1:
        print("error: --turn must be 1 or more", file=sys.stderr)
        return EXIT_ERROR
    raw = client.inspect(args.user, args.chat, args.turn)
    if args.json:
        _print_json(raw)
    else:
        print(render_text(Diagnosis.model_validate(raw)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cloud-agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="daemon URL (default $CLOUD_AGENT_URL or http://127.0.0.1:8765)")
    p.add_argument("--token-file", help="service token file (default $CLOUD_AGENT_SERVICE_TOKEN_FILE)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    # --json is accepted after the subcommand too (`cloud-agent run ... --json`)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output")
    sub = p.add_subparsers(dest="command", required=True)
    _add = sub.add_parser
    sub.add_parser = lambda *a, **kw: _add(*a, parents=[common], **kw)  # type: ignore[method-assign]

    s = sub.add_parser("serve", help="run the host daemon")
    s.add_argument("--host")
    s.add_argument("--port", type=int)

    r = sub.add_parser("run", help="dispatch one job and stream it")
    for name in ("user", "chat", "member"):
        r.add_argument(f"--{name}", required=True)
    r.add_argument("--runtime", required=True, choices=["claude", "codex", "pi", "opencode", "kilo"])
    r.add_argument("--job-id")
    r.add_argument("--locator")
    r.add_argument("message", help="the message, or - for stdin")

    st = sub.add_parser("status", help="a chat's sandbox, members and last receipts")
    st.add_argument("user")
    st.add_argument("chat")
    stop = sub.add_parser("stop", help="idle-stop a chat's sandbox")
    stop.add_argument("user")
    stop.add_argument("chat")
    dl = sub.add_parser("delete", help="delete a chat: its sandbox, native state and records (tombstones kept)")
    dl.add_argument("user")
    dl.add_argument("chat")
    ret = sub.add_parser("retire", help="retire a member's resident process")
    for n in ("user", "chat", "member"):
        ret.add_argument(n)
    fk = sub.add_parser("fork", help="fork a member's native session into a new member")
    for n in ("user", "chat", "member"):
        fk.add_argument(n)
    fk.add_argument("--new-member", required=True)
    fk.add_argument("--at-turn", type=int)
    ps = sub.add_parser("proxy-service", help="the model proxy service of this host's CLOUD_AGENT_HOME")
    ps.add_argument("action", choices=["status", "stop"])
    ps.add_argument("--drain", type=float, default=0.0, help="stop: seconds to wait for requests in flight")
    ins = sub.add_parser("inspect", help="diagnose a chat's turn: route, session identity, native state, request")
    ins.add_argument("user")
    ins.add_argument("chat")
    ins.add_argument("--turn", type=int, help="the turn's index in the chat's timeline (default: the latest)")
    sub.add_parser("attest", help="print the host attestation document")
    d = sub.add_parser("demo", help="the main job on the embedded default (loopback fixture)")
    d.add_argument("--runtimes", default="claude,codex,pi,opencode,kilo")
    img = sub.add_parser("image", help="sandbox image")
    img.add_argument("action", choices=["build"])
    img.add_argument("--force", action="store_true")
    img.add_argument("--pins", help="pins file (default: the product's images/pins.toml)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        configure_logging(json=True)
        from runner.config import load_settings
        from runner.loopback_child import LoopbackStartFailed, loopback_child
        from runner.serve import StartupRefused, check_token, serve

        overrides: dict[str, Any] = {}
        if args.host:
            overrides["listen_host"] = args.host
        if args.port:
            overrides["listen_port"] = args.port
        try:
            settings = load_settings(**overrides)
            check_token(settings)  # refuse before starting anything
            if settings.gateway_url is not None:
                serve(settings)
                return 0
            # SPEC 10: the default gateway is the loopback fixture
            settings.home.mkdir(parents=True, exist_ok=True)
            with loopback_child(settings.home / "loopback-requests.jsonl",
                                settings.home / "loopback-control-token") as url:
                structlog.get_logger("serve").info("gateway.embedded_fixture", url=url)
                serve(settings.model_copy(update={"gateway_url": url}))
        except (StartupRefused, LoopbackStartFailed, ValueError) as exc:
            print(f"cloud-agent serve: {exc}", file=sys.stderr)
            return EXIT_ERROR
        return 0
    configure_logging(json=False if args.command == "demo" else None)
    if args.command == "image":
        from images.build import main as build_main

        return build_main((["--force"] if args.force else []) + (["--pins", args.pins] if args.pins else []))
    if args.command == "demo":
        from runner.demo import main as demo_main

        return demo_main([r for r in args.runtimes.split(",") if r], json_output=args.json)
    if args.command == "proxy-service":
        return cmd_proxy_service(args)

    from runner.client import ApiError, DaemonClient, read_token

    client = DaemonClient(args.url, read_token(args.token_file))
    try:
        if args.command == "run":
            return cmd_run(args, client)
        if args.command == "inspect":
            return cmd_inspect(args, client)
        if args.command == "status":
            result = client.status(args.user, args.chat)
        elif args.command == "stop":
            result = client.stop(args.user, args.chat)
        elif args.command == "delete":
            result = client.delete(args.user, args.chat)
        elif args.command == "retire":
            result = client.retire(args.user, args.chat, args.member)
        elif args.command == "fork":
            result = client.fork(args.user, args.chat, args.member, args.new_member, args.at_turn)
        else:
            result = client.attestation()
        _print_json(result)
        return 0
    except ApiError as exc:
        print(json.dumps({"status": exc.status, "error": exc.body}) if args.json else f"error: {exc}",
              file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:
        print(f"cannot reach the daemon at {client.base_url}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
