"""Supervisor overhead, measured side by side in one run (Codex: the fastest CLI to start).

    uv run python tests/bench/bench_supervisor.py [N]

1. LIVE turn through the daemon  ÷  the same CLI driven by a bare `docker exec -i` script in
   the same container against the same fixture.
2. RESTORED turn after a sandbox stop (daemon: stop route + job)  ÷  (docker stop/start +
   bare resume + turn).
3. Sandbox create+start (SandboxManager.resolve of a new chat)  ÷  raw SDK create+start.
4. 16 chats dispatched concurrently: throughput, latency, failures.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import anyio
import docker

from deploy.loopback import LoopbackFixture
from drivers.codex import CodexDriver
from images.build import ensure_image
from runner.processes import member_paths
from sandbox_manager.engine import FileEntry
from tests.daemon_harness import daemon_settings, running_daemon


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt(xs: list[float]) -> str:
    s = sorted(xs)
    return f"{med(s):8.1f} ms (min {s[0]:.1f}, max {s[-1]:.1f}, n={len(s)})"


class BareCodex:
    """A bare JSON-RPC script over `docker exec -i` (one docker client process)."""

    def __init__(self, container: str, argv: list[str], env: dict[str, str]) -> None:
        flags = [f for k, v in env.items() for f in ("-e", f"{k}={v}")]
        self.p = subprocess.Popen(["docker", "exec", "-i", "-u", "agent", "-w", "/home/agent/workspace", *flags,
                                   container, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  bufsize=1)
        self.n = 0

    def call(self, method: str, params: dict) -> dict:
        self.n += 1
        rid = self.n
        self.p.stdin.write(json.dumps({"method": method, "id": rid, "params": params}) + "\n")
        self.p.stdin.flush()
        while True:
            msg = json.loads(self.p.stdout.readline())
            if msg.get("id") == rid and "method" not in msg:
                return msg

    def notify(self, method: str) -> None:
        self.p.stdin.write(json.dumps({"method": method}) + "\n")
        self.p.stdin.flush()

    def turn(self, thread: str, text: str) -> None:
        resp = self.call("turn/start", {"threadId": thread, "input": [{"type": "text", "text": text}]})
        turn_id = resp["result"]["turn"]["id"]
        while True:
            msg = json.loads(self.p.stdout.readline())
            if msg.get("method") == "turn/completed" and msg["params"]["turn"]["id"] == turn_id:
                return

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=10)


async def main(n: int) -> None:
    from telemetry.logs import configure_logging

    configure_logging(json=False, level="WARNING")
    image = ensure_image()
    client = docker.from_env()
    with LoopbackFixture.start() as fx, tempfile.TemporaryDirectory() as tmp:
        settings = daemon_settings(Path(tmp) / "home", fx.base_url, image)
        async with running_daemon(settings) as d:
            sup = d.daemon.supervisor
            user, chat = "bench", f"chat-{uuid.uuid4().hex[:6]}"

            def job(msg: str, c: str = chat, m: str = "m1") -> dict:
                return {"job_id": uuid.uuid4().hex, "user_id": user, "chat_id": c, "member_id": m,
                        "runtime": "codex", "message": msg}

            receipt, _, _ = await d.run(job("warm up"))
            container = receipt["sandbox"]["container_id"]
            # ---- 1. LIVE
            live_daemon = []
            for i in range(n):
                t = time.perf_counter()
                r, _, _ = await d.run(job(f"live {i}"))
                live_daemon.append((time.perf_counter() - t) * 1000)
                assert r["context_status"] == "LIVE", r
            sb = await sup.manager.resolve(user, chat)
            dirs = sup.manager.member_dirs("bare")
            # the bare CLI goes through the sandbox's own model socket too (sealed: nothing else answers)
            launch = CodexDriver().plan(member_paths(dirs), sup.model_path.gateway(user, chat, "bare", "bench"), None)
            await sup.manager.prepare_files(sb, [FileEntry(f.path, f.content.encode(), f.mode)
                                                 for f in launch.spec.files], [], [dirs.home, dirs.run_dir])
            env = dict(launch.spec.env)
            bare = BareCodex(container, launch.spec.argv, env)
            bare.call("initialize", {"clientInfo": {"name": "bench", "title": "bench", "version": "0"}})
            bare.notify("initialized")
            thread = bare.call("thread/start", {"cwd": "/home/agent/workspace", "approvalPolicy": "never",
                                                "sandbox": "danger-full-access"})["result"]["thread"]["id"]
            bare.turn(thread, "bare warm up")
            live_bare = []
            for i in range(n):
                t = time.perf_counter()
                bare.turn(thread, f"bare live {i}")
                live_bare.append((time.perf_counter() - t) * 1000)
            bare.close()
            # ---- 2. RESTORED after a sandbox stop
            restored_daemon, restored_bare = [], []
            for i in range(n):
                await d.client.post(f"/v1/users/{user}/chats/{chat}/stop")
                t = time.perf_counter()
                r, _, _ = await d.run(job(f"restored {i}"))
                restored_daemon.append((time.perf_counter() - t) * 1000)
                assert r["context_status"] == "RESTORED", r
                await d.client.post(f"/v1/users/{user}/chats/{chat}/stop")
                c = client.containers.get(container)
                t = time.perf_counter()
                c.start()
                bare = BareCodex(container, launch.spec.argv, env)
                bare.call("initialize", {"clientInfo": {"name": "bench", "title": "bench", "version": "0"}})
                bare.notify("initialized")
                bare.call("thread/resume", {"threadId": thread, "excludeTurns": True})
                bare.turn(thread, f"bare restored {i}")
                restored_bare.append((time.perf_counter() - t) * 1000)
                bare.close()
            # ---- 3. sandbox create+start
            create_mgr, create_raw = [], []
            for i in range(n):
                t = time.perf_counter()
                s = await sup.manager.resolve(user, f"fresh-{uuid.uuid4().hex[:8]}")
                create_mgr.append((time.perf_counter() - t) * 1000)
                client.api.remove_container(s.container_id, force=True)
                t = time.perf_counter()
                c = client.containers.create(image, command=["sleep", "infinity"], init=True, network_mode="none",
                                             user="agent")
                c.start()
                create_raw.append((time.perf_counter() - t) * 1000)
                c.remove(force=True)
            # ---- 4. 16 concurrent chats
            lat: list[float] = []
            failures: list[str] = []

            async def one(i: int) -> None:
                t = time.perf_counter()
                r, _, _ = await d.run(job(f"concurrent {i}", c=f"conc-{i}-{uuid.uuid4().hex[:4]}"))
                lat.append((time.perf_counter() - t) * 1000)
                if not r or r["outcome"] != "succeeded":
                    failures.append(str(r and r.get("reason")))

            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(one, i)
            wall = time.perf_counter() - t
            for rec in sup.store.raw_rows("sandboxes"):
                try:
                    client.api.remove_container(rec["container_id"], force=True)
                except docker.errors.NotFound:
                    pass
    print(f"LIVE turn, daemon          {fmt(live_daemon)}")
    print(f"LIVE turn, bare exec       {fmt(live_bare)}")
    print(f"  ratio daemon / bare      {med(live_daemon) / med(live_bare):.2f}")
    print(f"RESTORED, daemon           {fmt(restored_daemon)}")
    print(f"RESTORED, start+bare       {fmt(restored_bare)}")
    print(f"  ratio daemon / bare      {med(restored_daemon) / med(restored_bare):.2f}")
    print(f"create+start, manager      {fmt(create_mgr)}")
    print(f"create+start, raw SDK      {fmt(create_raw)}")
    print(f"  ratio manager / raw      {med(create_mgr) / med(create_raw):.2f}")
    print(f"16 concurrent NEW chats    wall {wall:.1f} s, {16 / wall:.2f} turns/s, "
          f"p50 {med(lat):.0f} ms, max {max(lat):.0f} ms, failures {len(failures)} {failures}")


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 5)
