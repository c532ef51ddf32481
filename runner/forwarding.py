"""Any host accepts any request (SPEC 16): the gate in front of the API routes of a fleet host.

A request for a chat owned by another live host is forwarded to it and its answer (status,
NDJSON stream) streamed back unchanged; a chat whose host epoch is gone answers ``LOST``
``host_lost``. The service token travels as the bearer header of the forwarded request and
is never logged. A forwarded request carries ``x-cloud-agent-forwarded-by``: its receiver
serves it locally or refuses (``misrouted``), so a request is forwarded at most once.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import structlog
from pydantic import SecretStr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from runner.fleet import Fleet, Route
from runner.job_response import NDJSON
from state.contract import StoreUnavailable
from state.jobs import Job

log = structlog.get_logger("forwarding")

FORWARDED_BY = "x-cloud-agent-forwarded-by"
# answer headers worth passing back (hop-by-hop and length headers are the server's own)
PASS_HEADERS = ("content-type", "x-job-replayed", "retry-after", "www-authenticate")


def _error(status: int, code: str, detail: str, retry_after: int | None = None) -> JSONResponse:
    resp = JSONResponse({"error": code, "detail": detail}, status_code=status)
    if retry_after is not None:
        resp.headers["retry-after"] = str(retry_after)
    return resp


class FleetGate:
    def __init__(self, fleet: Fleet, token: SecretStr | None, *, owner: str, timeout_s: float,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.fleet = fleet
        self.owner = owner
        self._token = token
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0), transport=transport)

    async def aclose(self) -> None:
        await self._client.aclose()

    # -- gates ----------------------------------------------------------------------------------

    async def job(self, request: Request, job: Job, raw: bytes) -> Response | None:
        """None: serve locally. Else the answer (forwarded, host_lost, fenced, no host)."""
        try:
            route = await self.fleet.route(job.user_id, job.chat_id, place=True)
            if route.kind == "lost":
                return await self._lost_job(job)
        except StoreUnavailable as exc:
            return _error(503, "store_unavailable", str(exc), retry_after=5)
        return await self._by_route(request, route, raw)

    async def chat(self, request: Request, user_id: str, chat_id: str, raw: bytes) -> Response | None:
        """Chat routes (status, stop, delete, retire, fork): served by the chat's owner."""
        try:
            route = await self.fleet.route(user_id, chat_id, place=False)
            if route.kind == "lost":
                await self.fleet.condemn(user_id, chat_id)
                if request.method == "GET":
                    return None  # the shared store answers, now saying LOST host_lost
                if request.method == "DELETE":
                    return None  # its records go here; its sandbox went with its host's engine
                return _error(409, "host_lost", "the chat's host is gone; its sandbox is not restored elsewhere")
        except StoreUnavailable as exc:
            return _error(503, "store_unavailable", str(exc), retry_after=5)
        if route.kind == "fenced" and request.method == "GET":
            return None
        return await self._by_route(request, route, raw)

    async def _by_route(self, request: Request, route: Route, raw: bytes) -> Response | None:
        if route.kind == "local":
            return None
        if route.kind == "fenced":
            return _error(503, "host_fenced", "this host's lease expired: it accepts no work")
        if route.kind == "no_host":
            return _error(503, "no_live_host", "no host of the fleet holds a live lease", retry_after=5)
        assert route.placement is not None
        if request.headers.get(FORWARDED_BY):
            return _error(503, "misrouted", "forwarded request for a chat this host does not own", retry_after=1)
        return await self.forward(request, route.placement.api_url, raw)

    async def _lost_job(self, job: Job) -> Response:
        answer = await self.fleet.answer_lost(job, self.owner)
        if answer.kind == "conflict":
            return _error(409, "job_conflict", "this job_id was used with another body")
        if answer.kind == "running":
            return _error(409, "job_running", "this job_id is still running")
        assert answer.receipt is not None
        line = json.dumps({"type": "receipt", "receipt": answer.receipt.model_dump(mode="json")},
                          ensure_ascii=False) + "\n"
        headers = {} if answer.fresh else {"x-job-replayed": "true"}
        return Response(line.encode(), media_type=NDJSON, headers=headers)

    # -- forwarding -----------------------------------------------------------------------------

    async def forward(self, request: Request, base_url: str, raw: bytes) -> Response:
        headers = {FORWARDED_BY: self.fleet.host_id}
        if self._token is not None:
            headers["authorization"] = f"Bearer {self._token.get_secret_value()}"
        if "content-type" in request.headers:
            headers["content-type"] = request.headers["content-type"]
        url = base_url.rstrip("/") + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        upstream = self._client.build_request(request.method, url, content=raw, headers=headers)
        try:
            resp = await self._client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            log.warning("forward.unreachable", to=base_url, error=type(exc).__name__)
            return _error(503, "host_unreachable", "the chat's host does not answer (it is lost once its lease"
                          " expires)", retry_after=max(1, int(self.fleet.ttl_s)))
        log.info("forward.sent", to=base_url, path=request.url.path, status=resp.status_code)
        ndjson = resp.headers.get("content-type", "").startswith(NDJSON)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:
                # The owner went away mid-answer: say so in the stream's own format. The job's
                # receipt (if it commits) stays fetchable by id from any host.
                log.warning("forward.broken", to=base_url, error=type(exc).__name__)
                if ndjson:
                    yield (json.dumps({"type": "error", "error": "host_unreachable",
                                       "detail": "the owner host's answer broke off"}) + "\n").encode()
            finally:
                await resp.aclose()

        passed = {k: v for k, v in resp.headers.items() if k.lower() in PASS_HEADERS}
        return StreamingResponse(body(), status_code=resp.status_code, headers=passed)
