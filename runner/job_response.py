"""A job's NDJSON response (``POST /v1/jobs``): the job stream's chunks as they come, the
last one carrying the HTTP response's end.

Starlette's ``StreamingResponse`` ends a response with an empty body message of its own, which
uvicorn writes as a separate ``0\\r\\n\\r\\n`` chunk: one more socket write for the daemon and
one more wake-up and read for the client on every turn (issue 16's CPU per turn). The receipt
line is the stream's last, and :attr:`runner.job_stream.JobStream.drained` says so when it is
taken, so it is sent with ``more_body=False``: uvicorn writes it and the terminator at once.
Everything else (headers, a client that disconnects cancelling the stream) is Starlette's.
"""

from __future__ import annotations

from starlette.responses import StreamingResponse
from starlette.types import Send

from runner.job_stream import JobStream

NDJSON = "application/x-ndjson"


class JobResponse(StreamingResponse):
    def __init__(self, stream: JobStream) -> None:
        super().__init__(stream.chunks(), media_type=NDJSON)
        self.stream = stream

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            assert isinstance(chunk, bytes)
            ended = self.stream.drained  # nothing can follow this chunk
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        if not ended:  # the stream closed without its last line (the reader left)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
