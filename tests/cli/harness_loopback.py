"""Minimal harness that drives the five real CLIs inside the pinned sandbox image against a
loopback fixture. A test harness, not the product drivers (those live in drivers/): it uses
the minimal command lines of shared/protocols/ and only what the history tests need.

Each CLI runs in its own sealed container (network none: the model through its socket and a
model proxy in front of the fixture, tests/support/sealed.py; ``--init`` so killed CLIs are
reaped, user ``agent``) through ``docker exec -i``; OpenCode/Kilo's REST calls run inside it. The command
is wrapped in ``setsid sh -c 'echo $$; exec …'``: the first stdout line is the CLI's pid, which
is also its process group, so "kill the CLI" kills exactly that group inside the container
(closing a ``docker exec`` client does not end the process inside).
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deploy.loopback import LoopbackFixture
from tests.support.sealed import MODELGATE_COMMAND, ThreadedProxy, docker_run_args

HOME = "/home/agent"
WORK = f"{HOME}/workspace"
TURN_TIMEOUT = 60.0


# An HTTP request made inside the container (its loopback is its own): stdin one JSON object
# {method, url, body, timeout}; stdout the status line, then the body.
HTTP_IN_SANDBOX = r"""
import http.client, json, sys, urllib.parse
req = json.load(sys.stdin)
u = urllib.parse.urlsplit(req["url"])
c = http.client.HTTPConnection(u.hostname, u.port, timeout=req["timeout"])
body = None if req["body"] is None else json.dumps(req["body"])
c.request(req["method"], u.path + (f"?{u.query}" if u.query else ""), body=body,
          headers={"content-type": "application/json"} if body is not None else {})
r = c.getresponse()
sys.stdout.write(f"{r.status}\n")
sys.stdout.write(r.read().decode())
"""


class Container:
    """A throwaway sealed container of the sandbox image (and its model proxy); removed on exit."""

    def __init__(self, image: str, fx: LoopbackFixture) -> None:
        self.name = f"loopback-test-{uuid.uuid4().hex[:10]}"
        self._sockets = Path(tempfile.mkdtemp(prefix="ca-lb-"))
        self._proxy = ThreadedProxy(fx.base_url, self._sockets, key="sk-loopback-harness")
        gate = self._proxy.__enter__()
        self.base_url = gate.gateway(model="fake-model").base_url
        self.openai_base_url = self.base_url + "/v1"
        subprocess.run(["docker", "run", "-d", "--rm", "--init", *docker_run_args(self._sockets), "--user", "agent",
                        "--name", self.name, "-w", WORK, image, *MODELGATE_COMMAND],
                       check=True, capture_output=True, timeout=60)

    def http(self, method: str, url: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
        req = json.dumps({"method": method, "url": url, "body": body, "timeout": timeout})
        out = subprocess.run(["docker", "exec", "-i", "-u", "agent", self.name, "python3", "-c", HTTP_IN_SANDBOX],
                             input=req.encode(), capture_output=True, timeout=timeout + 30)
        assert out.returncode == 0, out.stderr.decode()
        status, _, text = out.stdout.decode().partition("\n")
        return int(status), json.loads(text) if text.strip() else None

    def write(self, path: str, text: str) -> None:
        subprocess.run(["docker", "exec", "-i", self.name, "sh", "-c", 'mkdir -p "$(dirname "$1")" && cat > "$1"',
                        "sh", path], input=text.encode(), check=True, capture_output=True, timeout=30)

    def spawn(self, argv: list[str], env: dict[str, str], workdir: str = WORK) -> Proc:
        return Proc(self, argv, env, workdir)

    def kill_group(self, pgid: int, signal: str = "KILL") -> None:
        subprocess.run(["docker", "exec", self.name, "kill", f"-{signal}", "--", f"-{pgid}"],
                       capture_output=True, timeout=30)

    def close(self) -> None:
        subprocess.run(["docker", "rm", "-f", self.name], capture_output=True, timeout=60)
        self._proxy.__exit__(None, None, None)
        shutil.rmtree(self._sockets, ignore_errors=True)

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Proc:
    """One CLI process in the container, stdout read line by line on a thread."""

    def __init__(self, box: Container, argv: list[str], env: dict[str, str], workdir: str) -> None:
        self.box = box
        cmd = ["docker", "exec", "-i", "-w", workdir]
        for k, v in env.items():
            cmd += ["-e", f"{k}={v}"]
        cmd += [box.name, "setsid", "-w", "sh", "-c", 'echo $$; exec "$@"', "sh", *argv]
        self.popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.stderr: list[bytes] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.popen.stderr), daemon=True).start()  # type: ignore[arg-type]
        self.pid = int(self.readline(30))

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def readline(self, timeout: float = TURN_TIMEOUT) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output within {timeout}s; stderr: {self.tail()}") from None
        if line is None:
            raise EOFError(f"process ended; stderr: {self.tail()}")
        return line.decode()

    def send(self, obj: dict[str, Any]) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps(obj) + "\n").encode())
        self.popen.stdin.flush()

    def wait_json(self, pred: Callable[[dict[str, Any]], bool], timeout: float = TURN_TIMEOUT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            line = self.readline(max(0.1, deadline - time.monotonic())).strip()
            if not line.startswith("{"):
                continue
            obj = json.loads(line)
            if pred(obj):
                return obj

    def tail(self) -> str:
        return b"".join(self.stderr)[-2000:].decode(errors="replace")

    def kill(self) -> None:
        """SIGTERM the CLI's process group, SIGKILL it if it is still there after 10 s.

        Not SIGKILL straight away: Claude 2.1.220 appends the turn's assistant message to its
        transcript up to ~0.1 s *after* the ``result`` event, and a resume after an immediate
        SIGKILL then shows "No response requested." in its place (seen in this test).
        """
        self.box.kill_group(self.pid, "TERM")
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.box.kill_group(self.pid, "KILL")
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()


# ---------------------------------------------------------------- per-CLI minimal drivers


class Cli:
    """start(resume=False) → turn(text) → kill(); the locator survives for the resume."""

    proc: Proc | None = None

    def __init__(self, box: Container, fx: LoopbackFixture) -> None:
        self.box, self.fx = box, fx
        self.locator: str | None = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc = None


class Claude(Cli):
    ENV = {"HOME": HOME, "ANTHROPIC_API_KEY": "sk-ant-dummy", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "CLAUDE_CONFIG_DIR": f"{HOME}/.claude", "CLAUDE_CODE_MAX_RETRIES": "2", "TMPDIR": f"{HOME}/tmp",
           "CLAUDE_CODE_TMPDIR": f"{HOME}/tmp", "CLAUDE_CODE_DISABLE_BACKGROUND_TASKS": "1"}

    def start(self, resume: bool = False) -> None:
        self.box.write(f"{HOME}/tmp/.keep", "")
        argv = ["claude", "-p", "--output-format", "stream-json", "--input-format", "stream-json", "--verbose",
                "--model", "fake-model"]
        if resume:
            argv += ["--resume", str(self.locator)]
        self.proc = self.box.spawn(argv, {**self.ENV, "ANTHROPIC_BASE_URL": self.box.base_url})

    def turn(self, text: str) -> str:
        assert self.proc
        self.proc.send({"type": "user", "message": {"role": "user", "content": text},
                        "parent_tool_use_id": None, "session_id": ""})
        result = self.proc.wait_json(lambda e: e.get("type") == "result" and not e.get("parent_tool_use_id"))
        assert not result["is_error"], result
        if self.locator:
            assert result["session_id"] == self.locator
        self.locator = result["session_id"]
        return result["result"]


class Codex(Cli):
    CODEX_HOME = f"{HOME}/.codex"

    def start(self, resume: bool = False) -> None:
        self.box.write(f"{self.CODEX_HOME}/config.toml", f"""
model = "fake-model"
model_provider = "fake"
approval_policy = "never"
sandbox_mode = "danger-full-access"
web_search = "disabled"
[features]
plugins = false
[analytics]
enabled = false
[model_providers.fake]
name = "Fake loopback"
base_url = "{self.box.openai_base_url}"
wire_api = "responses"
env_key = "FAKE_API_KEY"
request_max_retries = 1
stream_max_retries = 1
stream_idle_timeout_ms = 10000
""")
        self.proc = self.box.spawn(["codex-native", "app-server"],
                                   {"HOME": HOME, "CODEX_HOME": self.CODEX_HOME, "FAKE_API_KEY": "fake-key"})
        self._id = 0
        self._call("initialize", {"clientInfo": {"name": "loopback-test", "title": "t", "version": "0.0.1"}})
        self.proc.send({"method": "initialized"})
        if resume:
            thread = self._call("thread/resume", {"threadId": self.locator, "excludeTurns": True})["thread"]
            assert thread["id"] == self.locator
        else:
            thread = self._call("thread/start", {"cwd": WORK, "approvalPolicy": "never",
                                                 "sandbox": "danger-full-access"})["thread"]
            self.locator = thread["id"]

    def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        assert self.proc
        self._id += 1
        rid = self._id
        self.proc.send({"method": method, "id": rid, "params": params})
        reply = self.proc.wait_json(lambda e: e.get("id") == rid and "method" not in e)
        assert "error" not in reply, reply
        return reply["result"]

    def turn(self, text: str) -> str:
        assert self.proc
        turn_id = self._call("turn/start", {"threadId": self.locator,
                                            "input": [{"type": "text", "text": text}]})["turn"]["id"]
        done = self.proc.wait_json(lambda e: e.get("method") == "turn/completed"
                                   and e["params"]["turn"]["id"] == turn_id)["params"]["turn"]
        assert done["status"] == "completed", done
        return "".join(i.get("text", "") for i in done.get("items", []) if i.get("type") == "agentMessage")


class Pi(Cli):
    AGENT_DIR = f"{HOME}/.pi/agent"

    def start(self, resume: bool = False) -> None:
        models = {"providers": {"fake": {
            "baseUrl": self.box.openai_base_url, "api": "openai-completions", "apiKey": "fake-key",
            "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
            "models": [{"id": "fake-model", "contextWindow": 128000, "maxTokens": 4096}]}}}
        settings = {"defaultProvider": "fake", "defaultModel": "fake-model", "enableInstallTelemetry": False,
                    "quietStartup": True, "retry": {"enabled": True, "maxRetries": 1, "baseDelayMs": 200,
                                                    "provider": {"maxRetries": 0}}}
        self.box.write(f"{self.AGENT_DIR}/models.json", json.dumps(models))
        self.box.write(f"{self.AGENT_DIR}/settings.json", json.dumps(settings))
        argv = ["pi", "--mode", "rpc", "--no-extensions", "--no-skills", "--no-prompt-templates",
                "--no-context-files", "--no-themes"]
        if resume:
            argv += ["--session", str(self.locator)]
        self.proc = self.box.spawn(argv, {"HOME": HOME, "PI_CODING_AGENT_DIR": self.AGENT_DIR, "PI_OFFLINE": "1"})
        state = self._state()
        if resume:
            assert state["sessionFile"] == self.locator and state["messageCount"] > 0, state

    def _state(self) -> dict[str, Any]:
        assert self.proc
        rid = uuid.uuid4().hex
        self.proc.send({"id": rid, "type": "get_state"})
        return self.proc.wait_json(lambda e: e.get("id") == rid)["data"]

    def turn(self, text: str) -> str:
        assert self.proc
        self.proc.send({"id": "p", "type": "prompt", "message": text})
        end = self.proc.wait_json(lambda e: e.get("type") == "agent_end")
        while self._state().get("isStreaming"):  # settle barrier (protocols/pi.md §4)
            end = self.proc.wait_json(lambda e: e.get("type") == "agent_end")
        last = end["messages"][-1]
        assert last.get("stopReason") == "stop", last
        self.locator = self._state()["sessionFile"]
        return "".join(c.get("text", "") for c in last.get("content", []) if c.get("type") == "text")


class Serve(Cli):
    """OpenCode / Kilo: ``serve`` on an ephemeral port of the container, REST made inside it."""

    def __init__(self, box: Container, fx: LoopbackFixture, name: str) -> None:
        super().__init__(box, fx)
        self.name = name
        self.url = ""

    def start(self, resume: bool = False) -> None:
        prefix = "KILO" if self.name == "kilo" else "OPENCODE"
        config = {"$schema": "https://opencode.ai/config.json", "model": "fake/fake-model",
                  "small_model": "fake/fake-model", "autoupdate": False, "share": "disabled",
                  "enabled_providers": ["fake"], "provider": {"fake": {
                      "npm": "@ai-sdk/openai-compatible", "name": "Fake loopback",
                      "options": {"baseURL": self.box.openai_base_url, "apiKey": "sk-fake"},
                      "models": {"fake-model": {"name": "Fake Model", "tool_call": True,
                                                "limit": {"context": 100000, "output": 4096}}}}}}
        env = {"HOME": HOME, "XDG_CONFIG_HOME": f"{HOME}/.config", "XDG_DATA_HOME": f"{HOME}/.local/share",
               "XDG_CACHE_HOME": f"{HOME}/.cache", "XDG_STATE_HOME": f"{HOME}/.local/state",
               f"{prefix}_CONFIG_CONTENT": json.dumps(config)}
        for flag in ("DISABLE_MODELS_FETCH", "DISABLE_AUTOUPDATE", "DISABLE_LSP_DOWNLOAD", "DISABLE_SHARE"):
            env[f"{prefix}_{flag}"] = "1"
        if self.name == "kilo":
            env.update(KILO_TELEMETRY_LEVEL="off", KILO_DISABLE_SESSION_INGEST="1", KILO_NO_DAEMON="1",
                       KILO_DISABLE_CODEBASE_INDEXING="1", KILO_DISABLE_PRESENCE="1")
        else:  # seed the plugin lockfile or OpenCode reaches for the npm registry (protocols §4)
            cfg = f"{HOME}/.config/opencode"
            self.box.write(f"{cfg}/node_modules/.keep", "")
            self.box.write(f"{cfg}/package.json", '{"dependencies":{"@opencode-ai/plugin":"1.18.33"}}')
            self.box.write(f"{cfg}/package-lock.json", '{"lockfileVersion":3,"packages":{"":{"dependencies":'
                                                        '{"@opencode-ai/plugin":"1.18.33"}}}}')
        self.proc = self.box.spawn([self.name, "serve", "--port", "0", "--hostname", "127.0.0.1"], env)
        line = ""
        while "listening on" not in line:
            line = self.proc.readline(60)
        self.url = line.strip().rsplit(" ", 1)[-1]
        if resume:
            status, doc = self.box.http("GET", f"{self.url}/session/{self.locator}")
            assert status == 200 and doc["id"] == self.locator, (status, doc)
        else:
            status, doc = self.box.http("POST", f"{self.url}/session", {})
            assert status == 200, (status, doc)
            self.locator = doc["id"]

    def turn(self, text: str) -> str:
        status, out = self.box.http("POST", f"{self.url}/session/{self.locator}/message",
                                    {"parts": [{"type": "text", "text": text}]}, timeout=TURN_TIMEOUT)
        assert status == 200, (status, out)
        assert not out["info"].get("error"), out["info"]
        return "".join(p.get("text", "") for p in out["parts"] if p.get("type") == "text" and not p.get("synthetic"))


def make_cli(runtime: str, box: Container, fx: LoopbackFixture) -> Cli:
    if runtime in ("opencode", "kilo"):
        return Serve(box, fx, runtime)
    return {"claude": Claude, "codex": Codex, "pi": Pi}[runtime](box, fx)
