"""A new sandbox's marker and record are written while its model gate comes up
(SandboxManager._while_gate_comes_up): the record is always written, whatever the gate does,
and each failure is raised as itself."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from sandbox_manager.sandboxes import SandboxManager
from sandbox_manager.sealing import ModelGateNotReady

pytestmark = pytest.mark.anyio

INFO = SimpleNamespace(id="c1", name="ca-x")


def manager(gate):  # only what the method uses
    return SimpleNamespace(gate_ready=gate)


async def test_the_marker_and_record_are_written_while_the_gate_comes_up() -> None:
    order: list[str] = []
    gate_up = anyio.Event()

    async def gate(info, since) -> None:
        order.append("gate waits")
        await gate_up.wait()
        order.append("gate up")

    async def work() -> None:
        order.append("marker")
        await anyio.sleep(0)
        order.append("record")
        gate_up.set()  # the gate came up after both: they did not wait for it

    await SandboxManager._while_gate_comes_up(manager(gate), INFO, 0.0, work)  # type: ignore[arg-type]
    assert order == ["marker", "gate waits", "record", "gate up"]


async def test_a_gate_that_never_comes_up_still_leaves_the_container_recorded() -> None:
    written: list[str] = []

    async def gate(info, since) -> None:
        raise ModelGateNotReady("ca-x: ca-modelgate did not report listening within 20s")

    async def work() -> None:
        await anyio.sleep(0.01)  # the gate fails first
        written.append("record")

    with pytest.raises(ModelGateNotReady, match="did not report listening"):
        await SandboxManager._while_gate_comes_up(manager(gate), INFO, 0.0, work)  # type: ignore[arg-type]
    assert written == ["record"]


async def test_a_failed_marker_is_raised_as_itself_and_the_gate_wait_ends() -> None:
    gate_cancelled: list[bool] = []

    async def gate(info, since) -> None:
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            gate_cancelled.append(True)
            raise

    async def work() -> None:
        raise OSError("put_archive into c1 failed")

    with anyio.fail_after(5), pytest.raises(OSError, match="put_archive into c1 failed"):
        await SandboxManager._while_gate_comes_up(manager(gate), INFO, 0.0, work)  # type: ignore[arg-type]
    assert gate_cancelled == [True]
