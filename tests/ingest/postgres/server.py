"""A real, throw-away PostgreSQL server for the PostgreSQL source's tests.

Debian's ``postgresql`` package (``/usr/lib/postgresql/<major>/bin``; ``.ci/run`` installs it
when missing), ``initdb``'d into a temporary directory, listening only on a Unix socket in
that directory (``listen_addresses=''``), with ``wal_level=logical``. PostgreSQL refuses to
run as root, so when the tests run as root the directory is handed to the ``postgres`` OS
user and the binaries run through ``runuser -u postgres --``. ``LAMINA_PG_BIN`` overrides
the binary directory.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg2

CONF = """
listen_addresses = ''
unix_socket_directories = '{sock}'
wal_level = logical
max_replication_slots = 32
max_wal_senders = 32
wal_sender_timeout = 60s
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 32MB
max_connections = 60
log_min_messages = warning
"""


def find_bin() -> Path | None:
    """The directory of the newest installed PostgreSQL's binaries, or None."""
    env = os.environ.get("LAMINA_PG_BIN")
    if env:
        return Path(env)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"),
                   key=lambda p: int(p.split("/")[3]) if p.split("/")[3].isdigit() else 0)
    return Path(found[-1]).parent if found else None


class PgServer:
    """One running server; :meth:`connect` gives an autocommit superuser connection."""

    def __init__(self, root: Path, bindir: Path, run_as: str | None,
                 dbname: str = "lamina_test") -> None:
        self.root = root
        self.bindir = bindir
        self.run_as = run_as
        self.data = root / "data"
        self.sock = root / "sock"
        self.log = root / "server.log"
        self.dbname = dbname

    def database(self, dbname: str) -> PgServer:
        """Create database ``dbname``; a view of this server that connects to it."""
        with self.connect("postgres") as conn:
            conn.cursor().execute(f"CREATE DATABASE {dbname}")
        return PgServer(self.root, self.bindir, self.run_as, dbname)

    def drop_database(self) -> None:
        """Drop this view's database and every replication slot in it."""
        with self.connect("postgres") as conn, conn.cursor() as cur:
            for _ in range(50):
                cur.execute("SELECT slot_name, active_pid FROM pg_replication_slots "
                            "WHERE database = %s", (self.dbname,))
                slots = cur.fetchall()
                if not slots:
                    break
                for slot, pid in slots:
                    if pid is not None:
                        cur.execute("SELECT pg_terminate_backend(%s)", (pid,))
                    else:
                        cur.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                time.sleep(0.05)
            cur.execute(f"DROP DATABASE IF EXISTS {self.dbname} WITH (FORCE)")

    def _cmd(self, *args: str) -> list[str]:
        prefix = ["runuser", "-u", self.run_as, "--"] if self.run_as else []
        return [*prefix, *args]

    def start(self) -> None:
        self.sock.mkdir()
        if self.run_as:
            pw = pwd.getpwnam(self.run_as)
            for p in (self.root, self.sock):
                os.chown(p, pw.pw_uid, pw.pw_gid)
        subprocess.run(self._cmd(str(self.bindir / "initdb"), "-D", str(self.data), "-A",
                                 "trust", "-U", "postgres", "-E", "UTF8", "--locale=C",
                                 "--no-sync"),
                       check=True, capture_output=True)
        with (self.data / "postgresql.conf").open("a") as f:
            f.write(CONF.format(sock=self.sock))
        subprocess.run(self._cmd(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l",
                                 str(self.log), "-w", "-t", "60", "start"),
                       check=True, capture_output=True)
        with self.connect("postgres") as conn:
            conn.cursor().execute(f"CREATE DATABASE {self.dbname}")

    def stop(self) -> None:
        subprocess.run(self._cmd(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m",
                                 "fast", "-w", "stop"), check=False, capture_output=True)

    @property
    def dsn(self) -> str:
        """A libpq key=value DSN of the test database."""
        return f"host={self.sock} dbname={self.dbname} user=postgres"

    def url(self) -> str:
        """The same as a URL (the socket directory as the ``host`` parameter)."""
        return f"postgresql://postgres@/{self.dbname}?host={self.sock}"

    @contextmanager
    def connect(self, dbname: str | None = None) -> Iterator[Any]:
        conn = psycopg2.connect(host=str(self.sock), dbname=dbname or self.dbname,
                                user="postgres")
        conn.autocommit = True
        try:
            yield conn
        finally:
            conn.close()

    def execute(self, *statements: str) -> None:
        """Run statements in one transaction."""
        with self.connect() as conn:
            conn.autocommit = False
            with conn.cursor() as cur:
                for s in statements:
                    cur.execute(s)
            conn.commit()

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self.connect() as conn, conn.cursor() as cur:
            cur.execute(sql, args)
            return list(cur.fetchall())

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextmanager
def running_server() -> Iterator[PgServer]:
    """Start a server in a temp dir; stop it and remove the dir on the way out."""
    bindir = find_bin()
    if bindir is None:
        raise RuntimeError("no PostgreSQL found under /usr/lib/postgresql/*/bin: install "
                           "Debian's postgresql package (.ci/run does) or set LAMINA_PG_BIN")
    run_as = "postgres" if os.geteuid() == 0 else None
    root = Path(tempfile.mkdtemp(prefix="lamina-pg-"))
    server = PgServer(root, bindir, run_as)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)

