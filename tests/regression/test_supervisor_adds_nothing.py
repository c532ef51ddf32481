"""SPEC 9.1: the suite proves the supervisor adds nothing — and that proof can fail.

A test seam (:class:`NoteInjector`) appends a "continue from before" note, wrapped as a
``<system-reminder>``, to the user's message on its way to the real CLI. The history audit strips
such blocks, so the exact-history check still passes; the two checks every regression turn runs
(the wire to the CLI, the annotations the model saw; tests/regression/allowed_injections.py) must
both name the note.
"""

from __future__ import annotations

import pytest

from deploy.loopback import Message
from runner.turn import TestHooks as Hooks  # not collected as a test class
from tests.regression.conftest import regression_daemon
from tests.regression.history_helpers import Member, assert_added_nothing, assert_requests
from tests.regression.supervisor_text import NOTE, NoteInjector, assert_annotations_are_the_clis, assert_wire_adds_nothing
from tests.supervisor_helpers import available_runtimes

pytestmark = [pytest.mark.regression, pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

NOTE_TEXT = "Continue from before: the user already told you their name."
assert NOTE_TEXT in NOTE


@pytest.fixture(scope="module")
def injector() -> NoteInjector:
    return NoteInjector()


@pytest.fixture(scope="module")
async def daemon(fx, injector, sandbox_image, docker_client, tmp_path_factory):
    async with regression_daemon(fx, sandbox_image, docker_client, tmp_path_factory.mktemp("adds-nothing"),
                                 hooks=Hooks(wrap_transport=injector.wrap), probe_interval_s=3600) as d:
        yield d


@pytest.mark.parametrize("runtime", available_runtimes())
async def test_an_injected_note_passes_the_history_audit_but_not_the_checks(runtime, daemon, fx, injector) -> None:
    m = Member(daemon, fx, runtime)
    message = f"Hello from the note test ({runtime})."
    injector.messages = {message}
    before = injector.injected
    t = await m.send(message, check_added_nothing=False)
    assert injector.injected > before, "the seam never saw the message frame"
    assert (t.receipt["context_status"], t.receipt["outcome"]) == ("NEW", "succeeded"), t.describe()
    # the hole: the model received the note, and the exact-history audit does not see it
    assert any(NOTE_TEXT in str(r.body) for r in t.conversation), t.describe()
    assert_requests(t, [Message.user(message)], runtime)
    # the checks: the wire carried prose that is not the message; the model saw an unknown annotation
    with pytest.raises(AssertionError, match="beyond the messages and the documented list") as wire:
        assert_wire_adds_nothing(t.sent, [message])
    assert NOTE_TEXT in str(wire.value)
    with pytest.raises(AssertionError, match="annotations no pinned CLI adds") as seen:
        assert_annotations_are_the_clis(t.conversation, runtime)
    assert NOTE_TEXT in str(seen.value)
    with pytest.raises(AssertionError, match="beyond the messages and the documented list"):
        assert_added_nothing(t, runtime)  # what every regression turn runs
