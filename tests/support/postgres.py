"""A throwaway PostgreSQL cluster for tests and benchmarks (Debian's ``postgresql`` package).

``initdb`` + ``pg_ctl`` in a temporary directory, run as the unprivileged ``postgres`` user
(initdb refuses root), listening on a unix socket in that directory only
(``listen_addresses=''``: no TCP at all). Torn down (stopped, directory removed) at the end.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SUPERUSER = "cloud_agent"


def pg_bin() -> Path:
    """The newest installed server's bin directory (scripts/bootstrap.sh installs it)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise RuntimeError("no PostgreSQL server installed: run scripts/bootstrap.sh (step 'postgresql')")
    return Path(found[-1]).parent


@dataclass
class Cluster:
    root: Path
    port: int
    bin: Path
    fsync: bool
    _dbs: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def socket_dir(self) -> Path:
        return self.root / "sock"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}@/{dbname}?host={self.socket_dir}&port={self.port}"

    def _as_postgres(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        pw = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
        return subprocess.run([str(self.bin / argv[0]), *argv[1:]], capture_output=True, text=True, check=check,
                              user=pw.pw_uid if pw else None, group=pw.pw_gid if pw else None,
                              cwd=str(self.root), timeout=120)

    def start(self) -> None:
        opts = (f"-k {self.socket_dir} -p {self.port} -c listen_addresses='' -c max_connections=200"
                + ("" if self.fsync else " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"))
        proc = self._as_postgres("pg_ctl", "-D", str(self.root / "data"), "-o", opts, "-l", str(self.log_path),
                                 "-w", "-t", "60", "start", check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {proc.stderr.strip()} | log: {self.log_tail()}")

    def stop(self, mode: str = "fast") -> None:
        self._as_postgres("pg_ctl", "-D", str(self.root / "data"), "-m", mode, "-w", "-t", "60", "stop", check=False)

    def restart(self) -> None:
        self.stop("fast")
        self.start()

    def log_tail(self, n: int = 10) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def create_database(self, prefix: str = "t") -> str:
        """A fresh, empty database; returns its URL."""
        name = f"{prefix}_{os.getpid()}_{next(self._dbs)}"
        self._as_postgres("psql", "-h", str(self.socket_dir), "-p", str(self.port), "-U", SUPERUSER, "-d",
                          "postgres", "-v", "ON_ERROR_STOP=1", "-qc", f'CREATE DATABASE "{name}"')
        return self.url(name)


    def drop_database(self, url: str) -> None:
        name = url.split("/")[-1].split("?")[0]
        self._as_postgres("psql", "-h", str(self.socket_dir), "-p", str(self.port), "-U", SUPERUSER, "-d",
                          "postgres", "-qc", f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', check=False)


def _free_port_number() -> int:
    # only names the socket file (.s.PGSQL.<port>): no TCP listener is opened
    return 20000 + (os.getpid() * 7 + int.from_bytes(os.urandom(2), "big")) % 20000


@contextmanager
def pg_cluster(*, fsync: bool = False) -> Iterator[Cluster]:
    root = Path(tempfile.mkdtemp(prefix="ca-pg-"))
    bin_dir = pg_bin()
    cluster = Cluster(root=root, port=_free_port_number(), bin=bin_dir, fsync=fsync)
    try:
        cluster.socket_dir.mkdir()
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            for p in (root, cluster.socket_dir):
                os.chown(p, pw.pw_uid, pw.pw_gid)
        proc = cluster._as_postgres("initdb", "-D", str(root / "data"), "-U", SUPERUSER, "--auth=trust",
                                    "-E", "UTF8", "--locale=C", "--no-sync", check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"initdb failed: {proc.stderr.strip()[-500:]}")
        cluster.start()
        yield cluster
    finally:
        if (root / "data" / "postmaster.pid").exists():
            cluster.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)
