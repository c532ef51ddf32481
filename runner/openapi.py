"""The daemon's OpenAPI document, generated from the pydantic models (stable: sorted keys)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from runner.admission import QueuedEvent
from runner.inspector_openapi import MODELS as INSPECTOR_MODELS
from runner.inspector_openapi import inspector_paths
from runner.job_stream import CutEvent
from state.jobs import ID_PATTERN, ChatDeleted, ForkRequest, Job
from state.receipts import Receipt

API_VERSION = "1"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in (Job, Receipt, ForkRequest, CutEvent, QueuedEvent, ChatDeleted, *INSPECTOR_MODELS):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    err = {"type": "object", "properties": {"error": {"type": "string"}, "detail": {}}, "required": ["error"]}
    schemas["Error"] = err
    ids = {"in": "path", "required": True, "schema": {"type": "string", "pattern": ID_PATTERN}}
    chat = [dict(ids, name="user_id"), dict(ids, name="chat_id")]
    member = chat + [dict(ids, name="member_id")]
    e = {"application/json": {"schema": _ref("Error")}}
    paths: dict[str, Any] = {
        "/v1/jobs": {"post": {
            "summary": "Run a job; streams events as NDJSON, the last line is {type: receipt, receipt}",
            "description": ("Admission: beyond CLOUD_AGENT_MAX_TURNS (or the running-sandbox limit) a job "
                            "waits in a queue fair between users, before the answer starts and before its "
                            "job id is claimed. Once admitted, the 200 stream's first lines are the "
                            "QueuedEvent lines of every place it held (GET /v1/jobs/{job_id} shows the live "
                            "position meanwhile); still waiting at CLOUD_AGENT_QUEUE_TIMEOUT_S it is answered "
                            "503 host_busy with Retry-After, nothing ran and nothing was recorded, so the "
                            "same job may be dispatched again. "
                            "Bounds: a reader that falls a per-job byte budget behind loses the events after "
                            "that point: the stream then ends with a CutEvent line, then the receipt line "
                            "(the receipt is also stored: GET /v1/jobs/{job_id})."),
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("Job")}}},
            "responses": {"200": {"description": "event stream", "content": {"application/x-ndjson": {}}},
                          "401": {"description": "no or wrong service token", "content": e},
                          "409": {"description": "job_running or job_conflict", "content": e},
                          "413": {"description": "body_too_large: refused before it was read", "content": e},
                          "503": {"description": ("host_busy: still queued at the queue timeout; detail "
                                                  "{retry_after_s, waited_ms, position}; nothing ran"),
                                  "headers": {"Retry-After": {"description": "seconds",
                                                              "schema": {"type": "integer"}}},
                                  "content": e},
                          "422": {"description": "invalid body, naming the fields", "content": e}}}},
        "/v1/jobs/{job_id}": {"get": {
            "summary": "A job's receipt, only to its owner",
            "parameters": [dict(ids, name="job_id"), {"in": "query", "name": "user_id", "required": True,
                                                      "schema": {"type": "string"}}],
            "responses": {"200": {"description": "receipt", "content": {"application/json": {"schema": _ref("Receipt")}}},
                          "202": {"description": ("still running: {job_id, status: running}, or waiting for admission: "
                                                     "{job_id, status: queued, position}")}, "404": {"description": "not found", "content": e}}}},
        "/v1/users/{user_id}/chats/{chat_id}": {
            "get": {
                "summary": "Sandbox state, members, last receipts",
                "description": ("sandbox: state (running|stopped|lost), lost_reason, stop_reason (disk_quota: kept "
                                "stopped, turns refused), expires_at (when retention will remove it; null once "
                                "LOST), last_used_at; members: runtime, locator, settled turns, resident, "
                                "lost_reason (e.g. retention_expired); resident memory: GET /v1/host"),
                "parameters": chat, "responses": {"200": {"description": "status"}, "404": {"description": "not found"}}},
            "delete": {
                "summary": "Delete the chat: running turns cancelled (receipt reason chat_deleted), residents retired, "
                           "container and state volume removed, member records, wire ledger and captured texts "
                           "deleted; receipts kept only as tombstones (no assistant text, no locators). Idempotent; "
                           "a later job on this chat id is a new chat (NEW)",
                "parameters": chat,
                "responses": {"200": {"description": "deleted (again: nothing left to remove)",
                                      "content": {"application/json": {"schema": _ref("ChatDeleted")}}},
                              "404": {"description": "no such chat of this user", "content": e},
                              "503": {"description": "store_unavailable, host_fenced, host_unreachable", "content": e}}}},
        "/v1/users/{user_id}/chats/{chat_id}/stop": {"post": {"summary": "Idle-stop the sandbox (writable layer kept)",
                                                              "parameters": chat, "responses": {"200": {"description": "stopped"}}}},
        "/v1/users/{user_id}/chats/{chat_id}/members/{member_id}/retire": {"post": {
            "summary": "Retire the resident process (next turn RESTORED)", "parameters": member,
            "responses": {"200": {"description": "retired"}, "404": {"description": "not found"}}}},
        "/v1/users/{user_id}/chats/{chat_id}/members/{member_id}/fork": {"post": {
            "summary": "A new member whose native session is a fork", "parameters": member,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("ForkRequest")}}},
            "responses": {"200": {"description": "forked"}, "404": {"description": "not found"},
                          "413": {"description": "body_too_large", "content": e},
                          "422": {"description": "invalid body, naming the fields", "content": e}}}},
        "/v1/attestation": {"get": {"summary": "Host attestation document", "responses": {"200": {"description": "attestation"}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (text format 0.0.4)",
                             "responses": {"200": {"description": "metrics", "content": {"text/plain": {}}}}}},
        "/healthz": {"get": {"summary": "Liveness (no token)", "security": [], "responses": {"200": {"description": "ok"}}}},
        "/readyz": {"get": {"summary": "Readiness with named reasons", "responses": {"200": {"description": "ready"}, "503": {"description": "not ready"}}}},
    }
    paths.update(inspector_paths(chat))
    return {
        "openapi": "3.1.0",
        "info": {"title": "Cloud Agent session supervisor", "version": API_VERSION},
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": paths,
    }
