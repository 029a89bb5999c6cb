"""A real PostgreSQL 15 for the tests: a throwaway cluster in a temporary folder.

`initdb` refuses root, so as root the cluster belongs to an unprivileged user
(`TRIALLEDGER_PG_USER`, default `postgres`; `.ci/run` creates it when missing). The
server listens on a free loopback port with password (scram-sha-256) authentication. It
never syncs to disk (`initdb --no-sync`, `fsync=off`, no full-page writes), which only an
operating system's crash could tell: a server killed or stopped at once (the outage
tests) keeps every commit, which reached the kernel before it was acknowledged.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from trialledger.adapters.demo import free_port

PASSWORD = "tl-" + uuid.uuid4().hex
SUPERUSER = "trialledger"


@dataclass
class PostgresServer:
    folder: Path
    port: int
    owner: str | None
    head_template: str | None = None

    def _run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        prefix = ["runuser", "-u", self.owner, "--"] if self.owner else []
        return subprocess.run([*prefix, *argv], capture_output=True, text=True, check=False)

    @classmethod
    def start(cls) -> PostgresServer:
        if shutil.which("initdb") is None:
            raise RuntimeError("PostgreSQL 15 is not installed (initdb is not on PATH)")
        owner = os.environ.get("TRIALLEDGER_PG_USER", "postgres") if os.geteuid() == 0 else None
        folder = Path(tempfile.mkdtemp(prefix="trialledger-pg-"))
        server = cls(folder, free_port(), owner)
        (folder / "pw").write_text(PASSWORD + "\n")
        if owner:
            uid = pwd.getpwnam(owner).pw_uid
            for path in (folder, folder / "pw"):
                os.chown(path, uid, -1)
        done = server._run("initdb", "-D", str(folder / "data"), "-U", SUPERUSER,
                           "--auth=scram-sha-256", f"--pwfile={folder / 'pw'}", "-E", "UTF8",
                           "--no-sync")
        if done.returncode:
            raise RuntimeError(f"initdb failed: {done.stderr}")
        done = server._run("pg_ctl", "-D", str(folder / "data"), "-o", server.options(),
                           "-l", str(folder / "server.log"), "-w", "start")
        if done.returncode:
            raise RuntimeError(f"pg_ctl start failed: {done.stderr}")
        return server

    def options(self) -> str:
        return (f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 "
                "-c fsync=off -c full_page_writes=off")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{SUPERUSER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def create_database(self, template: str = "template1") -> str:
        name = "t_" + uuid.uuid4().hex[:12]
        env = {**os.environ, "PGPASSWORD": PASSWORD}
        subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER,
                        "-d", "postgres", "-qc",
                        f"CREATE DATABASE {name} TEMPLATE {template} STRATEGY FILE_COPY"],
                       check=True, env=env, capture_output=True)
        return self.url(name)

    def create_store(self) -> str:
        """A new database holding an empty store at the head revision: a copy of one the
        migrations built on this server's first call (0.2 s, where migrating each new
        database took 0.35–0.5 s of both cores). Tests of the migrations themselves, and
        of a store's first open, take `create_database()`'s empty one instead."""
        if self.head_template is None:
            from trialledger.store import Ledger

            url = self.create_database()

            async def build() -> None:
                async with await Ledger.open(url):
                    pass

            # A thread of its own: the fixture may be set up beside a running event loop.
            with ThreadPoolExecutor(1) as pool:
                pool.submit(asyncio.run, build()).result()
            self.head_template = url.rsplit("/", 1)[1]
        return self.create_database(self.head_template)

    def query(self, sql: str, database: str = "postgres") -> str:
        """One value `sql` gives, as psql prints it."""
        env = {**os.environ, "PGPASSWORD": PASSWORD}
        return subprocess.run(["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", SUPERUSER,
                               "-d", database, "-tAc", sql], check=True, env=env,
                              capture_output=True, text=True).stdout.strip()

    def restart(self, down_s: float) -> None:
        """Stop the server at once (every connection dies), wait, start it again."""
        data = str(self.folder / "data")
        self._run("pg_ctl", "-D", data, "-m", "immediate", "-w", "stop")
        time.sleep(down_s)
        self.start_again()

    def start_again(self) -> None:
        """Start the server a test stopped."""
        done = self._run("pg_ctl", "-D", str(self.folder / "data"), "-o", self.options(),
                         "-l", str(self.folder / "server.log"), "-w", "start")
        if done.returncode:
            raise RuntimeError(f"pg_ctl start failed: {done.stderr}")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.folder / "data"), "-m", "immediate", "stop")
        shutil.rmtree(self.folder, ignore_errors=True)
