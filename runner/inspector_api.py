"""The inspector's routes (SPEC section 17): a chat's paged timeline, one turn's diagnosis,
the host view (JSON, behind the service token like every data route) and the operator
page's static files under ``/ui/``.

The page is static files only (no build step, no external asset): they carry no data and
are served without a token; the page asks for the token and sends it as the bearer header
on every JSON call. A strict Content-Security-Policy keeps the page from loading anything
that is not this daemon's, even by mistake.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from runner.api_errors import error, path_ids
from runner.captured_texts import fill_captured_texts
from runner.diagnosis import Evidence, diagnose, wire_of
from runner.host_view import host_view
from runner.native_probe import probe_native_state
from runner.timeline import DEFAULT_PAGE, MAX_PAGE, BadCursor, chat_exists, member_history, turn_at, turn_page

if TYPE_CHECKING:
    from runner.daemon import Api

UI_DIR = Path(__file__).resolve().parent / "ui"
UI_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
            ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
UI_HEADERS = {
    "content-security-policy": ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def _bad(field: str, message: str, kind: str) -> JSONResponse:
    return error(422, "invalid_request", [{"field": field, "message": message, "type": kind}])


def _int_param(request: Request, name: str, *, default: int | None, lo: int, hi: int | None = None
               ) -> int | None | JSONResponse:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    if not raw.isdigit():
        return _bad(name, "must be an integer", "int_parsing")
    value = int(raw)
    if value < lo or (hi is not None and value > hi):
        return _bad(name, f"must be between {lo} and {hi}" if hi else f"must be at least {lo}", "out_of_range")
    return value


def _bool_param(request: Request, name: str) -> bool | JSONResponse:
    raw = request.query_params.get(name, "").lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    return _bad(name, "must be true or false", "bool_parsing")


class InspectorRoutes:
    def __init__(self, api: Api) -> None:
        self.api = api
        self.sup = api.sup

    async def _chat(self, request: Request) -> tuple[str, str] | Response:
        ids = path_ids(request, "user_id", "chat_id")
        if isinstance(ids, JSONResponse):
            return ids
        user_id, chat_id = ids
        # Another user's chat is indistinguishable from a missing one: every lookup is scoped.
        if not await chat_exists(self.sup.store, user_id, chat_id):
            return error(404, "not_found")
        return user_id, chat_id

    async def turns(self, request: Request) -> Response:
        limit = _int_param(request, "limit", default=DEFAULT_PAGE, lo=1, hi=MAX_PAGE)
        if isinstance(limit, Response):
            return limit
        chat = await self._chat(request)
        if isinstance(chat, Response):
            return chat
        try:
            page = await turn_page(self.sup.store, *chat, cursor=request.query_params.get("cursor") or None,
                                   limit=limit or DEFAULT_PAGE)
        except BadCursor as exc:
            return _bad("cursor", str(exc), "value_error")
        return JSONResponse(page.model_dump(mode="json"))

    async def inspect(self, request: Request) -> Response:
        index = _int_param(request, "turn", default=None, lo=1)
        if isinstance(index, Response):
            return index
        native = _bool_param(request, "native")
        if isinstance(native, Response):
            return native
        chat = await self._chat(request)
        if isinstance(chat, Response):
            return chat
        user_id, chat_id = chat
        store = self.sup.store
        turn = await turn_at(store, user_id, chat_id, index)
        if turn is None:
            total = await store.count_chat_jobs(user_id, chat_id)
            return error(404, "not_found", f"no turn {index}: the chat has {total}")
        member = await store.get_member(user_id, chat_id, turn.member_id)
        sandbox = await store.get_sandbox(user_id, chat_id)
        history = await member_history(store, turn, user_id, chat_id)
        wire = wire_of(turn.receipt)
        await fill_captured_texts(store, user_id, chat_id, turn.job_id, wire, history)
        evidence = Evidence(user_id=user_id, chat_id=chat_id, turn=turn, host_id=self.sup.manager.config.host_id,
                            wire=wire, member=member, sandbox=sandbox, history=history)
        if native:
            evidence.native = await probe_native_state(self.sup.engine, sandbox, member)
        return JSONResponse(diagnose(evidence).model_dump(mode="json"))

    async def host(self, request: Request) -> Response:
        doc = await self.api.attestation() if self.api.attestation is not None else None
        return JSONResponse((await host_view(self.sup, doc)).model_dump(mode="json"))

    async def ui_root(self, request: Request) -> Response:
        return RedirectResponse("/ui/", status_code=307)

    async def ui_file(self, request: Request) -> Response:
        rel = request.path_params["path"] or "index.html"
        target = (UI_DIR / rel).resolve()
        kind = UI_TYPES.get(target.suffix)
        # Only the page's own files: nothing outside the package directory, no other types.
        if kind is None or not target.is_relative_to(UI_DIR) or not target.is_file():
            return Response("not found\n", status_code=404, media_type="text/plain", headers=UI_HEADERS)
        return Response(target.read_bytes(), media_type=kind, headers=UI_HEADERS)

    def routes(self, guard: Callable[[Callable[[Request], Awaitable[Response]]], Any]) -> list[Route]:
        base = "/v1/users/{user_id}/chats/{chat_id}"
        return [
            Route(f"{base}/turns", guard(self.turns), methods=["GET"]),
            Route(f"{base}/inspect", guard(self.inspect), methods=["GET"]),
            Route("/v1/host", guard(self.host), methods=["GET"]),
            Route("/ui", self.ui_root, methods=["GET"]),
            Route("/ui/{path:path}", self.ui_file, methods=["GET"]),
        ]
