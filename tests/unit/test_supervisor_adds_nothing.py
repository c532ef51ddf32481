"""SPEC 9.1 "the supervisor adds nothing", launch inputs: no driver puts prose into a CLI's
arguments, environment or config files beyond the documented list
(tests/regression/allowed_injections.py); the wire and model-side checks run in the regressions."""

from __future__ import annotations

import json

import pytest
from pydantic import SecretStr

from drivers.launch import FileSpec, LaunchSpec
from drivers.models import DriverOptions, GatewayConfig, Locator, MemberPaths
from drivers.registry import RUNTIMES, get_driver
from tests.regression.allowed_injections import CLI_ANNOTATIONS, is_prose
from tests.regression.supervisor_text import (
    SentFrame,
    assert_annotations_are_the_clis,
    assert_launch_adds_nothing,
    assert_wire_adds_nothing,
    launch_prose,
)

PATHS = MemberPaths(home="/home/agent/members/0123/home", workspace="/home/agent/workspace",
                    run_dir="/home/agent/members/0123/run")
GATEWAY = GatewayConfig(base_url="http://127.0.0.1:9", key=SecretStr("sk-test-key"), model="fixture-model")


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("resume", [None, Locator(id="0198f000-0000-7000-8000-000000000001",
                                                  path="/home/agent/members/0123/home/s.jsonl")])
@pytest.mark.parametrize("compaction", [False, True])
def test_every_launch_plan_adds_no_prose(runtime, resume, compaction) -> None:
    driver = get_driver(runtime, DriverOptions(native_compaction=compaction, helper_version=4))
    assert_launch_adds_nothing(driver.plan(PATHS, GATEWAY, resume).spec)
    if resume is not None:
        assert_launch_adds_nothing(driver.plan_fork(PATHS, GATEWAY, resume, 1).spec)


def test_a_system_prompt_flag_or_an_instructions_file_is_caught() -> None:
    note = "Continue from before: the user is Ada."
    flagged = LaunchSpec(runtime="claude", argv=["claude", "-p", "--append-system-prompt", note], cwd="/w")
    with pytest.raises(AssertionError, match="beyond the documented list"):
        assert_launch_adds_nothing(flagged)
    config = LaunchSpec(runtime="codex", argv=["codex-native"], cwd="/w",
                        files=[FileSpec(path="/h/.codex/config.toml", content=f'instructions = "{note}"\n')])
    assert launch_prose(config) == [note]
    agents = LaunchSpec(runtime="pi", argv=["pi"], cwd="/w", files=[FileSpec(path="/w/AGENTS.md", content=note)])
    assert launch_prose(agents) == [note]
    env = LaunchSpec(runtime="opencode", argv=["b"], cwd="/w",
                     env={"OPENCODE_CONFIG_CONTENT": json.dumps({"instructions": [note]})})
    assert launch_prose(env) == [note]


def test_prose_is_words_not_ids_paths_or_flags() -> None:
    assert [is_prose(s) for s in ("hello there", "a\nb", "--session-id", "/a/b c", "ses_01", "", " x ")] == [
        True, True, False, True, False, False, False]


def test_the_wire_check_allows_exactly_the_message_and_documented_refusals() -> None:
    frames = [SentFrame(0, "claude", json.dumps({"type": "user", "message": {"content": [
        {"type": "text", "text": "hi there"}]}}).encode()),
        SentFrame(1, "claude", json.dumps({"type": "control_response", "response": {
            "subtype": "error", "error": "not supported by this supervisor"}}).encode())]
    assert_wire_adds_nothing(frames, ["hi there"])
    with pytest.raises(AssertionError, match="hi there, continue"):
        assert_wire_adds_nothing([SentFrame(2, "pi", b'{"type": "prompt", "message": "hi there, continue"}')],
                                 ["hi there"])


def test_the_annotation_check_knows_each_clis_own_and_nothing_else() -> None:
    from deploy.loopback import RecordedRequest

    reminder = ("<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
                "# currentDate\nToday's date is 2026-11-30.\n\n      IMPORTANT: this context may or may not be "
                "relevant to your tasks. You should not respond to this context unless it is highly relevant to "
                "your task.\n</system-reminder>")

    def req(text: str) -> RecordedRequest:
        return RecordedRequest(seq=1, time=0.0, method="POST", path="/v1/messages", api="anthropic",
                               kind="conversation", body={"messages": [{"role": "user", "content": [
                                   {"type": "text", "text": reminder}, {"type": "text", "text": text}]}]})

    assert_annotations_are_the_clis([req("hello")], "claude")
    with pytest.raises(AssertionError, match="annotations no pinned CLI adds"):
        assert_annotations_are_the_clis([req("hello\n\n<system-reminder>Continue from before.</system-reminder>")],
                                        "claude")
    with pytest.raises(AssertionError):
        assert_annotations_are_the_clis([req("hello")], "pi")  # Claude's reminder is not Pi's
    assert set(CLI_ANNOTATIONS) == set(RUNTIMES)
