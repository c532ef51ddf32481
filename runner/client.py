"""A small client of the daemon's HTTP API (used by the `cloud-agent` subcommands)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8765"


class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


def read_token(path: str | None) -> str | None:
    path = path or os.environ.get("CLOUD_AGENT_SERVICE_TOKEN_FILE")
    if not path:
        return None
    return Path(path).read_text().strip()


class DaemonClient:
    def __init__(self, base_url: str | None = None, token: str | None = None, timeout_s: float = 900.0) -> None:
        self.base_url = (base_url or os.environ.get("CLOUD_AGENT_URL") or DEFAULT_URL).rstrip("/")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers,
                                  timeout=httpx.Timeout(timeout_s, connect=10.0))

    def close(self) -> None:
        self._http.close()

    def _json(self, resp: httpx.Response) -> Any:
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        if resp.status_code >= 400:
            raise ApiError(resp.status_code, body)
        return body

    def run_job(self, job: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Dispatch a job and yield its NDJSON events; the last one carries the receipt."""
        with self._http.stream("POST", "/v1/jobs", json=job) as resp:
            if resp.status_code >= 400:
                resp.read()
                self._json(resp)
            for line in resp.iter_lines():
                if line.strip():
                    yield json.loads(line)

    def receipt(self, job_id: str, user_id: str) -> Any:
        return self._json(self._http.get(f"/v1/jobs/{job_id}", params={"user_id": user_id}))

    def status(self, user_id: str, chat_id: str) -> Any:
        return self._json(self._http.get(f"/v1/users/{user_id}/chats/{chat_id}"))

    def stop(self, user_id: str, chat_id: str) -> Any:
        return self._json(self._http.post(f"/v1/users/{user_id}/chats/{chat_id}/stop"))

    def delete(self, user_id: str, chat_id: str) -> Any:
        return self._json(self._http.delete(f"/v1/users/{user_id}/chats/{chat_id}"))

    def retire(self, user_id: str, chat_id: str, member_id: str) -> Any:
        return self._json(self._http.post(f"/v1/users/{user_id}/chats/{chat_id}/members/{member_id}/retire"))

    def fork(self, user_id: str, chat_id: str, member_id: str, new_member_id: str, at_turn: int | None) -> Any:
        body: dict[str, Any] = {"new_member_id": new_member_id}
        if at_turn is not None:
            body["at_turn"] = at_turn
        return self._json(self._http.post(f"/v1/users/{user_id}/chats/{chat_id}/members/{member_id}/fork",
                                          json=body))

    def inspect(self, user_id: str, chat_id: str, turn: int | None, *, native: bool = True) -> Any:
        params: dict[str, Any] = {"native": "true" if native else "false"}
        if turn is not None:
            params["turn"] = turn
        return self._json(self._http.get(f"/v1/users/{user_id}/chats/{chat_id}/inspect", params=params))

    def attestation(self) -> Any:
        return self._json(self._http.get("/v1/attestation"))

    def ready(self) -> tuple[int, Any]:
        resp = self._http.get("/readyz")
        return resp.status_code, resp.json()
