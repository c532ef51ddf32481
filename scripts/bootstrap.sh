# Sourced by scripts/demo and scripts/test: everything a fresh Debian 12 machine needs.
#   Python deps (uv, the locked venv) -> the Docker engine -> the pinned sandbox image.
# Each step says its name and duration; a failure names the step.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
UV_VERSION="0.13.9"
TOOLS="${CLOUD_AGENT_TOOLS:-$HOME/.cache/cloud-agent/tools}"

step() { printf '\n==> %s\n' "$*" >&2; }
fail() { printf 'bootstrap failed at step "%s": %s\n' "$1" "$2" >&2; exit 1; }
timed() {  # timed NAME CMD...
  local name="$1"; shift
  local t0=$SECONDS
  step "$name"
  "$@" || fail "$name" "exit $?"
  printf '    %s: %ss\n' "$name" "$((SECONDS - t0))" >&2
}

ensure_uv() {
  if command -v uv >/dev/null 2>&1; then UV=uv; return; fi
  if [ -x "$TOOLS/bin/uv" ]; then UV="$TOOLS/bin/uv"; return; fi
  if ! python3 -m venv --help >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || fail "python venv" "python3-venv is missing and we are not root to install it"
    apt-get update -q && apt-get install -y -q python3-venv python3-pip || fail "python venv" "apt-get install python3-venv failed"
  fi
  python3 -m venv "$TOOLS" || fail "uv" "cannot create $TOOLS"
  "$TOOLS/bin/pip" install -q "uv==$UV_VERSION" || fail "uv" "pip install uv==$UV_VERSION failed"
  UV="$TOOLS/bin/uv"
}

# The browser tests (tests/browser, marker `browser`) drive Debian's Chromium through its
# chromedriver; nothing downloads a browser of its own. Idempotent: a no-op once installed.
ensure_browser() {
  if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then return 0; fi
  [ "$(id -u)" = 0 ] || { echo "chromium + chromium-driver are missing and we are not root" >&2; return 1; }
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    chromium chromium-driver fonts-dejavu-core
}

ensure_postgres() {  # the PostgreSQL server the store tests start their own clusters from
  if ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then return 0; fi
  [ "$(id -u)" = 0 ] || { echo "not root: cannot apt-get install postgresql" >&2; return 1; }
  DEBIAN_FRONTEND=noninteractive apt-get update -q || return 1
  # policy-rc.d 101: the package must not start its own cluster (the tests start theirs)
  local rc=/usr/sbin/policy-rc.d had_rc=0
  [ -e "$rc" ] && had_rc=1
  [ $had_rc = 1 ] || printf '#!/bin/sh\nexit 101\n' >"$rc" && chmod +x "$rc"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql
  local status=$?
  [ $had_rc = 1 ] || rm -f "$rc"
  [ $status = 0 ] && ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1
}

ensure_uv
timed "postgresql (apt)" ensure_postgres
timed "python deps (uv sync)" "$UV" sync --frozen --quiet
timed "docker engine" "$UV" run --frozen python -m deploy.engine
timed "sandbox image" "$UV" run --frozen python -m images.build
export UV
