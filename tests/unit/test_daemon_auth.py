"""The daemon's service-token guard and start-up refusals (fake supervisor, ASGI transport)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from runner.config import load_settings
from runner.daemon import Api, create_app
from runner.serve import StartupRefused, build_daemon, is_loopback

pytestmark = pytest.mark.anyio

TOKEN = "unit-test-service-token-5f1d2c3b"
ROUTES = [
    ("POST", "/v1/jobs"), ("GET", "/v1/jobs/j1?user_id=u1"), ("GET", "/v1/users/u1/chats/c1"),
    ("POST", "/v1/users/u1/chats/c1/stop"), ("POST", "/v1/users/u1/chats/c1/members/m1/retire"),
    ("POST", "/v1/users/u1/chats/c1/members/m1/fork"), ("GET", "/v1/attestation"), ("GET", "/openapi.json"),
    ("GET", "/readyz"), ("GET", "/metrics"), ("GET", "/v1/users/u1/chats/c1/turns"),
    ("GET", "/v1/users/u1/chats/c1/inspect"), ("GET", "/v1/host"),
]
UNAUTHORIZED = {"error": "unauthorized"}


class FakeStore:
    def __init__(self) -> None:
        self.members = {("u1", "c1", "m1")}

    async def get_member(self, user_id: str, chat_id: str, member_id: str) -> Any:
        return object() if (user_id, chat_id, member_id) in self.members else None

    async def sync(self) -> None:
        pass  # every response waits for it (runner.durable_responses): nothing is pending here


class FakeSupervisor:
    def __init__(self) -> None:
        self.store = FakeStore()
        self.calls: list[str] = []

    async def chat_status(self, user_id: str, chat_id: str) -> Any:
        self.calls.append("chat_status")
        return {"user_id": user_id, "chat_id": chat_id} if (user_id, chat_id) == ("u1", "c1") else None

    async def get_receipt(self, job_id: str, user_id: str) -> Any:
        self.calls.append("get_receipt")
        return None

    async def stop_chat(self, user_id: str, chat_id: str) -> bool:
        self.calls.append("stop_chat")
        return True

    async def fork(self, user_id: str, chat_id: str, member_id: str, req: Any) -> Any:
        self.calls.append("fork")
        return {"member_id": req.new_member_id, "forked_from": member_id}

    async def render_metrics(self, accept: str = "") -> tuple[bytes, str]:
        self.calls.append(f"render_metrics {accept}")
        return b"cloud_agent_resident_processes 0.0\n", "text/plain; version=0.0.4; charset=utf-8"

    async def retire_member(self, user_id: str, chat_id: str, member_id: str) -> Any:
        self.calls.append("retire_member")
        return None if (user_id, chat_id, member_id) not in self.store.members else True


async def readiness() -> tuple[list[str], dict[str, str]]:
    return [], {}


async def attestation() -> dict[str, Any]:
    return {"source": {"sha": "x"}}


def client(token: str | None = TOKEN, sup: FakeSupervisor | None = None) -> httpx.AsyncClient:
    api = Api(sup or FakeSupervisor(), SecretStr(token) if token else None, max_message_bytes=1000,  # type: ignore[arg-type]
              attestation=attestation, readiness=readiness)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(api)), base_url="http://daemon")


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize("header", [
    None, "", "Bearer", "Bearer ", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Basic {TOKEN}",
    f"{TOKEN}", "Bearer wrong-token-of-some-length", f"Bearer {TOKEN.upper()}", "Bearer tøken-ünicode".encode("latin-1"),
])
async def test_every_route_but_healthz_refuses_a_missing_or_wrong_token(method, path, header) -> None:
    sup = FakeSupervisor()
    headers = {} if header is None else {"authorization": header}
    async with client(sup=sup) as c:
        resp = await c.request(method, path, headers=headers, json={"job_id": "j"})
    assert (resp.status_code, resp.json(), resp.headers["www-authenticate"]) == (401, UNAUTHORIZED, "Bearer")
    assert sup.calls == []  # no handler ran
    assert TOKEN not in resp.text


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_the_right_token_passes(scheme) -> None:
    async with client() as c:
        headers = {"authorization": f"{scheme} {TOKEN}"}
        assert (await c.get("/v1/attestation", headers=headers)).json() == {"source": {"sha": "x"}}
        assert (await c.get("/readyz", headers=headers)).json() == {"ready": True, "reasons": [], "detail": {}}
        assert (await c.get("/v1/users/u1/chats/c1", headers=headers)).status_code == 200


async def test_metrics_answer_in_the_format_the_scraper_accepts() -> None:
    sup = FakeSupervisor()
    async with client(sup=sup) as c:
        resp = await c.get("/metrics", headers={"authorization": f"Bearer {TOKEN}", "accept": "text/plain"})
    assert (resp.status_code, resp.text, resp.headers["content-type"]) == (
        200, "cloud_agent_resident_processes 0.0\n", "text/plain; version=0.0.4; charset=utf-8")
    assert sup.calls == ["render_metrics text/plain"]


async def test_healthz_needs_no_token() -> None:
    async with client() as c:
        resp = await c.get("/healthz")
    assert (resp.status_code, resp.json()) == (200, {"ok": True})


async def test_dev_mode_without_a_token_is_open() -> None:
    async with client(token=None) as c:
        assert (await c.get("/v1/attestation")).status_code == 200


async def test_fork_checks_the_member_before_the_body() -> None:
    auth = {"authorization": f"Bearer {TOKEN}"}
    async with client() as c:
        for body in (b"", b"not json", b'{"new_member_id": "m2"}', b'{"bad": 1}'):
            resp = await c.post("/v1/users/u2/chats/c1/members/m1/fork", content=body, headers=auth)
            assert (resp.status_code, resp.json()) == (404, {"error": "not_found"})
        resp = await c.post("/v1/users/u1/chats/c1/members/m1/fork", content=b'{"bad": 1}', headers=auth)
        assert resp.status_code == 422 and resp.json()["error"] == "invalid_request"
        resp = await c.post("/v1/users/u1/chats/c1/members/m1/fork", json={"new_member_id": "m2"}, headers=auth)
        assert (resp.status_code, resp.json()) == (200, {"member_id": "m2", "forked_from": "m1"})


def settings(tmp_path, **env: str):
    return load_settings({"CLOUD_AGENT_HOME": str(tmp_path), **env})


def test_no_token_refuses_to_start(tmp_path) -> None:
    with pytest.raises(StartupRefused) as exc:
        build_daemon(settings(tmp_path))
    assert str(exc.value) == ("no service token: set CLOUD_AGENT_SERVICE_TOKEN_FILE "
                              "(or CLOUD_AGENT_DEV_MODE=1 for loopback-only development)")


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::", "example.com"])
def test_dev_mode_refuses_a_non_loopback_listener(tmp_path, host) -> None:
    with pytest.raises(StartupRefused) as exc:
        build_daemon(settings(tmp_path, CLOUD_AGENT_DEV_MODE="1", CLOUD_AGENT_LISTEN_HOST=host))
    assert str(exc.value) == f"development mode without a token only listens on loopback, not {host}"


def test_unreadable_or_short_token_files_refuse_to_start(tmp_path) -> None:
    with pytest.raises(ValueError) as exc:
        build_daemon(settings(tmp_path, CLOUD_AGENT_SERVICE_TOKEN_FILE=str(tmp_path / "missing")))
    assert str(exc.value) == f"service_token_file: cannot read {tmp_path / 'missing'}: No such file or directory"
    short = tmp_path / "short"
    short.write_text("too-short\n")
    with pytest.raises(ValueError) as exc:
        build_daemon(settings(tmp_path, CLOUD_AGENT_SERVICE_TOKEN_FILE=str(short)))
    assert str(exc.value) == "service_token_file: the token must be at least 16 characters"


@pytest.mark.parametrize(("host", "loop"), [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("10.0.0.1", False),
                                            ("localhost.example.com", False)])
def test_is_loopback(host, loop) -> None:
    assert is_loopback(host) is loop


def test_the_token_is_never_in_the_settings_repr(tmp_path) -> None:
    tok = tmp_path / "tok"
    tok.write_text(TOKEN)
    s = settings(tmp_path, CLOUD_AGENT_SERVICE_TOKEN_FILE=str(tok))
    assert TOKEN not in repr(s.service_token()) and TOKEN not in str(SimpleNamespace(t=s.service_token()))
