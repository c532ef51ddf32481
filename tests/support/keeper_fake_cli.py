"""A tiny CLI for keeper tests: JSON lines in, JSON lines out (like the real CLIs' stdio).

Commands (one JSON object a line on stdin):
  {"op": "echo", ...}             the same line back
  {"op": "emit", "n": N, "size": S, "tag": T}
                                  N lines {"tag": T, "seq": i, "pad": "x"*S}
  {"op": "stderr", "text": T}     T on stderr
  {"op": "env", "name": NAME}     {"env": NAME, "value": os.environ.get(NAME)}
  {"op": "spawn"}                 a background `sleep` in the CLI's process group; {"spawned": pid}
  {"op": "exit", "code": C}       exit with C
At stdin EOF it prints {"stdin": "eof"} and exits 0. Prints {"ready": pid} first.
"""

import json
import os
import subprocess
import sys

out = sys.stdout.buffer


def say(obj: dict) -> None:
    out.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
    out.flush()


def main() -> int:
    say({"ready": os.getpid()})
    for raw in sys.stdin.buffer:
        cmd = json.loads(raw)
        op = cmd.get("op")
        if op == "echo":
            out.write(raw if raw.endswith(b"\n") else raw + b"\n")
            out.flush()
        elif op == "emit":
            pad = "x" * int(cmd.get("size", 0))
            for i in range(int(cmd["n"])):
                out.write(json.dumps({"tag": cmd.get("tag", ""), "seq": i, "pad": pad}).encode() + b"\n")
            out.flush()
        elif op == "stderr":
            sys.stderr.write(cmd["text"])
            sys.stderr.flush()
        elif op == "env":
            say({"env": cmd["name"], "value": os.environ.get(cmd["name"])})
        elif op == "spawn":
            p = subprocess.Popen(["sleep", "300"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            say({"spawned": p.pid})
        elif op == "exit":
            return int(cmd.get("code", 0))
    say({"stdin": "eof"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
