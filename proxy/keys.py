"""The real gateway key: where it comes from, and the only header that carries it upstream.

A sandbox's CLIs hold a placeholder (SPEC 7). Every credential-looking header a sandbox
sends is dropped, whatever its value, and the proxy sets the real key in the shape the
route needs. The key is read from one host key file (``CLOUD_AGENT_GATEWAY_KEY_FILE``) or a
per-user directory (``CLOUD_AGENT_GATEWAY_KEY_DIR/<user_id>``; with both set, a user
without a file of their own falls back to the host file). Files are re-read after
``ttl_s`` so a rotated key takes effect without a restart; reads run in a worker thread.
"""

from __future__ import annotations

import hashlib
import re
import time
from pathlib import Path

import anyio

# Dropped from every request, by exact name or by a name part (x-auth-token, …).
CREDENTIAL_HEADERS = frozenset({
    "authorization", "proxy-authorization", "x-api-key", "api-key", "x-goog-api-key", "anthropic-api-key",
    "cookie",
})
_CREDENTIAL_PARTS = ("auth", "api-key", "apikey", "token", "secret", "password", "session-key", "cookie")
_USER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,127}$")
_KEY = re.compile(r"^[\x21-\x7e]{8,4096}$")  # visible ASCII: a valid header value, no CR/LF

PLACEHOLDER_PREFIX = "ca-placeholder-"


def is_credential_header(name: str) -> bool:
    name = name.lower()
    return name in CREDENTIAL_HEADERS or any(p in name for p in _CREDENTIAL_PARTS)


def key_headers(api_family: str, key: str) -> dict[str, str]:
    """The one header that carries the real key: Anthropic ``x-api-key``, OpenAI bearer."""
    if api_family == "anthropic":
        return {"x-api-key": key}
    return {"authorization": f"Bearer {key}"}


def placeholder_key(chat_key: str) -> str:
    """The per-sandbox placeholder a CLI is configured with (not a secret; never forwarded)."""
    return PLACEHOLDER_PREFIX + hashlib.sha256(chat_key.encode()).hexdigest()[:24]


class KeyUnavailable(Exception):
    """No usable key for a request; the message names the setting, never a key."""


class KeySource:
    def __init__(self, *, key_file: Path | None = None, key_dir: Path | None = None, ttl_s: float = 5.0) -> None:
        if key_file is None and key_dir is None:
            raise ValueError("CLOUD_AGENT_GATEWAY_KEY_FILE or CLOUD_AGENT_GATEWAY_KEY_DIR must be set")
        self.key_file, self.key_dir, self.ttl_s = key_file, key_dir, ttl_s
        self._cache: dict[Path, tuple[float, str | None]] = {}

    async def key_for(self, user_id: str) -> str:
        candidates: list[tuple[Path, str]] = []
        if self.key_dir is not None:
            if not _USER_ID.match(user_id):
                raise KeyUnavailable("user_id is not a valid key file name under CLOUD_AGENT_GATEWAY_KEY_DIR")
            candidates.append((self.key_dir / user_id, "CLOUD_AGENT_GATEWAY_KEY_DIR/<user_id>"))
        if self.key_file is not None:
            candidates.append((self.key_file, "CLOUD_AGENT_GATEWAY_KEY_FILE"))
        for path, setting in candidates:
            key = await self._read(path, setting)
            if key is not None:
                return key
        raise KeyUnavailable(f"no gateway key file for this user ({' or '.join(s for _, s in candidates)})")

    async def _read(self, path: Path, setting: str) -> str | None:
        now = time.monotonic()
        cached = self._cache.get(path)
        if cached is not None and now - cached[0] < self.ttl_s:
            value = cached[1]
        else:
            value = await anyio.to_thread.run_sync(_read_key_file, path)
            self._cache[path] = (now, value)
        if value == "":
            raise KeyUnavailable(f"{setting} holds no valid key (visible ASCII, 8..4096 characters)")
        return value


def _read_key_file(path: Path) -> str | None:
    """The key, None when the file is absent, '' when it is unusable."""
    try:
        text = path.read_text(encoding="ascii", errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError:
        return ""
    return text if _KEY.match(text) else ""
