"""Compile the image's helper scripts once, at the image's build (run by the image's own python3).

    python3 -IS compile_helpers.py BIN_DIR LIB_DIR NAME...

An interpreter compiles a script it runs by path on every start; only imported modules get
cached bytecode. ca-keeper (~950 lines) was ~5 ms of compile before every keeper start, so
before the CLI's exec on every NEW and RESTORED turn and on every re-attach; ca-launch ~2 ms,
the model gate and the bridge as much at each of their starts (issue 16).

Per helper NAME: its source moves to LIB_DIR/NAME.py (tracebacks name it, and its bytes are
the committed helper's), its code object to LIB_DIR/NAME.code (marshal: this interpreter's own
format, so the interpreter that runs it must be this one, the image's), and BIN_DIR/NAME
becomes a stub with the source's own first line (its interpreter and flags) that runs that
code in the stub's globals: ``__name__``, ``__file__`` and ``sys.argv`` are what the script
had, so a helper that finds another next to it (ca-keeper's ca-launch) still does.
Stdlib only; nothing else of the build context reaches the image.
"""

from __future__ import annotations

import marshal
import os
import sys

STUB = """{shebang}
# {name}: its code was compiled at the image's build (compile_helpers.py); the source is {source}
exec(__import__("marshal").loads(open({code!r}, "rb").read()))
"""


def compile_helper(bin_dir: str, lib_dir: str, name: str) -> None:
    script = os.path.join(bin_dir, name)
    with open(script, encoding="utf-8") as fh:
        source = fh.read()
    shebang = source.split("\n", 1)[0]
    if not (shebang.startswith("#!") and "python3" in shebang):
        raise SystemExit(f"{script}: not a python3 script (first line {shebang!r})")
    source_path = os.path.join(lib_dir, f"{name}.py")
    code_path = os.path.join(lib_dir, f"{name}.code")
    code = compile(source, source_path, "exec", dont_inherit=True)  # a SyntaxError fails the build
    os.makedirs(lib_dir, exist_ok=True)
    with open(source_path, "w", encoding="utf-8") as fh:
        fh.write(source)
    with open(code_path, "wb") as fh:
        marshal.dump(code, fh)
    with open(script, "w", encoding="utf-8") as fh:
        fh.write(STUB.format(shebang=shebang, name=name, source=source_path, code=code_path))
    for path, mode in ((source_path, 0o644), (code_path, 0o644), (script, 0o755)):
        os.chmod(path, mode)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: compile_helpers.py BIN_DIR LIB_DIR NAME...", file=sys.stderr)
        return 2
    bin_dir, lib_dir, *names = argv
    for name in names:
        compile_helper(bin_dir, lib_dir, name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
