"""The proxy's settings, validated at the edge (the environment)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, Field, field_validator, model_validator

from .http1 import Limits
from .keys import KeySource

_TRUE = {"1", "true", "yes", "on"}


class ProxyConfig(BaseModel):
    upstream_url: str = Field(description="CLOUD_AGENT_GATEWAY_URL: the model gateway, reached from the host")
    key_file: Path | None = Field(default=None, description="CLOUD_AGENT_GATEWAY_KEY_FILE: one host key")
    key_dir: Path | None = Field(default=None, description="CLOUD_AGENT_GATEWAY_KEY_DIR: one key file per user_id")
    capture: bool = Field(default=False, description="CLOUD_AGENT_WIRE_CAPTURE=1: keep message texts in records")
    socket_uid: int = Field(default=1000, description="the sandbox user that must connect (image user agent)")
    socket_gid: int = 1000
    max_body_bytes: int = Field(default=32 << 20, gt=0)
    max_head_bytes: int = Field(default=256 * 1024, gt=0)
    idle_timeout_s: float = Field(default=600.0, gt=0)
    head_timeout_s: float = Field(default=30.0, gt=0)
    body_timeout_s: float = Field(default=60.0, gt=0)
    write_timeout_s: float = Field(default=120.0, gt=0)
    max_connections_per_sandbox: int = Field(default=64, gt=0)
    upstream_connect_timeout_s: float = Field(default=10.0, gt=0)
    upstream_read_timeout_s: float = Field(default=900.0, gt=0, description="silence allowed between two chunks")
    upstream_write_timeout_s: float = Field(default=60.0, gt=0)

    @field_validator("upstream_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")) or "?" in v or "#" in v:
            raise ValueError("must be an http:// or https:// URL without query or fragment")
        return v.rstrip("/")

    @model_validator(mode="after")
    def _a_key(self) -> ProxyConfig:
        if self.key_file is None and self.key_dir is None:
            raise ValueError("key_file (CLOUD_AGENT_GATEWAY_KEY_FILE) or key_dir (CLOUD_AGENT_GATEWAY_KEY_DIR) "
                             "must be set")
        return self

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ProxyConfig:
        env = os.environ if env is None else env
        values: dict[str, object] = {
            "upstream_url": env.get("CLOUD_AGENT_GATEWAY_URL", ""),
            "key_file": env.get("CLOUD_AGENT_GATEWAY_KEY_FILE") or None,
            "key_dir": env.get("CLOUD_AGENT_GATEWAY_KEY_DIR") or None,
            "capture": env.get("CLOUD_AGENT_WIRE_CAPTURE", "").strip().lower() in _TRUE,
        }
        return cls.model_validate({**values, **overrides})

    def key_source(self) -> KeySource:
        return KeySource(key_file=self.key_file, key_dir=self.key_dir)

    def limits(self) -> Limits:
        return Limits(max_head_bytes=self.max_head_bytes, max_body_bytes=self.max_body_bytes,
                      idle_timeout_s=self.idle_timeout_s, head_timeout_s=self.head_timeout_s,
                      body_timeout_s=self.body_timeout_s, write_timeout_s=self.write_timeout_s)
