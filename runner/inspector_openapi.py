"""The inspector routes' part of the OpenAPI document (runner/openapi.py merges it)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from runner.diagnosis import Diagnosis
from runner.host_view import HostView
from runner.timeline import DEFAULT_PAGE, MAX_PAGE, TurnPage

MODELS: tuple[type[BaseModel], ...] = (TurnPage, Diagnosis, HostView)


def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}


def inspector_paths(chat: list[dict[str, Any]]) -> dict[str, Any]:
    err = _json("Error")
    bad = {"description": "invalid parameter, naming the field", "content": err}
    missing = {"description": "no such chat (another user's chat answers the same)", "content": err}
    base = "/v1/users/{user_id}/chats/{chat_id}"
    return {
        f"{base}/turns": {"get": {
            "summary": "The chat's turns in start order (then job id) with their receipts, paged",
            "parameters": chat + [
                {"in": "query", "name": "limit", "required": False,
                 "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": DEFAULT_PAGE}},
                {"in": "query", "name": "cursor", "required": False, "schema": {"type": "string"},
                 "description": "next_cursor of the previous page"}],
            "responses": {"200": {"description": "one page", "content": _json("TurnPage")}, "404": missing,
                          "422": bad}}},
        f"{base}/inspect": {"get": {
            "summary": "The diagnosis of one turn: route, session identity, native state, request",
            "parameters": chat + [
                {"in": "query", "name": "turn", "required": False, "schema": {"type": "integer", "minimum": 1},
                 "description": "the turn's index in the timeline; default the latest"},
                {"in": "query", "name": "native", "required": False, "schema": {"type": "boolean", "default": False},
                 "description": "list the member's native session files with one exec in the running sandbox"}],
            "responses": {"200": {"description": "diagnosis", "content": _json("Diagnosis")}, "404": missing,
                          "422": bad}}},
        "/v1/host": {"get": {
            "summary": "Residents (memory against the budget), the queue, sandboxes, the attestation summary",
            "responses": {"200": {"description": "host view", "content": _json("HostView")}}}},
        "/ui": {"get": {"summary": "Redirect to /ui/", "security": [],
                        "responses": {"307": {"description": "to /ui/"}}}},
        "/ui/{path}": {"get": {
            "summary": "The operator page's static files (no data; the page sends the token on its JSON calls)",
            "security": [],
            "parameters": [{"in": "path", "name": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "a file of the page",
                                  "content": {"text/html": {}, "text/css": {}, "text/javascript": {}}},
                          "404": {"description": "no such file"}}}},
    }
