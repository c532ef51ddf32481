"""Test seams for the deployment smoke (deploy.smoke): httpx transports that break one step,
so a test can see the smoke name that step and still delete its chat. Test-only: the product
has no flag for any of this."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx

from sandbox_manager.identity import container_name
from sandbox_manager.volumes import volume_name


class Seam(httpx.AsyncBaseTransport):
    """The real transport, with a hook on each answer (the body read in full)."""

    def __init__(self, on_answer: Callable[[httpx.Request, httpx.Response, bytes], bytes]) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self._on_answer = on_answer
        self.seen: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await self._inner.handle_async_request(request)
        body = await resp.aread()
        await resp.aclose()
        self.seen.append(f"{request.method} {request.url.path} {resp.status_code}")
        body = self._on_answer(request, resp, body)
        headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in ("content-length", "transfer-encoding")]
        return httpx.Response(resp.status_code, headers=headers, content=body, request=request)


def remove_sandbox_after_stop(docker_client) -> Seam:
    """Once the idle stop answered, the chat's container and its state volume are removed
    behind the daemon's back (a container alone is recreated on the volume: SPEC 15)."""

    def hook(request: httpx.Request, resp: httpx.Response, body: bytes) -> bytes:
        parts = request.url.path.split("/")  # /v1/users/U/chats/C/stop
        if request.method == "POST" and parts[-1] == "stop" and resp.status_code == 200:
            docker_client.api.remove_container(container_name(parts[3], parts[5]), force=True)
            docker_client.api.remove_volume(volume_name(container_name(parts[3], parts[5])))
        return body

    return Seam(hook)


def forge_locator_of(step: str, forged: str = "forged-locator") -> Seam:
    """The receipt of the job of ``step`` names another locator (as if the session changed)."""

    def hook(request: httpx.Request, resp: httpx.Response, body: bytes) -> bytes:
        if request.method != "POST" or request.url.path != "/v1/jobs":
            return body
        if not json.loads(request.content)["job_id"].endswith(f"-{step}"):
            return body
        out = []
        for line in body.decode().splitlines():
            event = json.loads(line)
            if event.get("type") == "receipt":
                event["receipt"]["locator_after"] = forged
            out.append(json.dumps(event))
        return ("\n".join(out) + "\n").encode()

    return Seam(hook)
