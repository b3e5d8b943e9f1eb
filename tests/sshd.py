"""A real OpenSSH server on 127.0.0.1 for push and pull tests: an unprivileged
port, a throwaway host key and user key, all in the test's temporary folder.

Where no sshd can be had the tests skip, saying why; under ``CI=true`` that
is a failure instead, so CI always runs them (.ci/run installs openssh-server).
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SSHD = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd") if os.path.exists(p)), None)


def need_sshd() -> str:
    """The sshd to run; skips the test (fails it under CI=true) where there is none."""
    missing = [name for name, found in (("sshd", SSHD), ("ssh", shutil.which("ssh")), ("ssh-keygen", shutil.which("ssh-keygen"))) if not found]
    if missing:
        why = f"no {', '.join(missing)} on this machine (Debian: apt-get install openssh-server openssh-client)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the ssh tests: {why}")
        pytest.skip(why)
    return SSHD  # type: ignore[return-value]


@dataclass
class Server:
    """A running sshd and how to reach it: ``rsh`` for dagsync's --rsh, ``host`` for HOST:PATH."""

    process: subprocess.Popen
    port: int
    rsh: str
    host: str
    remote_dagsync: str
    log: Path

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(folder: Path) -> Server:
    sshd = need_sshd()
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("host", "user"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
    (folder / "authorized_keys").write_text((folder / "user.pub").read_text())
    os.chmod(folder / "authorized_keys", 0o600)
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    port = _free_port()
    config = folder / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {folder / 'host'}\n"
        f"AuthorizedKeysFile {folder / 'authorized_keys'}\nPidFile {folder / 'sshd.pid'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        "PermitRootLogin prohibit-password\nPrintMotd no\nLogLevel ERROR\n"
    )
    log = folder / "sshd.log"
    process = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stderr=open(log, "wb"))
    host_key = (folder / "host.pub").read_text().split()
    (folder / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_key[0]} {host_key[1]}\n")
    rsh = (
        f"ssh -p {port} -i {folder / 'user'} -o IdentitiesOnly=yes -o UserKnownHostsFile={folder / 'known_hosts'} "
        "-o StrictHostKeyChecking=yes -o LogLevel=ERROR"
    )
    remote_dagsync = f"{shlex.quote(sys.executable)} -m dagsync"
    server = Server(process, port, rsh, f"{getpass.getuser()}@127.0.0.1", remote_dagsync, log)
    deadline = time.monotonic() + 20
    while True:
        done = subprocess.run([*shlex.split(rsh), "-o", "BatchMode=yes", server.host, "true"], capture_output=True)
        if done.returncode == 0:
            return server
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"sshd did not start: {log.read_text()} {done.stderr.decode()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A running sshd for the module's tests: ``from tests.sshd import server``."""
    running = start(tmp_path_factory.mktemp("sshd"))
    yield running
    running.stop()
