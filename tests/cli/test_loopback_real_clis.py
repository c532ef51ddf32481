"""Foundation acceptance of the loopback fixture with the five pinned CLIs in the sandbox image.

For each CLI: one turn and a live follow-up in the same process, then the CLI is killed, its
native session resumed in a new process, and a third turn sent. The fixture's audit of the
follow-up requests must equal the exact history: [u1, a1, u2], then [u1, a1, u2, a2, u3],
where every assistant text is the fixture's deterministic default reply.
"""

from __future__ import annotations

import pytest
from tests.cli.harness_loopback import Container, make_cli

from deploy.loopback import LoopbackFixture, Message, assert_history, expected_default_reply

pytestmark = [pytest.mark.cli, pytest.mark.docker]

U1 = "first message: the secret word is heron"
U2 = "second message\n\nwith two paragraphs, and \"quotes\" ✓"
U3 = "third message: what was the secret word?"
SIDE_KINDS = {"probe", "title"}


# Kilo speaks OpenCode's API through the same bridge (the fixture serves both alike); its own
# live follow-up and restore histories are in tests/regression/test_history.py[kilo].
@pytest.mark.parametrize("runtime", ["claude", "codex", "pi", "opencode"])
def test_history_through_live_followup_and_restore(runtime: str, sandbox_image: str, tmp_path) -> None:
    U, A = Message.user, Message.assistant
    a1, a2, a3 = (expected_default_reply([U1]), expected_default_reply([U1, U2]),
                  expected_default_reply([U1, U2, U3]))
    with LoopbackFixture.start(record_path=str(tmp_path / f"{runtime}.jsonl")) as fx, Container(sandbox_image, fx) as box:
        cli = make_cli(runtime, box, fx)
        cli.start()
        try:
            assert cli.turn(U1) == a1
            assert cli.turn(U2) == a2
            assert_history([U(U1), A(a1), U(U2)], fx.last().dialogue())
            locator = cli.locator
            cli.kill()
            cli.start(resume=True)
            assert cli.locator == locator
            assert cli.turn(U3) == a3
        finally:
            cli.kill()
        assert_history([U(U1), A(a1), U(U2), A(a2), U(U3)], fx.last().dialogue())
        records = fx.requests()
    # every request answered, three conversation requests, the rest identified side requests
    assert all(r.status == 200 for r in records), [(r.seq, r.status, r.error) for r in records]
    assert len([r for r in records if r.kind == "conversation"]) == 3
    assert {r.kind for r in records} - {"conversation"} <= SIDE_KINDS
