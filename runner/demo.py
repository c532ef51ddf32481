"""`cloud-agent demo`: the main job on the embedded default.

Starts the loopback model fixture and a daemon (real HTTP API, real Docker, the real pinned
CLIs), then for each runtime runs one chat through
NEW -> LIVE -> RESTORED (retired process) -> RESTORED (stopped and started sandbox)
-> RESTORED (container removed: a new one on the chat's state volume) -> LOST (state volume
removed: refused), and prints the receipts and, per turn, exactly what
the model saw (the fixture's audit of the conversational request).
"""

from __future__ import annotations

import json
import secrets
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
import structlog
import uvicorn

from runner import event_loop

log = structlog.get_logger("demo")

STEPS = [
    ("NEW", "Hello! Please remember the word 'heliotrope'.", None),
    ("LIVE", "What word did I ask you to remember?", None),
    ("RESTORED", "Still there after your process was retired?", "retire"),
    ("RESTORED", "And after the sandbox was stopped and started?", "stop"),
    ("RESTORED", "The container was removed. Do you still remember the word?", "remove"),
    ("LOST", "The state volume is gone now. Will you refuse?", "remove_volume"),
]


def available_runtimes(wanted: list[str]) -> list[str]:
    from drivers.registry import get_driver

    out = []
    for r in wanted:
        try:
            get_driver(r)
            out.append(r)
        except (ImportError, KeyError) as exc:
            print(f"  (skipping {r}: driver not available: {exc})", file=sys.stderr)
    return out


def _shorten(text: str, n: int = 60) -> str:
    text = text.replace("\n", "⏎")
    return text if len(text) <= n else text[: n - 1] + "…"


async def run_demo(runtimes: list[str], *, json_output: bool = False) -> int:
    from deploy.engine import ensure_engine
    from deploy.loopback import LoopbackFixture, dialogue
    from images.build import ensure_image
    from runner.config import load_settings
    from runner.proxy_client import stop_service
    from runner.proxy_protocol import ServicePaths
    from runner.serve import build_daemon

    # Blocking set-up (engine start, a possible image build) runs in worker threads, never on the loop.
    await anyio.to_thread.run_sync(ensure_engine)
    image = await anyio.to_thread.run_sync(ensure_image)  # logs progress while it builds
    from telemetry.logs import configure_logging

    configure_logging(json=False, level="WARNING")  # from here on the table tells the story
    runtimes = available_runtimes(runtimes)
    home = Path(tempfile.mkdtemp(prefix="cloud-agent-demo-", dir="/var/tmp"))
    token = secrets.token_hex(24)
    (home / "token").write_text(token)
    rows: list[dict[str, Any]] = []
    failures = 0
    with LoopbackFixture.start(record_path=str(home / "model-requests.jsonl")) as fx:
        port = free_port()
        settings = load_settings({
            "CLOUD_AGENT_HOME": str(home), "CLOUD_AGENT_GATEWAY_URL": fx.base_url, "CLOUD_AGENT_IMAGE": image,
            "CLOUD_AGENT_SERVICE_TOKEN_FILE": str(home / "token"),
            "CLOUD_AGENT_LISTEN_PORT": str(port),
        })
        daemon = await anyio.to_thread.run_sync(build_daemon, settings)  # opens the store
        server = uvicorn.Server(uvicorn.Config(daemon.app, host="127.0.0.1", port=port, log_config=None,
                                               access_log=False, lifespan="on"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            while not server.started:
                await anyio.sleep(0.05)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600,
                                         headers={"authorization": f"Bearer {token}"}) as client:
                for runtime in runtimes:
                    print(f"\n== {runtime} ==", flush=True)
                    failures += await _demo_chat(client, daemon, fx, runtime, rows, dialogue)
            server.should_exit = True
        # the demo's model proxy service would outlive it (SPEC 14) in front of a fixture that is gone
        await stop_service(ServicePaths(home))
    _print_table(rows, json_output)
    print(f"\nstate dir: {home}  (model requests: {home / 'model-requests.jsonl'})")
    return 1 if failures else 0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _demo_chat(client: httpx.AsyncClient, daemon: Any, fx: Any, runtime: str, rows: list[dict[str, Any]],
                     dialogue: Any) -> int:
    user, chat, member = "demo-user", f"chat-{runtime}-{uuid.uuid4().hex[:6]}", f"{runtime}-1"
    failures = 0
    for expect, message, before in STEPS:
        if before == "retire":
            await client.post(f"/v1/users/{user}/chats/{chat}/members/{member}/retire")
        elif before == "stop":
            await client.post(f"/v1/users/{user}/chats/{chat}/stop")
        elif before in ("remove", "remove_volume"):
            rec = await daemon.supervisor.store.get_sandbox(user, chat)
            if rec is not None:
                await daemon.supervisor.engine.remove(rec.container_id)
                if before == "remove_volume" and rec.volume_name:
                    await daemon.supervisor.engine.remove_volume(rec.volume_name)
        seen_before = len(fx.requests(kind="conversation"))
        t = time.monotonic()
        job = {"job_id": uuid.uuid4().hex, "user_id": user, "chat_id": chat, "member_id": member,
               "runtime": runtime, "message": message}
        receipt = None
        async with client.stream("POST", "/v1/jobs", json=job) as resp:
            async for line in resp.aiter_lines():
                if line.strip():
                    ev = json.loads(line)
                    if ev.get("type") == "receipt":
                        receipt = ev["receipt"]
        wall = int((time.monotonic() - t) * 1000)
        new = fx.requests(kind="conversation")[seen_before:]
        saw = [(m.role, m.text) for m in dialogue(new[-1].conversation())] if new else []
        ok = receipt is not None and receipt["context_status"] == expect and (
            receipt["outcome"] == "refused" if expect == "LOST" else receipt["outcome"] == "succeeded")
        failures += 0 if ok else 1
        rows.append({"runtime": runtime, "expected": expect, "receipt": receipt, "wall_ms": wall,
                     "model_requests": len(new), "model_saw": saw, "ok": ok})
        status = receipt["context_status"] if receipt else "?"
        outcome = receipt["outcome"] if receipt else "no receipt"
        print(f"  {status:<9} {outcome:<10} {wall:>6} ms  {'✓' if ok else '✗ expected ' + expect}", flush=True)
        if saw:
            print(f"    model saw {len(saw)} messages:")
            for role, text in saw:
                print(f"      {role:<9} {_shorten(text, 80)}")
        else:
            print(f"    model saw nothing ({len(new)} requests){' — refused: ' + str(receipt.get('reason')) if receipt and receipt['outcome'] == 'refused' else ''}")
    return failures


def _print_table(rows: list[dict[str, Any]], json_output: bool) -> None:
    if json_output:
        print(json.dumps(rows, indent=2, ensure_ascii=False, default=str))
        return
    print("\nReceipts")
    header = f"{'runtime':<9} {'status':<9} {'outcome':<11} {'reason':<20} {'locator':<40} {'reqs':>4} {'total ms':>8}  ok"
    print(header)
    print("-" * len(header))
    for row in rows:
        r = row["receipt"] or {}
        loc = r.get("locator_after") or ""
        print(f"{row['runtime']:<9} {str(r.get('context_status')):<9} {str(r.get('outcome')):<11} "
              f"{str(r.get('reason') or ''):<20} {_shorten(loc, 40):<40} {row['model_requests']:>4} "
              f"{(r.get('timings_ms') or {}).get('total', 0):>8}  {'✓' if row['ok'] else '✗'}")


def main(runtimes: list[str], *, json_output: bool = False) -> int:
    return event_loop.run(lambda: run_demo(runtimes, json_output=json_output))
