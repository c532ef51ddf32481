"""Configuration: environment variables, with a TOML file equivalent (CLOUD_AGENT_CONFIG).

Environment wins over the file. Secrets are read from files named here and kept as
SecretStr: they never reach logs, receipts, labels or command lines.
"""

from __future__ import annotations

import os
import socket
import tomllib
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from state.backends import validate_store_url

RUNTIMES = ("claude", "codex", "pi", "opencode", "kilo")
DEFAULT_MODELS = {
    "claude": "fixture-claude",
    "codex": "fixture-codex",
    "pi": "fixture-pi",
    "opencode": "fixture-opencode",
    "kilo": "fixture-kilo",
}
LOOPBACK_KEY = "loopback-fixture-no-credentials"


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    home: Path = Field(default=Path("/var/lib/cloud-agent"), description="CLOUD_AGENT_HOME: store, logs, host id")
    gateway_url: str | None = Field(default=None, description="CLOUD_AGENT_GATEWAY_URL; None: `cloud-agent serve` "
                                    "starts the loopback fixture")
    gateway_key_file: Path | None = Field(default=None, description="CLOUD_AGENT_GATEWAY_KEY_FILE: the host's key, "
                                         "read by the model proxy only")
    gateway_key_dir: Path | None = Field(default=None, description="CLOUD_AGENT_GATEWAY_KEY_DIR: one key file per "
                                        "user_id (wins over the host key file)")
    socket_dir: Path | None = Field(default=None, description="CLOUD_AGENT_SOCKET_DIR: where the model proxy makes "
                                    "each sandbox's socket directory; default HOME/sockets (at most 68 characters: "
                                    "a unix socket path has 107)")
    wire_capture: bool = Field(default=False, description="CLOUD_AGENT_WIRE_CAPTURE=1: keep message texts of the wire "
                               "audit (default: digests only)")
    wire_capture_days: float = Field(default=7.0, gt=0, description="CLOUD_AGENT_WIRE_CAPTURE_DAYS: captured texts "
                                     "are deleted after this many days")
    service_token_file: Path | None = Field(default=None, description="CLOUD_AGENT_SERVICE_TOKEN_FILE")
    dev_mode: bool = Field(default=False, description="CLOUD_AGENT_DEV_MODE: loopback-only, no service token")
    image: str | None = Field(default=None, description="CLOUD_AGENT_IMAGE; None = the tag of the pinned build")
    docker_url: str = Field(default="unix:///var/run/docker.sock", description="CLOUD_AGENT_DOCKER_URL")
    listen_host: str = Field(default="127.0.0.1", description="CLOUD_AGENT_LISTEN_HOST")
    listen_port: int = Field(default=8765, description="CLOUD_AGENT_LISTEN_PORT")
    models: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_MODELS))
    turn_timeout_s: float = Field(default=300.0, description="CLOUD_AGENT_TURN_TIMEOUT_S")
    handshake_timeout_s: float = Field(default=90.0, description="CLOUD_AGENT_HANDSHAKE_TIMEOUT_S")
    idle_stop_s: float = Field(default=1800.0, description="CLOUD_AGENT_IDLE_STOP_S: stop idle sandboxes")
    resident_idle_s: float = Field(default=900.0, description="CLOUD_AGENT_RESIDENT_IDLE_S: retire idle processes")
    keeper_buffer_bytes: int = Field(default=64 << 20, ge=4096, description="CLOUD_AGENT_KEEPER_BUFFER_BYTES: CLI"
                                     " output a keeper holds unacknowledged (a turn's output); beyond it the keeper"
                                     " is broken and the member retires")
    keeper_link: Literal["host", "exec"] = Field(
        default="host", description="CLOUD_AGENT_KEEPER_LINK: host (the keeper's socket from the host, through the"
                                    " sandbox's init; an attached exec where the host cannot) or exec (always an"
                                    " attached exec, ca-keeper's relay)")
    max_message_bytes: int = Field(default=1024 * 1024, description="CLOUD_AGENT_MAX_MESSAGE_BYTES")
    max_body_bytes: int | None = Field(default=None, gt=0,
                                       description="CLOUD_AGENT_MAX_BODY_BYTES; default 6 x message + 64 KiB")
    max_turns: int | None = Field(default=32, ge=1, description="CLOUD_AGENT_MAX_TURNS: admitted jobs at once")
    max_running_sandboxes: int | None = Field(default=64, ge=1, description="CLOUD_AGENT_MAX_RUNNING_SANDBOXES")
    queue_timeout_s: float = Field(default=30.0, gt=0, description="CLOUD_AGENT_QUEUE_TIMEOUT_S: then 503 host_busy")
    max_launches: int | None = Field(default=None, ge=1, description="CLOUD_AGENT_MAX_LAUNCHES: CLIs starting at "
                                     "once, process start to handshake (default: the host's CPU count)")
    resident_memory_mb: int | None = Field(default=None, ge=1,
                                           description="CLOUD_AGENT_RESIDENT_MEMORY_MB; default half the host's")
    memory_refresh_s: float = Field(default=5.0, gt=0, description="CLOUD_AGENT_MEMORY_REFRESH_S: reading period")
    memory_pss_every_s: float = Field(default=60.0, ge=0, description="CLOUD_AGENT_MEMORY_PSS_EVERY_S: the PSS "
                                      "gauge's reading period (smaps_rollup; 0: every reading period)")
    sandbox_disk_mb: int | None = Field(default=10240, ge=1,
                                        description="CLOUD_AGENT_SANDBOX_DISK_MB: per-sandbox disk bound")
    retain_days: float | None = Field(default=30.0, gt=0,
                                      description="CLOUD_AGENT_RETAIN_DAYS: unused sandboxes are removed after")
    sweep_interval_s: float = Field(default=60.0, gt=0,
                                    description="CLOUD_AGENT_SWEEP_INTERVAL_S: disk scans and retention")
    event_buffer_bytes: int = Field(default=1024 * 1024, gt=0,
                                    description="CLOUD_AGENT_EVENT_BUFFER_BYTES: per-job stream buffer")
    heartbeat_interval_s: float = Field(default=10.0, description="CLOUD_AGENT_HEARTBEAT_INTERVAL_S")
    host_id: str | None = Field(default=None, description="CLOUD_AGENT_HOST_ID; default kept in HOME/host-id")
    probe_interval_s: float = Field(default=60.0, gt=0, description="CLOUD_AGENT_PROBE_INTERVAL_S: reverse probe period")
    probe_timeout_s: float = Field(default=60.0, gt=0, description="CLOUD_AGENT_PROBE_TIMEOUT_S")
    control_plane_url: str | None = Field(default=None, description="CLOUD_AGENT_CONTROL_PLANE_URL: heartbeat POSTs")
    control_plane_timeout_s: float = Field(default=5.0, gt=0, description="CLOUD_AGENT_CONTROL_PLANE_TIMEOUT_S")
    breaker_failures: int = Field(default=3, ge=1, description="CLOUD_AGENT_BREAKER_FAILURES: failures that open")
    breaker_reset_s: float = Field(default=30.0, gt=0, description="CLOUD_AGENT_BREAKER_RESET_S: open -> half-open")
    store_url: SecretStr | None = Field(default=None, description="CLOUD_AGENT_STORE_URL: postgresql://… (a fleet's"
                                        " shared store); unset = SQLite in HOME")
    api_url: str | None = Field(default=None, description="CLOUD_AGENT_API_URL: where other hosts of the fleet reach"
                                " this one; default http://LISTEN_HOST:LISTEN_PORT")
    host_capacity: int = Field(default=100, ge=1, description="CLOUD_AGENT_HOST_CAPACITY: chats placed on this host")
    lease_ttl_s: float = Field(default=30.0, gt=0, description="CLOUD_AGENT_LEASE_TTL_S: heartbeat lease in the store")
    forward_timeout_s: float = Field(default=600.0, gt=0, description="CLOUD_AGENT_FORWARD_TIMEOUT_S")
    native_compaction: Literal["off", "on"] = Field(
        default="off", description="CLOUD_AGENT_NATIVE_COMPACTION: off = a context-window refusal is the turn's "
        "context_too_long (no summary request, no retry with a rewritten history); on = the CLI may compact, "
        "and the receipt says so")
    proxy_process: Literal["service", "daemon"] = Field(
        default="service", description="CLOUD_AGENT_PROXY_PROCESS: where the model proxy runs. service = a process of "
        "its own that outlives daemon restarts (a reply streaming across a restart reaches its CLI); daemon = in the "
        "daemon (a restart breaks the streams in flight; the CLIs retry at the same socket paths)")
    proxy_linger_s: float = Field(default=300.0, gt=0, description="CLOUD_AGENT_PROXY_LINGER_S: the proxy service "
                                  "exits after this long with no daemon attached and no request in flight")
    memory_bytes: int = 4 * 1024**3
    pids_limit: int = 1024
    nano_cpus: int = 2_000_000_000

    @field_validator("store_url")
    @classmethod
    def _store_url(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None or not v.get_secret_value():
            return None
        validate_store_url(v.get_secret_value())
        return v

    def resident_memory_bytes(self) -> int:
        if self.resident_memory_mb is not None:
            return self.resident_memory_mb * 1024 * 1024
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2

    @property
    def store_path(self) -> Path:
        return self.home / "store.db"

    @property
    def fleet(self) -> bool:
        """A shared store makes this daemon one host of a fleet (SPEC 16)."""
        return self.store_url is not None

    def resolved_api_url(self) -> str:
        return self.api_url or f"http://{self.listen_host}:{self.listen_port}"

    def gateway_key(self) -> SecretStr:
        if self.gateway_key_file is None:
            return SecretStr(LOOPBACK_KEY)
        try:
            return SecretStr(self.gateway_key_file.read_text().strip())
        except OSError as exc:
            raise ValueError(f"gateway_key_file: cannot read {self.gateway_key_file}: {exc.strerror}") from None

    def service_token(self) -> SecretStr | None:
        if self.service_token_file is None:
            return None
        try:
            token = self.service_token_file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"service_token_file: cannot read {self.service_token_file}: {exc.strerror}") from None
        if len(token) < 16:
            raise ValueError("service_token_file: the token must be at least 16 characters")
        return SecretStr(token)

    def resolved_host_id(self) -> str:
        if self.host_id:
            return self.host_id
        path = self.home / "host-id"
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            self.home.mkdir(parents=True, exist_ok=True)
            ident = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
            path.write_text(ident + "\n")
            return ident

    @property
    def socket_root(self) -> Path:
        """Where the model proxy makes each sandbox's socket directory (SPEC 7)."""
        return self.socket_dir or self.home / "sockets"

    def check_socket_root(self) -> Path:
        """The socket root, if ``<root>/ca-<24 hex>/model.sock`` fits a unix socket address
        (107 bytes); checked when the daemon is built, with the setting to change named."""
        longest = len(str(self.socket_root).encode()) + len("/ca-" + "0" * 24 + "/model.sock")
        if longest > 107:
            field = "socket_dir (CLOUD_AGENT_SOCKET_DIR)" if self.socket_dir else "home (CLOUD_AGENT_HOME)"
            raise ValueError(f"{field}: the model socket path would be {longest} bytes, over the 107 of a unix "
                             "socket; set CLOUD_AGENT_SOCKET_DIR to a shorter directory")
        return self.socket_root


_ENV = {
    "CLOUD_AGENT_HOME": "home", "CLOUD_AGENT_GATEWAY_URL": "gateway_url",
    "CLOUD_AGENT_GATEWAY_KEY_FILE": "gateway_key_file", "CLOUD_AGENT_SERVICE_TOKEN_FILE": "service_token_file",
    "CLOUD_AGENT_DEV_MODE": "dev_mode", "CLOUD_AGENT_GATEWAY_KEY_DIR": "gateway_key_dir",
    "CLOUD_AGENT_SOCKET_DIR": "socket_dir",
    "CLOUD_AGENT_WIRE_CAPTURE": "wire_capture", "CLOUD_AGENT_WIRE_CAPTURE_DAYS": "wire_capture_days",
    "CLOUD_AGENT_IMAGE": "image", "CLOUD_AGENT_DOCKER_URL": "docker_url",
    "CLOUD_AGENT_LISTEN_HOST": "listen_host", "CLOUD_AGENT_LISTEN_PORT": "listen_port",
    "CLOUD_AGENT_TURN_TIMEOUT_S": "turn_timeout_s", "CLOUD_AGENT_HANDSHAKE_TIMEOUT_S": "handshake_timeout_s",
    "CLOUD_AGENT_IDLE_STOP_S": "idle_stop_s", "CLOUD_AGENT_RESIDENT_IDLE_S": "resident_idle_s",
    "CLOUD_AGENT_MAX_MESSAGE_BYTES": "max_message_bytes", "CLOUD_AGENT_MAX_BODY_BYTES": "max_body_bytes",
    "CLOUD_AGENT_EVENT_BUFFER_BYTES": "event_buffer_bytes", "CLOUD_AGENT_MAX_TURNS": "max_turns",
    "CLOUD_AGENT_MAX_RUNNING_SANDBOXES": "max_running_sandboxes", "CLOUD_AGENT_QUEUE_TIMEOUT_S": "queue_timeout_s",
    "CLOUD_AGENT_MAX_LAUNCHES": "max_launches",
    "CLOUD_AGENT_RESIDENT_MEMORY_MB": "resident_memory_mb", "CLOUD_AGENT_MEMORY_REFRESH_S": "memory_refresh_s",
    "CLOUD_AGENT_MEMORY_PSS_EVERY_S": "memory_pss_every_s",
    "CLOUD_AGENT_SANDBOX_DISK_MB": "sandbox_disk_mb", "CLOUD_AGENT_RETAIN_DAYS": "retain_days",
    "CLOUD_AGENT_SWEEP_INTERVAL_S": "sweep_interval_s",
    "CLOUD_AGENT_HEARTBEAT_INTERVAL_S": "heartbeat_interval_s",
    "CLOUD_AGENT_KEEPER_BUFFER_BYTES": "keeper_buffer_bytes", "CLOUD_AGENT_KEEPER_LINK": "keeper_link",
    "CLOUD_AGENT_HOST_ID": "host_id", "CLOUD_AGENT_PROBE_INTERVAL_S": "probe_interval_s",
    "CLOUD_AGENT_PROBE_TIMEOUT_S": "probe_timeout_s", "CLOUD_AGENT_CONTROL_PLANE_URL": "control_plane_url",
    "CLOUD_AGENT_CONTROL_PLANE_TIMEOUT_S": "control_plane_timeout_s",
    "CLOUD_AGENT_BREAKER_FAILURES": "breaker_failures", "CLOUD_AGENT_BREAKER_RESET_S": "breaker_reset_s",
    "CLOUD_AGENT_STORE_URL": "store_url", "CLOUD_AGENT_API_URL": "api_url",
    "CLOUD_AGENT_HOST_CAPACITY": "host_capacity", "CLOUD_AGENT_LEASE_TTL_S": "lease_ttl_s",
    "CLOUD_AGENT_FORWARD_TIMEOUT_S": "forward_timeout_s",
    "CLOUD_AGENT_NATIVE_COMPACTION": "native_compaction",
    "CLOUD_AGENT_PROXY_PROCESS": "proxy_process", "CLOUD_AGENT_PROXY_LINGER_S": "proxy_linger_s",
}


def load_settings(env: dict[str, str] | None = None, **overrides: Any) -> Settings:
    env = dict(os.environ if env is None else env)
    if env.get("CLOUD_AGENT_SANDBOX_NETWORK"):
        raise ValueError("CLOUD_AGENT_SANDBOX_NETWORK: removed; every sandbox is sealed (network none) and reaches "
                         "the model only through its model socket (unset it)")
    data: dict[str, Any] = {}
    cfg_file = env.get("CLOUD_AGENT_CONFIG")
    if cfg_file:
        with open(cfg_file, "rb") as fh:
            data.update(tomllib.load(fh))
    for var, field in _ENV.items():
        if env.get(var) not in (None, ""):
            data[field] = env[var]
    models = dict(DEFAULT_MODELS)
    models.update(data.get("models", {}))
    for runtime in RUNTIMES:
        var = f"CLOUD_AGENT_MODEL_{runtime.upper()}"
        if env.get(var):
            models[runtime] = env[var]
    data["models"] = models
    data.update(overrides)
    return Settings.model_validate(data)
