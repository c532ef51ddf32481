"""The daemon's OpenAPI document is stable: it changes only together with this snapshot."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runner.openapi import openapi_document

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "openapi.json"


def test_openapi_matches_the_committed_snapshot() -> None:
    # Regenerate deliberately when the API changes:
    #   uv run python -c "import json; from runner.openapi import openapi_document as d; \
    #     print(json.dumps(d(), indent=1, sort_keys=True))" > tests/data/openapi.json
    assert openapi_document() == json.loads(SNAPSHOT.read_text())


def test_every_route_is_documented() -> None:
    from runner.daemon import Api

    class _Sup:  # routes() needs no real supervisor
        pass

    routes = {r.path for r in Api(_Sup(), None, max_message_bytes=1).routes()}  # type: ignore[arg-type]
    # Starlette's path converters ({path:path}) are not OpenAPI's templating ({path}).
    routes = {re.sub(r"\{(\w+):\w+\}", r"{\1}", p) for p in routes}
    assert routes - {"/openapi.json"} == set(openapi_document()["paths"])


def test_every_route_method_is_documented() -> None:
    from runner.daemon import Api

    class _Sup:
        pass

    served = {(re.sub(r"\{(\w+):\w+\}", r"{\1}", r.path), m.lower())
              for r in Api(_Sup(), None, max_message_bytes=1).routes()  # type: ignore[arg-type]
              for m in (r.methods or set()) - {"HEAD"} if r.path != "/openapi.json"}
    documented = {(p, m) for p, ops in openapi_document()["paths"].items() for m in ops}
    assert served == documented
    assert ("/v1/users/{user_id}/chats/{chat_id}", "delete") in served
