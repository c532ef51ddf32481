"""Re-record the pi RPC streams under tests/data/pi/ (real pi 0.73.1 + the loopback fixture).

    PI_BIN_DIR=/path/to/dir/with/pi/and/node uv run python tests/data/pi/capture.py

Each scenario runs the real :class:`drivers.pi.PiDriver` on a fresh NEW member with a
:class:`tests.support.replay.RecordingTransport`, so a file holds exactly what the driver sent
(``in``) and what pi printed (``out``): the handshake ``get_state``, the turn(s), the
barriers. Trimming: ``message_update`` loses its ``partial`` snapshot (the driver never
reads it: it is a mutated object, protocols/pi.md §3) and ``get_state`` answers lose the
``model`` object; everything else is verbatim.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from deploy.loopback import rules as R  # noqa: E402
from deploy.loopback.server import LoopbackFixture  # noqa: E402
from drivers.models import GatewayConfig, MemberPaths  # noqa: E402
from drivers.pi import PiDriver  # noqa: E402
from tests.support.pi_replay import PI_DIRECTIONS  # noqa: E402
from tests.support.replay import RecordingTransport, dump_stream  # noqa: E402
from tests.support.local_process import LocalProcessTransport  # noqa: E402

OUT = Path(__file__).resolve().parent


def trim(line: bytes) -> bytes:
    try:
        obj = json.loads(line)
    except ValueError:
        return line
    if not isinstance(obj, dict):
        return line
    ev = obj.get("assistantMessageEvent")
    if isinstance(ev, dict):
        ev.pop("partial", None)
    if obj.get("type") == "response" and isinstance(obj.get("data"), dict):
        obj["data"].pop("model", None)
    return json.dumps(obj, ensure_ascii=False).encode()


async def scenario(fx: LoopbackFixture, name: str, messages: list[str], *, interrupt_after: float | None = None,
                   fork_at: int | None = None, drop_key: bool = False, **settings: object) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f"pi-cap-{name}-"))
    paths = MemberPaths(home=str(tmp / "home"), workspace=str(tmp / "ws"), run_dir=str(tmp / "run"))
    bindir = os.environ.get("PI_BIN_DIR", "")
    driver = PiDriver(extra_env={"PATH": f"{bindir}:/usr/bin:/bin"}, retry_base_delay_ms=200, **settings)
    launch = driver.plan(paths, GatewayConfig(base_url=fx.base_url, key="sk-capture", model="fixture-model"), None)
    if drop_key:  # the key variable never reaches pi (recorded with the `!printenv` apiKey of pi 0.73.1's
        # driver until stop 26: pi refused to send; with today's bare name pi sends the name itself)
        env = {k: v for k, v in launch.spec.env.items() if k != "CA_PI_GATEWAY_KEY"}
        launch = launch.model_copy(update={"spec": launch.spec.model_copy(update={"env": env})})
    inner = await LocalProcessTransport.start(launch.spec, run_dir=Path(paths.run_dir))
    rec = RecordingTransport(inner, directions=PI_DIRECTIONS)
    session = driver.session(rec, launch)
    try:
        await session.handshake()
        for msg in messages:
            async with anyio.create_task_group() as tg:
                result: list[object] = []

                async def run(m: str = msg) -> None:
                    result.append(await session.run_turn(m, timeout_s=60))

                tg.start_soon(run)
                if interrupt_after is not None and "STALL" in msg:
                    await anyio.sleep(interrupt_after)
                    await session.interrupt()
            print(name, repr(msg), "->", result[0])
        if fork_at is not None:
            print(name, "fork ->", await session.fork(fork_at))
            print(name, "after fork ->", await session.run_turn("on the fork", timeout_s=60))
    finally:
        await inner.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    entries = [(d, trim(line) if d == "out" else line) for d, line in rec.entries]
    dump_stream(entries, OUT / f"{name}.jsonl", errors="strict")


async def main() -> None:
    with LoopbackFixture.start() as fx:
        fx.add_rules(
            R.shell_call("echo hi-from-tool", match="TOOL", then_reply="tool done"),
            R.reject(match="FAIL400"),
            R.fail(500, match="FLAKY", times=1),
            R.fail(503, match="ALWAYS503"),
            R.stall(5, match="STALL"),
            R.reject(context_window=True, match="HUGE"),
        )
        await scenario(fx, "tool_call", ["please TOOL now"])
        await scenario(fx, "terminal_400", ["please FAIL400 now", "after the error"])
        await scenario(fx, "retry_success", ["FLAKY one"])
        await scenario(fx, "retry_exhausted", ["ALWAYS503 please"], retry_max=1)
        await scenario(fx, "abort", ["STALL please", "after abort"], interrupt_after=0.5)
        await scenario(fx, "overflow_stale", ["HUGE one", "after huge"])
        await scenario(fx, "key_missing", ["hello without a key"], drop_key=True)
        await scenario(fx, "fork", ["u1", "u2"], fork_at=1)


if __name__ == "__main__":
    anyio.run(main)
