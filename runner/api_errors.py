"""Error answers of the HTTP API: a code, and for bad input the fields it names."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from state.jobs import ID_PATTERN

_ID = re.compile(ID_PATTERN)


def error(status: int, code: str, detail: Any = None) -> JSONResponse:
    body: dict[str, Any] = {"error": code}
    if detail is not None:
        body["detail"] = detail
    return JSONResponse(body, status_code=status)


def validation_error(exc: ValidationError) -> JSONResponse:
    fields = []
    for e in exc.errors(include_url=False, include_input=False):
        loc = ".".join(str(p) for p in e["loc"]) or "body"
        fields.append({"field": loc, "message": e["msg"], "type": e["type"]})
    return error(422, "invalid_request", fields)


def path_ids(request: Request, *names: str) -> tuple[str, ...] | JSONResponse:
    bad = [{"field": n, "message": f"must match {ID_PATTERN}", "type": "string_pattern_mismatch"}
           for n in names if not _ID.match(request.path_params[n]) or ".." in request.path_params[n]]
    if bad:
        return error(422, "invalid_request", bad)
    return tuple(request.path_params[n] for n in names)
