"""The service token against the real `cloud-agent serve` process: it refuses to start without
one (unless in loopback-only development mode), and every route but /healthz needs it."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import httpx
import pytest

from deploy.loopback import LoopbackFixture
from tests.cli.attestation_helpers import REPO, spawn_daemon

pytestmark = [pytest.mark.cli, pytest.mark.docker]

TOKEN = f"auth-test-token-{uuid.uuid4().hex}"
NO_TOKEN = ("cloud-agent serve: no service token: set CLOUD_AGENT_SERVICE_TOKEN_FILE "
            "(or CLOUD_AGENT_DEV_MODE=1 for loopback-only development)\n")


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


def serve(tmp_path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CLOUD_AGENT_")}
    full = base | {"CLOUD_AGENT_HOME": str(tmp_path / "home"), "CLOUD_AGENT_LISTEN_PORT": "1"} | env
    return subprocess.run([sys.executable, "-m", "runner.cli", "serve"], env=full, cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_serve_refuses_to_start_without_a_token(tmp_path) -> None:
    out = serve(tmp_path)
    assert (out.returncode, out.stdout, out.stderr) == (1, "", NO_TOKEN)


def test_serve_refuses_dev_mode_off_loopback(tmp_path) -> None:
    out = serve(tmp_path, CLOUD_AGENT_DEV_MODE="1", CLOUD_AGENT_LISTEN_HOST="0.0.0.0")
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == ("cloud-agent serve: development mode without a token only listens on loopback, "
                          "not 0.0.0.0\n")
    out = subprocess.run([sys.executable, "-m", "runner.cli", "serve", "--host", "0.0.0.0"], cwd=REPO,
                         capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if not k.startswith("CLOUD_AGENT_")}
                         | {"CLOUD_AGENT_DEV_MODE": "1", "CLOUD_AGENT_HOME": str(tmp_path / "home")})
    assert (out.returncode, out.stderr) == (1, "cloud-agent serve: development mode without a token only "
                                               "listens on loopback, not 0.0.0.0\n")


def test_serve_refuses_a_short_or_missing_token_file(tmp_path) -> None:
    short = tmp_path / "short"
    short.write_text("short\n")
    out = serve(tmp_path, CLOUD_AGENT_SERVICE_TOKEN_FILE=str(short))
    assert (out.returncode, out.stderr) == (
        1, "cloud-agent serve: service_token_file: the token must be at least 16 characters\n")
    missing = tmp_path / "missing"
    out = serve(tmp_path, CLOUD_AGENT_SERVICE_TOKEN_FILE=str(missing))
    assert (out.returncode, out.stderr) == (
        1, f"cloud-agent serve: service_token_file: cannot read {missing}: No such file or directory\n")


def test_dev_mode_on_loopback_serves_without_a_token(tmp_path, fx, sandbox_image) -> None:
    env = {"CLOUD_AGENT_DEV_MODE": "1", "CLOUD_AGENT_GATEWAY_URL": fx.base_url, "CLOUD_AGENT_IMAGE": sandbox_image,
           "CLOUD_AGENT_HOST_ID": f"auth-{uuid.uuid4().hex[:10]}"}
    with spawn_daemon(tmp_path / "home", env) as d:
        resp = httpx.get(f"{d.url}/v1/attestation", timeout=30)
        assert resp.status_code == 200 and resp.json()["api_version"] == "1"
        assert '"event": "daemon.dev_mode"' in d.log()


ROUTES = [
    ("POST", "/v1/jobs"), ("GET", "/v1/jobs/job-1?user_id=u1"), ("GET", "/v1/users/u1/chats/c1"),
    ("POST", "/v1/users/u1/chats/c1/stop"), ("DELETE", "/v1/users/u1/chats/c1"), ("POST", "/v1/users/u1/chats/c1/members/m1/retire"),
    ("POST", "/v1/users/u1/chats/c1/members/m1/fork"), ("GET", "/v1/attestation"), ("GET", "/openapi.json"),
    ("GET", "/readyz"), ("GET", "/v1/users/u1/chats/c1/turns"), ("GET", "/v1/users/u1/chats/c1/inspect"),
    ("GET", "/v1/host"),
]


def test_every_route_but_healthz_needs_the_token(tmp_path, fx, sandbox_image) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {"CLOUD_AGENT_SERVICE_TOKEN_FILE": str(token_file), "CLOUD_AGENT_GATEWAY_URL": fx.base_url,
           "CLOUD_AGENT_IMAGE": sandbox_image, "CLOUD_AGENT_HOST_ID": f"auth-{uuid.uuid4().hex[:10]}",
           }
    with spawn_daemon(tmp_path / "home", env) as d, httpx.Client(base_url=d.url, timeout=30) as c:
        assert (c.get("/healthz").status_code, c.get("/healthz").json()) == (200, {"ok": True})
        for method, path in ROUTES:
            for headers in ({}, {"authorization": "Bearer wrong-token-0123456789abcdef"},
                            {"authorization": f"Bearer {TOKEN[:-1]}"}, {"authorization": f"Basic {TOKEN}"},
                            {"authorization": TOKEN}):
                resp = c.request(method, path, headers=headers, json={"new_member_id": "m2"})
                assert (resp.status_code, resp.json(), resp.headers["www-authenticate"]) == \
                    (401, {"error": "unauthorized"}, "Bearer"), (method, path, headers)
        ok = {"authorization": f"Bearer {TOKEN}"}
        assert c.get("/v1/attestation", headers=ok).status_code == 200
        assert c.get("/v1/jobs/job-1", params={"user_id": "u1"}, headers=ok).status_code == 404
    assert TOKEN not in d.log()
    assert fx.requests() == []
