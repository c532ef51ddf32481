"""Sealed sandboxes vs before (issue 12), side by side in one run, per CLI: NEW, LIVE and
RESTORED turns through a real daemon.

    uv run python tests/bench/bench_sealed.py --before <commit> [--rounds 5] [--runtimes codex,pi]

``--before`` is a commit without the model proxy (host networking, the key on stdin): it is
checked out into a throwaway git worktree, its own image is built (the tag follows its
inputs) and its daemon runs from there (``python -m runner.cli serve``). The current tree's
daemon runs sealed. Both serve the same in-process loopback fixture; each round runs one
chat per CLI on each daemon, alternating which goes first. Printed: the median of each
phase's receipt ``timings_ms.total`` per CLI and daemon, and the ratio sealed ÷ before
(goal: no CLI slower by more than 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import httpx

from deploy.loopback import LoopbackFixture
from tests.daemon_harness import TOKEN, free_port, serve_process, test_socket_dir

REPO = Path(__file__).resolve().parents[2]
PHASES = ("NEW", "LIVE", "RESTORED")
HOST_IDS: list[str] = []


def image_of(tree: Path) -> str:
    out = subprocess.run([sys.executable, "-c", "from images.build import ensure_image; print(ensure_image())"],
                         cwd=tree, capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=str(tree)))
    return out.stdout.strip().splitlines()[-1]


def daemon_env(home: Path, gateway: str, image: str, port: int, sealed: bool) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    (home / "token").write_text(TOKEN + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOUD_AGENT_")}
    env.update(CLOUD_AGENT_HOME=str(home), CLOUD_AGENT_GATEWAY_URL=gateway, CLOUD_AGENT_IMAGE=image,
               CLOUD_AGENT_SERVICE_TOKEN_FILE=str(home / "token"), CLOUD_AGENT_LISTEN_PORT=str(port),
               CLOUD_AGENT_HOST_ID=f"bench-sealed-{uuid.uuid4().hex[:8]}")
    HOST_IDS.append(env["CLOUD_AGENT_HOST_ID"])
    if sealed:
        env["CLOUD_AGENT_SOCKET_DIR"] = test_socket_dir(home)
    else:  # the old default for a loopback gateway, spelled out
        env["CLOUD_AGENT_SANDBOX_NETWORK"] = "host"
    return env


def turn(client: httpx.Client, user: str, chat: str, runtime: str, message: str) -> dict:
    job = {"job_id": f"job-{uuid.uuid4().hex}", "user_id": user, "chat_id": chat, "member_id": "m1",
           "runtime": runtime, "message": message}
    resp = client.post("/v1/jobs", json=job)
    receipt = json.loads(resp.text.strip().splitlines()[-1]).get("receipt")
    assert receipt and receipt["outcome"] == "succeeded", resp.text[-2000:]
    return receipt


def one_chat(client: httpx.Client, runtime: str) -> dict[str, float]:
    user, chat = f"u-{uuid.uuid4().hex[:8]}", f"c-{uuid.uuid4().hex[:8]}"
    out = {}
    for phase, msg in zip(PHASES, ("first question", "second question", "third question"), strict=True):
        if phase == "RESTORED":
            r = client.post(f"/v1/users/{user}/chats/{chat}/members/m1/retire")
            assert r.status_code == 200, r.text
        receipt = turn(client, user, chat, runtime, msg)
        assert receipt["context_status"] == phase, receipt
        out[phase] = float(receipt["timings_ms"]["total"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a commit without the model proxy")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runtimes", default="claude,codex,pi,opencode,kilo")
    args = ap.parse_args()
    runtimes = args.runtimes.split(",")
    work = Path(tempfile.mkdtemp(prefix="bench-sealed-", dir="/var/tmp"))
    old_tree = work / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), args.before], cwd=REPO, check=True,
                   capture_output=True)
    results: dict[tuple[str, str, str], list[float]] = {}
    try:
        images = {"before": image_of(old_tree), "sealed": image_of(REPO)}
        print(f"images: {images}", flush=True)
        with LoopbackFixture.start() as fx:
            trees = {"before": old_tree, "sealed": REPO}
            ports = {name: free_port() for name in trees}
            with serve_process(daemon_env(work / "home-before", fx.base_url, images["before"], ports["before"], False),
                               ports["before"], work / "before.log", cwd=old_tree,
                               argv=[sys.executable, "-m", "runner.cli", "serve"]) as old, \
                    serve_process(daemon_env(work / "home-sealed", fx.base_url, images["sealed"], ports["sealed"],
                                             True), ports["sealed"], work / "sealed.log", cwd=REPO) as new:
                clients = {name: httpx.Client(base_url=d.url, timeout=600, headers={"authorization": f"Bearer {TOKEN}"})
                           for name, d in (("before", old), ("sealed", new))}
                for rnd in range(args.rounds):
                    order = ["before", "sealed"] if rnd % 2 == 0 else ["sealed", "before"]
                    for runtime in runtimes:
                        for name in order:
                            for phase, ms in one_chat(clients[name], runtime).items():
                                results.setdefault((runtime, phase, name), []).append(ms)
                    print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=REPO, capture_output=True)
        for host_id in HOST_IDS:  # this run's sandboxes only (the engine is shared)
            ids = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=org.cloud-agent.host-id={host_id}"],
                                 capture_output=True, text=True).stdout.split()
            if ids:
                subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)
    print(f"\nturn total (receipt timings_ms.total), median of {args.rounds} rounds; sealed ÷ before")
    print(f"{'runtime':9} {'phase':9} {'before ms':>10} {'sealed ms':>10} {'ratio':>7}")
    for runtime in runtimes:
        for phase in PHASES:
            b = statistics.median(results[(runtime, phase, "before")])
            s = statistics.median(results[(runtime, phase, "sealed")])
            print(f"{runtime:9} {phase:9} {b:10.0f} {s:10.0f} {s / b:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
