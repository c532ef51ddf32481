"""End to end: the preflight command against the real loopback model fixture (no mocks).

The fixture stands in for the gateway; its scripted rules play a model that answers from
the history it received (every case passes) and one that claims there is no history
(every case but ``no_history`` fails, naming the phrase). The fixture sends no thinking
blocks, so these runs also show recall passing with ``thinking_observed`` false.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.loopback import LoopbackFixture, cut, fail, recall, reply
from deploy.preflight import check_model_context as cmd

pytestmark = pytest.mark.cli

KEY = "sk-LOOPBACK-CANARY-41d8e2"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fx():
    with LoopbackFixture.start(port=0) as fixture:
        yield fixture


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "key"
    path.write_text(KEY)
    return path


def _run(fx: LoopbackFixture, key_file: Path, *args: str) -> tuple[int, dict]:
    """The command as an operator runs it: its own process, key only in the file."""
    env = {k: v for k, v in os.environ.items() if k != cmd.PROXY_ENV}
    env[cmd.KEY_FILE_ENV] = str(key_file)
    proc = subprocess.run([sys.executable, "-m", "deploy.preflight.check_model_context", fx.base_url,
                           "--json", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert KEY not in proc.stdout + proc.stderr
    assert proc.returncode in (cmd.EXIT_OK, cmd.EXIT_FAILED), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _answers_from_history(fx: LoopbackFixture) -> None:
    # fact_update: the updated value is the second user message; every other case
    # is answered by echoing the first user message of what the fixture received.
    fx.add_rules(recall(1, prefix="You told me: ", match="staging|预发布", regex=True),
                 recall(0, prefix="You said: "))


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_model_answering_from_history_passes(fx, key_file, api: str) -> None:
    _answers_from_history(fx)
    code, doc = _run(fx, key_file, "--repetitions", "3", "--api", api)
    assert code == cmd.EXIT_OK, [r["failures"] for r in doc["results"]]
    assert doc["summary"]["cases"] == 15 and doc["summary"]["recall_passed"] is True
    # The fixture has no thinking: recall passes, thinking is reported as not observed.
    assert doc["summary"]["thinking_observed_cases"] == 0
    assert all(r["request_id"] for r in doc["results"])
    task = next(r for r in doc["results"] if r["case"] == "task")
    assert "load_config" in task["answer"]
    # What the fixture received: 15 ordinary calls, the history in them, no key in the record.
    recorded = fx.conversation_requests()
    assert len(recorded) == 15
    assert KEY not in json.dumps([r.model_dump(mode="json") for r in recorded])


def test_model_claiming_missing_history_fails_naming_the_phrase(fx, key_file) -> None:
    fx.add_rules(reply("我没有之前的对话记录，这是我们对话的开始。", match="[\u4e00-\u9fff]", regex=True),
                 reply("I don't have any previous messages from you."))
    code, doc = _run(fx, key_file, "--repetitions", "2")
    assert code == cmd.EXIT_FAILED
    by_case = {(r["case"], r["repetition"]): r for r in doc["results"]}
    for (case, rep), r in by_case.items():
        if case == "no_history":
            assert r["recall_passed"], r["failures"]  # claiming no history is correct here
            continue
        assert not r["recall_passed"]
        phrase = "我没有之前的对话记录" if rep == 1 else "I don't have any previous messages"
        assert any(f'missing-history claim: "{phrase}"' in f for f in r["failures"]), r["failures"]
    assert doc["summary"]["failed"] == 8


def test_gateway_errors_and_cut_streams_fail(fx, key_file) -> None:
    fx.add_rules(fail(529, match="staging|预发布", regex=True),
                 cut(after_deltas=1, match="PostgreSQL|两次", regex=True),
                 recall(0, prefix="You said: "))
    code, doc = _run(fx, key_file, "--repetitions", "1")
    assert code == cmd.EXIT_FAILED
    results = {r["case"]: r for r in doc["results"]}
    assert results["fact_update"]["failures"][0].startswith("HTTP 529")
    assert any("truncated" in f for f in results["repeated_question"]["failures"])
    assert results["task"]["recall_passed"] and results["greeting"]["recall_passed"]
