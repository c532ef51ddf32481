"""The model proxy service's control protocol and server (runner/proxy_protocol.py,
runner/proxy_control.py), served in this process in front of the real loopback fixture: a reply
streams on after its daemon went away and its record names the turn, the running turns a dead
daemon left are forgotten on request, the service lingers out only with no daemon and nothing in
flight, and its counters reach a daemon's registry as one exposition."""

from __future__ import annotations

import gc
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr, ValidationError

from deploy.loopback import LoopbackFixture, stall
from proxy import ProxyConfig
from proxy.sockets import UnixListener
from runner.proxy_attribution import Attribution
from runner.proxy_link import LinkClosed, LinkOps, ProxyServiceError, linked
from runner.proxy_metrics_relay import ProxyMetricsRelay
from runner.proxy_protocol import Begin, RequestLine, ServiceConfig, Stop, parse_request
from runner.proxy_service import run_service
from state.store import Store
from telemetry.gc_pauses import PROXY_SERVICE, GcPauses
from telemetry.metrics import exposition
from tests.support.metrics import sample
from tests.support.proxy_harness import key_file, uds_client
from tests.support.store import rows

pytestmark = pytest.mark.anyio

CHAT = "ca-chat-a"
ANTHROPIC = {"model": "m", "stream": True, "max_tokens": 64,
             "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]}


@pytest.fixture
def fx():
    with LoopbackFixture.start() as f:
        yield f


@pytest.fixture
def sockets() -> AsyncIterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ca-pc-", dir="/tmp"))  # a tmp_path is too long for a socket address
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config(home: Path, upstream: str, linger_s: float = 60.0) -> ServiceConfig:
    home.mkdir(parents=True, exist_ok=True)
    return ServiceConfig(home=home, proxy=ProxyConfig(upstream_url=upstream, key_file=key_file(home)),
                         store_path=home / "store.db", linger_s=linger_s)


class Service:
    """``run_service`` in a task of this process; ``reason`` once it returned."""

    def __init__(self, cfg: ServiceConfig, on_ready: Callable[[CollectorRegistry], None] | None = None) -> None:
        self.cfg, self.on_ready = cfg, on_ready
        self.reason: str | None = None
        self.done = anyio.Event()

    async def run(self) -> None:
        try:
            self.reason = await run_service(self.cfg, on_ready=self.on_ready)
        finally:
            self.done.set()

    async def listening(self) -> None:
        with anyio.fail_after(10):
            while not self.cfg.paths.control.exists():
                await anyio.sleep(0.01)


# -- the protocol ---------------------------------------------------------------------------------


def test_a_request_line_names_its_operation_and_nothing_else_parses() -> None:
    line = RequestLine(id=7, request=Begin(chat_key=CHAT, member_key="mk", member_id="m1", job_id="j1"))
    assert parse_request(line.model_dump_json().encode()) == line
    assert json.loads(line.model_dump_json()) == {"id": 7, "request": {"op": "begin", "chat_key": CHAT,
                                                                       "member_key": "mk", "member_id": "m1",
                                                                       "job_id": "j1"}}
    for bad in (b'{"id": 1, "request": {"op": "exec", "argv": ["sh"]}}', b'{"id": 1, "request": {"op": "begin"}}',
                b'{"request": {"op": "metrics"}}', b"not json"):
        with pytest.raises(ValidationError):
            parse_request(bad)


def test_the_store_url_goes_to_the_service_and_nowhere_else(tmp_path: Path) -> None:
    url = "postgresql://ca:s3cret-pw@db.example/ca"
    cfg = config(tmp_path / "home", "http://127.0.0.1:9").model_copy(update={"store_url": SecretStr(url)})
    assert json.loads(cfg.to_json())["store_url"] == url  # the service's stdin
    assert "s3cret-pw" not in repr(cfg) and "s3cret-pw" not in cfg.model_dump_json()
    assert "s3cret-pw" not in cfg.digest()
    assert cfg.digest() == ServiceConfig.model_validate_json(cfg.to_json()).digest()
    assert cfg.digest() != cfg.model_copy(update={"linger_s": 61.0}).digest()


def test_attribution_keeps_a_turn_until_its_own_end_and_forgets_what_it_is_told() -> None:
    a = Attribution()
    a.open_chat(CHAT, "u1", "c1")
    a.begin(CHAT, "mk1", "m1", "j1")
    a.begin(CHAT, "mk2", "m2", "j2")
    a.begin("ca-chat-b", "mk1", "m1", "j3")
    a.end(CHAT, "mk1", "j0")  # an older turn's end leaves the running one
    assert (a.turn_of(CHAT, "mk1"), a.turn_of(CHAT, "mk2")) == ("j1", "j2")
    assert a.keep_turns(["j1"]) == ["j2", "j3"]
    assert a.turns == {(CHAT, "mk1"): "j1"}
    a.close_chat(CHAT)
    assert (a.chats, a.members, a.turns) == ({}, {("ca-chat-b", "mk1"): "m1"}, {})


# -- the server -----------------------------------------------------------------------------------


async def test_a_reply_streams_on_after_its_daemon_went_away_and_names_the_turn(fx: LoopbackFixture, tmp_path: Path,
                                                                               sockets: Path) -> None:
    fx.add_rule(stall(1.0, match="hello there", times=1))
    service = Service(config(tmp_path / "home", fx.base_url))
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.run)
        await service.listening()
        async with linked(service.cfg.paths.control) as link:
            assert (await link.hello("daemon")).daemons == 1
            ops = LinkOps(link)
            path = await ops.open(CHAT, "u1", "c1", sockets / "a")
            await ops.begin(CHAT, "mk1", "m1", "job-1")
            client = uds_client(path)
            stream = await client.send(client.build_request("POST", "/m/mk1/v1/messages", json=ANTHROPIC),
                                       stream=True)
            chunks = stream.aiter_raw()
            first = await chunks.__anext__()
        # the daemon is gone (its connection closed) while the reply is held upstream
        rest = b"".join([chunk async for chunk in chunks])
        await client.aclose()
        assert first.startswith(b"event: message_start") and rest.rstrip().endswith(b'data: {"type":"message_stop"}')
        async with linked(service.cfg.paths.control) as link:
            ops = LinkOps(link)
            await ops.flush(CHAT, 5.0)  # the record of the exchange is in the store
            hello = await link.hello("daemon")
            assert (hello.daemons, hello.sandboxes, hello.in_flight) == (1, 1, 0)
            # the next daemon finishes job-1 only: a turn nobody finishes is forgotten
            await ops.begin(CHAT, "mk2", "m2", "job-2")
            await ops.keep_turns(["job-1"])
            async with uds_client(path) as client:
                assert (await client.post("/m/mk1/v1/messages", json=ANTHROPIC)).status_code == 200
                assert (await client.post("/m/mk2/v1/messages", json=ANTHROPIC)).status_code == 200
            # a flush that ends job-1 (the settle's): mk1's next request belongs to no turn
            await ops.flush(CHAT, 5.0, ("mk1", "job-1"))
            async with uds_client(path) as client:
                assert (await client.post("/m/mk1/v1/messages", json=ANTHROPIC)).status_code == 200
            await ops.flush(CHAT, 5.0)
            with pytest.raises(ProxyServiceError, match="already has a model socket"):
                await ops.open(CHAT, "u1", "c1", sockets / "elsewhere")
            await link.stop(0)
        await service.done.wait()
    assert service.reason == "stop" and not service.cfg.paths.control.exists() and not path.exists()
    store = Store(service.cfg.store_path)
    try:
        ledger = [(r["user_id"], r["chat_id"], r["member_id"], r["job_id"]) for r in rows(store, "wire_records")]
    finally:
        store.close()
    assert ledger == [("u1", "c1", "m1", "job-1"), ("u1", "c1", "m1", "job-1"), ("u1", "c1", "m2", None),
                      ("u1", "c1", "m1", None)]
    assert len(fx.requests(kind="conversation")) == 4


async def test_a_flush_that_waits_holds_up_no_request_behind_it(fx: LoopbackFixture, tmp_path: Path,
                                                                  sockets: Path) -> None:
    """Requests that need no wait are answered at once, in the connection's own task; a flush of
    a chat with an exchange in flight waits in a task of its own, and the begin sent after it on
    the same connection is answered first."""
    fx.add_rule(stall(1.0, match="hello there", times=1))
    service = Service(config(tmp_path / "home", fx.base_url))
    answered: list[str] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.run)
        await service.listening()
        async with linked(service.cfg.paths.control) as link:
            await link.hello("daemon")
            ops = LinkOps(link)
            path = await ops.open(CHAT, "u1", "c1", sockets / "a")
            await ops.begin(CHAT, "mk1", "m1", "job-1")
            async with uds_client(path) as client, anyio.create_task_group() as calls:
                async def exchange() -> None:
                    assert (await client.post("/m/mk1/v1/messages", json=ANTHROPIC)).status_code == 200
                    answered.append("exchange")

                async def flush() -> None:
                    await ops.flush(CHAT, 5.0, ("mk1", "job-1"))
                    answered.append("flush")

                calls.start_soon(exchange)
                with anyio.fail_after(5):
                    while (await link.hello("operator")).in_flight == 0:  # held upstream now
                        await anyio.sleep(0.01)
                calls.start_soon(flush)
                await anyio.sleep(0.05)  # the flush is at the service, waiting for the exchange
                await ops.begin(CHAT, "mk2", "m2", "job-2")
                answered.append("begin")
            await link.stop(0)
        await service.done.wait()
    # the exchange's response and the flush's answer end together: their order is the loop's
    assert answered[0] == "begin" and sorted(answered[1:]) == ["exchange", "flush"], answered


async def test_it_lingers_out_only_with_no_daemon_and_nothing_in_flight(fx: LoopbackFixture, tmp_path: Path,
                                                                       sockets: Path) -> None:
    """The sandbox's request is in flight before the daemon leaves, so nothing the test does has
    to land within the linger: a loaded CI host once took longer than the linger between the
    daemon leaving and the request arriving, and the service had gone."""
    fx.add_rule(stall(2.5, match="hello there", times=1))
    service = Service(config(tmp_path / "home", fx.base_url, linger_s=1.0))
    replied = anyio.Event()
    got: dict[str, float] = {}

    async def ask(path: Path) -> None:
        async with uds_client(path) as client:
            reply = await client.post("/m/mk1/v1/messages", json=ANTHROPIC)  # held upstream 2.5 s
        got["status"], got["answered"] = reply.status_code, anyio.current_time()
        got["done_then"] = service.done.is_set()
        replied.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(service.run)
        await service.listening()
        async with linked(service.cfg.paths.control) as link:
            await link.hello("daemon")
            path = await LinkOps(link).open(CHAT, "u1", "c1", sockets / "a")
            await anyio.sleep(1.5)  # a daemon attached: no lingering out
            assert not service.done.is_set()
            tg.start_soon(ask, path)
            with anyio.fail_after(5):
                while (await link.hello("operator")).in_flight == 0:  # held upstream now
                    await anyio.sleep(0.01)
        left = anyio.current_time()  # the daemon is gone; the request is not
        async with linked(service.cfg.paths.control) as link:
            assert (await link.hello("operator")).daemons == 0  # an operator's look counts for nothing
        with anyio.fail_after(10):
            await replied.wait()
        assert got["status"] == 200 and got["answered"] - left >= 1.5 and not got["done_then"], got
        with anyio.fail_after(5):
            await service.done.wait()
        lingered = anyio.current_time() - got["answered"]
    assert service.reason == "linger" and 0.5 <= lingered <= 3.0, lingered
    assert not service.cfg.paths.control.exists()


async def test_its_counters_reach_the_daemons_registry_as_one_exposition(fx: LoopbackFixture, tmp_path: Path,
                                                                        sockets: Path) -> None:
    daemon_registry = CollectorRegistry()
    relay = ProxyMetricsRelay(daemon_registry)
    text = exposition(daemon_registry, "")[0].decode()
    assert "# TYPE cloud_agent_proxy_requests_total counter" in text  # declared before any snapshot
    assert "# TYPE cloud_agent_proxy_gc_pause_seconds histogram" in text
    assert sample(text, "cloud_agent_proxy_requests_total", route="anthropic.messages", status="200") is None
    pauses: list[tuple[CollectorRegistry, GcPauses]] = []
    # the service's entry point installs its collector's pauses on the registry it relays (in its
    # own process; here, this one's collections while installed)
    service = Service(config(tmp_path / "home", fx.base_url),
                      on_ready=lambda registry: pauses.append((registry, GcPauses(registry, PROXY_SERVICE).install())))
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.run)
        await service.listening()
        async with linked(service.cfg.paths.control) as link:
            ops = LinkOps(link)
            path = await ops.open(CHAT, "u1", "c1", sockets / "a")
            async with uds_client(path) as client:
                assert (await client.post("/m/mk1/v1/messages", json=ANTHROPIC)).status_code == 200
                assert (await client.get("/m/mk1/v1/secrets")).status_code == 403
            await ops.flush(CHAT, 5.0)
            try:
                gc.collect(2)
                gc.collect(2)
            finally:
                pauses[0][1].remove()
            relay.update(await ops.metrics())
            await link.stop(0)
    for accept in ("", "application/openmetrics-text; version=1.0.0"):
        body, _ = exposition(daemon_registry, accept)
        text = body.decode()
        families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
        family = "cloud_agent_proxy_requests" if accept else "cloud_agent_proxy_requests_total"
        assert len(families) == len(set(families)) and family in families, families
        assert sample(text, "cloud_agent_proxy_requests_total", route="anthropic.messages", status="200") == 1
        assert sample(text, "cloud_agent_proxy_requests_total", route="denied", status="403") == 1
        assert sample(text, "cloud_agent_proxy_denied_total", reason="not_a_model_route") == 1
        # every collection the service counted (frozen once removed; the two explicit ones at least)
        own = exposition(pauses[0][0], "")[0].decode()
        relayed = sample(text, "cloud_agent_proxy_gc_pause_seconds_count", generation="2")
        assert relayed is not None and relayed >= 2
        assert relayed == sample(own, "cloud_agent_proxy_gc_pause_seconds_count", generation="2")
        assert families.count("cloud_agent_proxy_gc_pause_seconds") == 1
    relay.update(None)  # the service did not answer the scrape: no samples, the families stay
    text = exposition(daemon_registry, "")[0].decode()
    assert "# TYPE cloud_agent_proxy_requests_total counter" in text
    assert sample(text, "cloud_agent_proxy_requests_total", route="anthropic.messages", status="200") is None


async def test_a_lost_connection_fails_the_requests_waiting_on_it(tmp_path: Path) -> None:
    """Nothing answers: the request waiting on a link whose peer closed ends with LinkClosed."""
    path = Path(tempfile.mkdtemp(prefix="ca-pl-", dir="/tmp")) / "c.sock"
    listener = UnixListener(path, 0o600)
    try:
        async with anyio.create_task_group() as tg:
            async def peer() -> None:
                stream = await listener.accept()
                await stream.receive()  # reads the request, answers nothing, hangs up
                await stream.aclose()

            tg.start_soon(peer)
            async with linked(path) as link:
                with pytest.raises(LinkClosed):
                    await link.call(Stop(drain_s=0), timeout_s=5)
                assert link.closed.is_set()
                with pytest.raises(LinkClosed):
                    await link.call(Stop(drain_s=0))
    finally:
        listener.close()
        shutil.rmtree(path.parent, ignore_errors=True)
