"""A small sync client of the control API, for processes that did not start the fixture
(the daemon, the demo, a test talking to ``python -m deploy.loopback``)."""

from __future__ import annotations

from typing import Any

import httpx

from .models import RecordedRequest, Rule


class FixtureClient:
    def __init__(self, base_url: str, *, token: str, timeout: float = 10.0) -> None:
        """``token``: the fixture's control token (``LoopbackFixture.control_token``; the
        ``--token-file`` of ``python -m deploy.loopback``)."""
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout,
                                  headers={"authorization": f"Bearer {token}"})

    def requests(self, *, since: int = 0, kind: str | None = None, api: str | None = None) -> list[RecordedRequest]:
        params: dict[str, Any] = {"since": since}
        if kind:
            params["kind"] = kind
        if api:
            params["api"] = api
        resp = self._http.get("/_fixture/requests", params=params)
        resp.raise_for_status()
        return [RecordedRequest.model_validate(r) for r in resp.json()["requests"]]

    def add_rules(self, *rules: Rule, replace: bool = False) -> list[str]:
        payload = {"rules": [r.model_dump(mode="json") for r in rules], "replace": replace}
        resp = self._http.post("/_fixture/rules", json=payload)
        resp.raise_for_status()
        return resp.json()["rules"]

    def rules(self) -> list[Rule]:
        resp = self._http.get("/_fixture/rules")
        resp.raise_for_status()
        return [Rule.model_validate(r) for r in resp.json()["rules"]]

    def reset(self, *, requests: bool = True, rules: bool = True) -> None:
        self._http.post("/_fixture/reset", json={"requests": requests, "rules": rules}).raise_for_status()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> FixtureClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
