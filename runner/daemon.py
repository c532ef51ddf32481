"""The host daemon's HTTP API (SPEC section 10), a Starlette app.

Every route but /healthz requires ``Authorization: Bearer <service token>`` (constant-time
compare). Another user's chat, job or member answers exactly like a missing one.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import SecretStr, ValidationError
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runner.api_errors import error, path_ids, validation_error
from runner.bounds import BadBody, BodyTooLarge, parse_json, read_body
from runner.durable_responses import DurableResponses
from runner.forks import ForkError
from runner.forwarding import FleetGate
from runner.inspector_api import InspectorRoutes
from runner.job_response import NDJSON, JobResponse
from runner.job_stream import ndjson_line
from runner.openapi import openapi_document
from runner.supervisor import Supervisor
from state.contract import Fenced, StoreUnavailable
from state.jobs import ID_PATTERN, ForkRequest, Job

_ID = re.compile(ID_PATTERN)
# A job is one flat object; nothing legitimate nests deeper than this.
MAX_JSON_DEPTH = 16
FORK_BODY_BYTES = 16 * 1024

Handler = Callable[[Request], Awaitable[Response]]


async def json_body(request: Request, limit: int) -> tuple[bytes, Any] | Response:
    """(raw, parsed), or the error response (413 over ``limit``, 422 malformed or too deep)."""
    try:
        raw = await read_body(request, limit)
        return raw, parse_json(raw, max_depth=MAX_JSON_DEPTH)
    except BodyTooLarge as exc:
        return error(413, "body_too_large", {"field": "body", "limit_bytes": exc.limit})
    except BadBody as exc:
        return error(422, "invalid_request", [{"field": "body", "message": exc.message, "type": exc.kind}])


class Api:
    def __init__(self, supervisor: Supervisor, token: SecretStr | None, *, max_message_bytes: int,
                 max_body_bytes: int | None = None,
                 attestation: Callable[[], Awaitable[dict[str, Any]]] | None = None,
                 readiness: Callable[[], Awaitable[tuple[list[str], dict[str, str]]]] | None = None,
                 gate: FleetGate | None = None) -> None:
        self.sup = supervisor
        self.gate = gate  # a fleet host: requests for other hosts' chats are forwarded
        self.token = token
        self.max_message_bytes = max_message_bytes
        # JSON escapes can make a message up to 6x longer on the wire (\u0001).
        self.max_body_bytes = max_body_bytes or 6 * max_message_bytes + 64 * 1024
        self.attestation = attestation
        self.readiness = readiness

    # -- auth ------------------------------------------------------------------------------------

    def authorized(self, request: Request) -> bool:
        if self.token is None:
            return True  # loopback-only development mode (refused at start otherwise)
        header = request.headers.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        # Constant time: compare_digest of two SHA-256 digests (always equal lengths, so not
        # even the token's length leaks), evaluated whatever the scheme; never logged or echoed.
        expected = hashlib.sha256(self.token.get_secret_value().encode()).digest()
        ok = hmac.compare_digest(hashlib.sha256(presented.strip().encode()).digest(), expected)
        return ok and scheme.lower() == "bearer"

    def guard(self, handler: Handler) -> Handler:
        async def wrapped(request: Request) -> Response:
            if not self.authorized(request):
                resp = error(401, "unauthorized")
                resp.headers["www-authenticate"] = "Bearer"
                return resp
            return await handler(request)

        return wrapped

    async def _gate_chat(self, request: Request, ids: tuple[str, ...]) -> Response | None:
        if self.gate is None:
            return None
        try:
            raw = await read_body(request, FORK_BODY_BYTES)  # chat routes take small bodies (fork)
        except BodyTooLarge as exc:
            return error(413, "body_too_large", {"field": "body", "limit_bytes": exc.limit})
        except BadBody as exc:
            return error(422, "invalid_request", [{"field": "body", "message": exc.message, "type": exc.kind}])
        return await self.gate.chat(request, ids[0], ids[1], raw)

    def chat_guard(self, handler: Handler) -> Handler:
        """guard + (a fleet host) served by the chat's owner: for routes with user and chat ids."""

        async def gated(request: Request) -> Response:
            p = request.path_params
            ids = (p.get("user_id", ""), p.get("chat_id", ""))
            if self.gate is not None and all(_ID.match(i) and ".." not in i for i in ids):
                if (routed := await self._gate_chat(request, ids)) is not None:
                    return routed
            return await handler(request)

        return self.guard(gated)

    # -- routes ----------------------------------------------------------------------------------

    async def post_job(self, request: Request) -> Response:
        read = await json_body(request, self.max_body_bytes)
        if isinstance(read, Response):
            return read
        raw, body = read
        if not isinstance(body, dict):
            return error(422, "invalid_request", [{"field": "body", "message": "must be an object", "type": "type"}])
        try:
            job = Job.model_validate(body)
        except ValidationError as exc:
            return validation_error(exc)
        if len(job.message.encode()) > self.max_message_bytes:
            return error(422, "invalid_request", [{"field": "message", "type": "too_long",
                                                   "message": f"over {self.max_message_bytes} bytes"}])
        if self.gate is not None and (routed := await self.gate.job(request, job, raw)) is not None:
            return routed
        try:
            sub = await self.sup.submit(job)
        except Fenced:
            return error(503, "host_fenced", "this host's lease expired: it accepts no work")
        except StoreUnavailable as exc:
            resp = error(503, "store_unavailable", str(exc))
            resp.headers["retry-after"] = "5"
            return resp
        if sub.kind == "conflict":
            return error(409, "job_conflict", "this job_id was used with another body")
        if sub.kind == "running":
            return error(409, "job_running", "this job_id is still running")
        if sub.kind == "busy":
            assert sub.busy is not None
            b = sub.busy
            resp = error(503, "host_busy", {"retry_after_s": b.retry_after_s, "waited_ms": b.waited_ms,
                                            "position": b.position})
            resp.headers["retry-after"] = str(b.retry_after_s)
            return resp
        if sub.kind == "done":
            assert sub.receipt is not None
            line = ndjson_line({"type": "receipt", "receipt": sub.receipt.model_dump(mode="json")})
            return Response(line, media_type=NDJSON, headers={"x-job-replayed": "true"})
        events = sub.events
        assert events is not None

        return JobResponse(events)

    async def get_job(self, request: Request) -> Response:
        user_id = request.query_params.get("user_id", "")
        job_id = request.path_params["job_id"]
        bad = [{"field": f, "message": f"must match {ID_PATTERN}", "type": "string_pattern_mismatch"}
               for f, v in (("job_id", job_id), ("user_id", user_id)) if not _ID.match(v)]
        if bad:
            return error(422, "invalid_request", bad)
        result = await self.sup.get_receipt(job_id, user_id)
        if result == "running" and self.gate is not None:
            rec = await self.sup.store.get_job(user_id, job_id)
            if rec is not None and (closed := await self.gate.fleet.close_orphan(rec)) is not None:
                result = closed  # its host epoch is gone: it never commits
        if result is None:
            return error(404, "not_found")
        if result == "running":
            return JSONResponse({"job_id": job_id, "status": "running"}, status_code=202)
        if isinstance(result, int):
            return JSONResponse({"job_id": job_id, "status": "queued", "position": result}, status_code=202)
        return JSONResponse(result.model_dump(mode="json"))

    async def chat_status(self, request: Request) -> Response:
        ids = path_ids(request, "user_id", "chat_id")
        if isinstance(ids, JSONResponse):
            return ids
        if (routed := await self._gate_chat(request, ids)) is not None:
            return routed
        status = await self.sup.chat_status(*ids)
        return error(404, "not_found") if status is None else JSONResponse(status)

    async def stop_chat(self, request: Request) -> Response:
        ids = path_ids(request, "user_id", "chat_id")
        if isinstance(ids, JSONResponse):
            return ids
        if (routed := await self._gate_chat(request, ids)) is not None:
            return routed
        if await self.sup.chat_status(*ids) is None:
            return error(404, "not_found")
        return JSONResponse({"stopped": await self.sup.stop_chat(*ids)})

    async def delete_chat(self, request: Request) -> Response:
        """Behind chat_guard: in a fleet the chat's owner host deletes it (its engine holds it)."""
        ids = path_ids(request, "user_id", "chat_id")
        if isinstance(ids, JSONResponse):
            return ids
        try:
            result = await self.sup.delete_chat(*ids)
        except StoreUnavailable as exc:
            resp = error(503, "store_unavailable", str(exc))
            resp.headers["retry-after"] = "5"
            return resp
        return error(404, "not_found") if result is None else JSONResponse(result.model_dump(mode="json"))

    async def retire_member(self, request: Request) -> Response:
        ids = path_ids(request, "user_id", "chat_id", "member_id")
        if isinstance(ids, JSONResponse):
            return ids
        if (routed := await self._gate_chat(request, ids)) is not None:
            return routed
        result = await self.sup.retire_member(*ids)
        return error(404, "not_found") if result is None else JSONResponse({"retired": result})

    async def fork_member(self, request: Request) -> Response:
        ids = path_ids(request, "user_id", "chat_id", "member_id")
        if isinstance(ids, JSONResponse):
            return ids
        if (routed := await self._gate_chat(request, ids)) is not None:
            return routed
        # Existence and ownership before anything else: another user's member answers exactly
        # like a missing one, whatever the body and whether fork is implemented.
        if await self.sup.store.get_member(*ids) is None:
            return error(404, "not_found")
        read = await json_body(request, FORK_BODY_BYTES)
        if isinstance(read, Response):
            return read
        try:
            req = ForkRequest.model_validate(read[1])
        except ValidationError as exc:
            return validation_error(exc)
        try:
            return JSONResponse(await self.sup.fork(*ids, req))
        except ForkError as exc:
            return error(exc.status, exc.code, exc.detail or None)

    async def attest(self, request: Request) -> Response:
        if self.attestation is None:
            return error(501, "not_implemented")
        return JSONResponse(await self.attestation())

    async def healthz(self, request: Request) -> Response:
        return JSONResponse({"ok": True})

    async def readyz(self, request: Request) -> Response:
        reasons, detail = await self.readiness() if self.readiness else ([], {})
        return JSONResponse({"ready": not reasons, "reasons": reasons, "detail": detail},
                            status_code=503 if reasons else 200)

    async def metrics(self, request: Request) -> Response:
        body, content_type = await self.sup.render_metrics(request.headers.get("accept", ""))
        return Response(body, headers={"content-type": content_type})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_document())

    def routes(self) -> list[Route]:
        g = self.guard
        base = "/v1/users/{user_id}/chats/{chat_id}"
        return [
            Route("/v1/jobs", g(self.post_job), methods=["POST"]),
            Route("/v1/jobs/{job_id}", g(self.get_job), methods=["GET"]),
            Route(base, g(self.chat_status), methods=["GET"]),
            Route(base, self.chat_guard(self.delete_chat), methods=["DELETE"]),
            Route(f"{base}/stop", g(self.stop_chat), methods=["POST"]),
            Route(f"{base}/members/{{member_id}}/retire", g(self.retire_member), methods=["POST"]),
            Route(f"{base}/members/{{member_id}}/fork", g(self.fork_member), methods=["POST"]),
            Route("/v1/attestation", g(self.attest), methods=["GET"]),
            *InspectorRoutes(self).routes(self.chat_guard),  # /v1/host and /ui have no chat ids
            Route("/openapi.json", g(self.openapi), methods=["GET"]),
            Route("/metrics", g(self.metrics), methods=["GET"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", g(self.readyz), methods=["GET"]),
        ]


def create_app(api: Api, lifespan: Any = None) -> Starlette:
    # every response waits for the commits it may have read to be durable (a turn's is
    # flushed after its COMMIT: runner.durable_responses)
    return Starlette(routes=api.routes(), lifespan=lifespan,
                     middleware=[Middleware(DurableResponses, store=api.sup.store)])
