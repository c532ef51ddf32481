"""SPEC 10: with no CLOUD_AGENT_GATEWAY_URL, `cloud-agent serve` serves jobs against the loopback
fixture, which the CLI entry point starts as a child process (the daemon module never imports
the fixture); the fixture ends with the daemon, even when the daemon is killed with -9."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from tests.cli.attestation_helpers import spawn_daemon

pytestmark = [pytest.mark.cli, pytest.mark.docker]


def events_of(log: str) -> list[dict]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def fixture_url(log: str) -> str:
    events = events_of(log)
    urls = [e["url"] for e in events if e.get("event") == "gateway.embedded_fixture"]
    ready = [e["gateway"] for e in events if e.get("event") == "daemon.ready"]
    assert len(urls) == 1 and ready == urls, (urls, ready)
    return urls[0]


def refuses_connections(url: str) -> bool:
    """True once nothing listens at ``url``. A connection reset while the child is exiting
    (it closes its listener under an accepted request: seen in CI) is not yet "gone": ask again."""
    try:
        httpx.get(f"{url}/_fixture/health", timeout=2)
    except httpx.ConnectError:
        return True
    except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout):
        return False
    return False


def test_serve_without_a_gateway_runs_jobs_on_the_loopback_child(tmp_path, sandbox_image) -> None:
    env = {"CLOUD_AGENT_DEV_MODE": "1", "CLOUD_AGENT_IMAGE": sandbox_image,
           "CLOUD_AGENT_HOST_ID": f"gw-{uuid.uuid4().hex[:10]}"}
    with spawn_daemon(tmp_path / "home", env) as d:
        url = fixture_url(d.log())
        assert httpx.get(f"{url}/_fixture/health", timeout=5).json() == {"ok": True}
        token_file = tmp_path / "home" / "loopback-control-token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        auth = {"authorization": f"Bearer {token_file.read_text().strip()}"}
        message = f"hello default gateway {uuid.uuid4().hex[:8]}"
        job = {"job_id": "j1", "user_id": "u1", "chat_id": "c1", "member_id": "m1", "runtime": "codex",
               "message": message}
        with httpx.stream("POST", f"{d.url}/v1/jobs", json=job, timeout=300) as resp:
            lines = [json.loads(line) for line in resp.iter_lines() if line.strip()]
        receipt = lines[-1]["receipt"]
        assert (receipt["context_status"], receipt["outcome"]) == ("NEW", "succeeded")
        seen = httpx.get(f"{url}/_fixture/requests", params={"kind": "conversation"}, headers=auth,
                         timeout=5).json()["requests"]
        assert len(seen) == 1 and message in json.dumps(seen[0]["body"])
        assert (tmp_path / "home" / "loopback-requests.jsonl").read_text().count(message) == 1
        # both services froze their start-up's objects once ready (runner.heap), the daemon before
        # it said so; the proxy service runs the job's model traffic, so it is up by now
        daemon_log = events_of(d.log())
        daemon_events = [e["event"] for e in daemon_log]
        assert daemon_events.count("daemon.heap_frozen") == 1
        assert daemon_events.index("daemon.heap_frozen") < daemon_events.index("daemon.ready")
        service = [e for e in events_of((tmp_path / "home" / "proxy" / "service.log").read_text())
                   if e.get("event") == "proxy_service.heap_frozen"]
        frozen = [e["objects"] for e in daemon_log if e.get("event") == "daemon.heap_frozen"]
        assert len(service) == 1 and service[0]["objects"] > 10_000 and frozen[0] > 10_000, (service, frozen)
        # and /metrics has the daemon's collector pauses (telemetry.gc_pauses) and the proxy
        # service's, relayed. Once frozen, both collect young garbage only every 20 000 net
        # allocations (runner.heap.THRESHOLDS), which a turn does not reach: each family is there,
        # its samples (if any yet) by generation; tests/unit/test_gc_pauses.py counts collections
        from prometheus_client.parser import text_string_to_metric_families

        scraped = httpx.get(f"{d.url}/metrics", timeout=10).text
        for name in ("cloud_agent_gc_pause_seconds", "cloud_agent_proxy_gc_pause_seconds"):
            (family,) = [f for f in text_string_to_metric_families(scraped) if f.name == name]
            assert family.type == "histogram", family
            assert {s.labels["generation"] for s in family.samples} <= {"0", "1", "2"}, family.samples
        d.kill9()
        deadline = time.monotonic() + 30
        while not refuses_connections(url):  # the child sees stdin close when its parent dies
            assert time.monotonic() < deadline, "the loopback child outlived its daemon"
            time.sleep(0.1)
