"""systemd integration without a running systemd: the unit files (systemd-analyze verify and
security), sd_notify (`Notifier`) against our own NOTIFY_SOCKET, socket activation
(`listen_fds`) with a socket really passed by systemd-socket-activate, and the real daemon
under systemd-socket-activate. The units under a real systemd: test_service_container.py.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kestreld.service import systemd
from kestreld.service.config import Config, read_config_file
from kestreld.errors import StartupError

from container import unit_with
from daemon import BASE_ARGS, START_TIMEOUT_S, model_path
from kestrelctl import Client

CHECKOUT = Path(__file__).resolve().parent.parent
UNITS = CHECKOUT / "systemd"
EXPOSURE_LIMIT = 2.0
UCRED = struct.Struct("3i")      # struct ucred: pid, uid, gid


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        reason = f"{tool} not installed: cannot check this here"
        print(f"SKIP: {reason}", file=sys.stderr)
        pytest.skip(reason)


# ---------------------------------------------------------------- unit files

def _verify(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, paths)],
                          capture_output=True, text=True, timeout=60)


def _units_for_verify(tmp_path: Path, service_text: str) -> tuple[Path, Path]:
    """Both units in one folder; the service's ExecStart binary swapped for one that exists
    here (verify checks it; /opt/kestrel/venv is only there after install-service.sh)."""
    service = tmp_path / "kestreld.service"
    service.write_text(unit_with(service_text, {
        "ExecStart": f"ExecStart={sys.executable} -m kestreld --config /etc/kestrel/kestreld.conf"}))
    sock = tmp_path / "kestreld.socket"
    shutil.copy(UNITS / "kestreld.socket", sock)
    return sock, service


def test_units_verify_without_warnings(tmp_path):
    _need("systemd-analyze")
    text = (UNITS / "kestreld.service").read_text()
    assert "ExecStart=/opt/kestrel/venv/bin/kestreld --config /etc/kestrel/kestreld.conf\n" in text
    sock, service = _units_for_verify(tmp_path, text)
    http = tmp_path / "kestreld-http.socket"
    shutil.copy(UNITS / "kestreld-http.socket", http)
    result = _verify(sock, http, service)
    assert (result.returncode, result.stderr) == (0, "")


def test_verify_reports_an_unknown_key(tmp_path):
    """The check above can fail: a misspelt key only warns (exit 0) but writes stderr."""
    _need("systemd-analyze")
    text = (UNITS / "kestreld.service").read_text().replace("ProtectClock=", "ProtectClok=")
    result = _verify(*_units_for_verify(tmp_path, text))
    assert "ProtectClok" in result.stderr


def test_security_exposure_at_most_2():
    _need("systemd-analyze")
    # --threshold is an integer in tenths of the printed level: 20 means 2.0.
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                             f"--threshold={round(EXPOSURE_LIMIT * 10)}",
                             str(UNITS / "kestreld.service")],
                            capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for kestreld\.service: (\d+\.\d+)", result.stdout)
    assert m, result.stdout + result.stderr
    print(f"systemd-analyze security exposure: {m.group(1)}")
    assert float(m.group(1)) <= EXPOSURE_LIMIT
    assert result.returncode == 0, result.stderr


def test_units_agree_with_each_other_and_the_protocol():
    sock = (UNITS / "kestreld.socket").read_text()
    service = (UNITS / "kestreld.service").read_text()
    for line in ("ListenStream=/run/kestrel/kestreld.sock", "SocketMode=0660",
                 "SocketGroup=kestrel", "DirectoryMode=0755"):
        assert re.search(rf"^{re.escape(line)}$", sock, re.M), line
    for line in ("Type=notify", "NotifyAccess=main", "Restart=on-failure", "WatchdogSec=30",
                 "MemoryDenyWriteExecute=yes", "PrivateNetwork=yes", "RestrictAddressFamilies=AF_UNIX"):
        assert re.search(rf"^{re.escape(line)}$", service, re.M), line
    # The .socket unit owns /run/kestrel: a service RuntimeDirectory=kestrel would delete the
    # socket file on every service restart.
    assert not re.search(r"^RuntimeDirectory=kestrel\s*$", service, re.M)


def test_http_socket_unit_is_loopback_only_and_named_for_the_daemon():
    text = (UNITS / "kestreld-http.socket").read_text()
    for line in ("ListenStream=127.0.0.1:8080", f"FileDescriptorName={systemd.HTTP_FDNAME}",
                 "Service=kestreld.service", "Accept=no", "IPAddressAllow=localhost",
                 "IPAddressDeny=any"):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line
    listen = re.findall(r"^ListenStream=(.*)$", text, re.M)
    cfg = Config(http=tuple(listen))          # refuses any non-loopback address
    assert all(a.loopback for a in cfg.http_addresses)
    for script in ("install-service.sh", "uninstall-service.sh"):
        assert "kestreld-http.socket" in (CHECKOUT / "scripts" / script).read_text(), script


def _instance_units(tmp_path: Path) -> list:
    """The instance templates in one folder (ExecStart swapped as for the plain units), and
    the instances `chat` and `embed` of each to verify."""
    shutil.copy(UNITS / "kestreld@.socket", tmp_path / "kestreld@.socket")
    shutil.copy(UNITS / "kestreld-http@.socket", tmp_path / "kestreld-http@.socket")
    (tmp_path / "kestreld@.service").write_text(unit_with(
        (UNITS / "kestreld@.service").read_text(),
        {"ExecStart": f"ExecStart={sys.executable} -m kestreld --config /etc/kestrel/%i.conf"}))
    return [tmp_path / f"{unit}@{name}.{kind}" for name in ("chat", "embed")
            for unit, kind in (("kestreld", "service"), ("kestreld", "socket"),
                               ("kestreld-http", "socket"))]


def test_instance_units_verify_without_warnings(tmp_path):
    _need("systemd-analyze")
    units = _instance_units(tmp_path)
    result = _verify(*units)
    assert (result.returncode, result.stderr) == (0, "")
    text = (tmp_path / "kestreld@.service").read_text().replace("ProtectClock=", "ProtectClok=")
    (tmp_path / "kestreld@.service").write_text(text)       # and the check can fail
    assert "ProtectClok" in _verify(*units[:2]).stderr


def _settings(text: str) -> list:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_instance_units_are_the_plain_units_but_for_the_instance():
    """kestreld@NAME: the config /etc/kestrel/NAME.conf and the socket /run/kestrel/NAME.sock;
    every other setting (the sandbox above all) the plain units' own."""
    def plain(unit: str, changes: dict) -> list:
        return _settings(unit_with((UNITS / unit).read_text(), changes))
    assert _settings((UNITS / "kestreld@.service").read_text()) == plain("kestreld.service", {
        "Description": "Description=Kestrel LLM inference daemon %i",
        "Requires": "Requires=kestreld@%i.socket", "After": "After=kestreld@%i.socket",
        "ExecStart": "ExecStart=/opt/kestrel/venv/bin/kestreld --config /etc/kestrel/%i.conf",
        "Also": "Also=kestreld@%i.socket"})
    assert _settings((UNITS / "kestreld@.socket").read_text()) == plain("kestreld.socket", {
        "Description": "Description=Kestrel LLM inference daemon %i socket",
        "ListenStream": "ListenStream=/run/kestrel/%i.sock"})
    http = _settings((UNITS / "kestreld-http@.socket").read_text())
    for line in ("ListenStream=/run/kestrel/%i.http.sock",
                 f"FileDescriptorName={systemd.HTTP_FDNAME}", "Service=kestreld@%i.service",
                 "IPAddressAllow=localhost", "IPAddressDeny=any"):
        assert line in http, line
    for script in ("install-service.sh", "uninstall-service.sh"):
        text = (CHECKOUT / "scripts" / script).read_text()
        for unit in ("kestreld@.service", "kestreld@.socket", "kestreld-http@.socket"):
            assert unit in text, (script, unit)


def test_instance_security_exposure_at_most_2(tmp_path):
    _need("systemd-analyze")
    service = _instance_units(tmp_path)[0]
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                             f"--threshold={round(EXPOSURE_LIMIT * 10)}", str(service)],
                            capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for kestreld@chat\.service: (\d+\.\d+)", result.stdout)
    assert m and float(m.group(1)) <= EXPOSURE_LIMIT, result.stdout + result.stderr


def test_sample_config_is_a_valid_config():
    values = read_config_file(str(UNITS / "kestreld.conf.sample"))
    cfg = Config(**values)
    assert cfg.model == "/opt/kestrel/models/SmolLM2-135M-Instruct.Q8_0.gguf"
    assert cfg.model in (CHECKOUT / "scripts" / "install-service.sh").read_text()


# ---------------------------------------------------------------- sd_notify

class NotifyListener:
    """Our own NOTIFY_SOCKET: a datagram socket with SO_PASSCRED, like systemd's."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(address)

    def receive(self, timeout: float = 5.0) -> tuple[str, int]:
        """One datagram and the sender's pid (from SCM_CREDENTIALS)."""
        self.sock.settimeout(timeout)
        data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(UCRED.size))
        pids = [UCRED.unpack(d)[0] for level, kind, d in ancillary
                if (level, kind) == (socket.SOL_SOCKET, socket.SCM_CREDENTIALS)]
        assert len(pids) == 1, ancillary
        return data.decode(), pids[0]

    def close(self):
        self.sock.close()


@pytest.fixture
def listener(tmp_path):
    path = str(tmp_path / "notify")
    lst = NotifyListener(path)
    yield path, lst
    lst.close()


def test_notifier_sends_each_message_with_our_pid(listener):
    path, lst = listener
    n = systemd.Notifier.from_environ({"NOTIFY_SOCKET": path})
    assert n.enabled and n.watchdog_interval is None
    n.ready("model x\nloaded")
    assert lst.receive() == ("READY=1\nSTATUS=model x loaded", os.getpid())
    n.status("cache 12 tokens, queue 0")
    assert lst.receive() == ("STATUS=cache 12 tokens, queue 0", os.getpid())
    n.watchdog()
    assert lst.receive() == ("WATCHDOG=1", os.getpid())
    n.stopping()
    assert lst.receive() == ("STOPPING=1", os.getpid())
    n.close()


def test_notifier_abstract_namespace():
    name = f"kestrel-test-notify-{os.getpid()}"
    lst = NotifyListener("\0" + name)
    try:
        systemd.Notifier.from_environ({"NOTIFY_SOCKET": "@" + name}).ready()
        assert lst.receive() == ("READY=1", os.getpid())
    finally:
        lst.close()


def test_notifier_without_notify_socket_is_inert():
    n = systemd.Notifier.from_environ({"WATCHDOG_USEC": "30000000"})
    assert not n.enabled and n.watchdog_interval is None
    n.ready("x"), n.status("y"), n.watchdog(), n.stopping()   # no socket, no error


def test_watchdog_interval_is_half_of_watchdog_usec(listener):
    path, _ = listener
    mine = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    assert systemd.Notifier.from_environ(mine).watchdog_interval == 15.0
    other = dict(mine, WATCHDOG_PID=str(os.getpid() + 1))     # meant for another process
    assert systemd.Notifier.from_environ(other).watchdog_interval is None
    with pytest.raises(StartupError, match="WATCHDOG_USEC"):
        systemd.Notifier.from_environ(dict(mine, WATCHDOG_USEC="soon"))
    with pytest.raises(StartupError, match="NOTIFY_SOCKET"):
        systemd.Notifier.from_environ({"NOTIFY_SOCKET": "relative/path"})


def test_notifier_survives_a_vanished_notify_socket(tmp_path, caplog):
    n = systemd.Notifier.from_environ({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    n.watchdog()
    n.watchdog()
    assert [r.message for r in caplog.records].count(
        f"sd_notify to {str(tmp_path / 'gone')!r} failed: [Errno 2] No such file or directory") == 1


# ---------------------------------------------------------------- socket activation

CHILD = """
import json, os, socket, sys
from kestreld.service.systemd import activated_sockets
sock, http = activated_sockets(os.environ)
assert http == ()
conn, _ = sock.accept()
conn.sendall(json.dumps({
    "fd": sock.fileno(), "family": int(sock.family), "type": int(sock.type),
    "inheritable": os.get_inheritable(sock.fileno()),
    "name": sock.getsockname(),
    "left": sorted(k for k in os.environ if k.startswith("LISTEN_")),
}).encode())
conn.close()
"""


def _retry(action, timeout: float):
    """`action()` until the socket file appears (systemd-socket-activate is starting)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return action()
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _connect(path: str, timeout: float) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _retry(lambda: s.connect(path), timeout)
    return s


def _activated_child(path: str, activate_args: list, code: str):
    """Run `code` under systemd-socket-activate (the socket at `path` first, then
    `activate_args`); connect to `path` and return the JSON the child sends back."""
    _need("systemd-socket-activate")
    child = subprocess.Popen(["systemd-socket-activate", "-l", path, *activate_args,
                              "-E", f"PYTHONPATH={CHECKOUT}", sys.executable, "-c", code],
                             stderr=subprocess.PIPE, text=True)
    try:
        with _connect(path, 10) as s:
            s.settimeout(20)
            seen = json.loads(s.makefile("rb").read() or b"null")
    finally:
        child.wait(20)
    assert seen is not None, child.stderr.read()
    return seen


def test_listen_fds_takes_the_passed_socket(tmp_path):
    path = str(tmp_path / "kestreld.sock")
    seen = _activated_child(path, ["--fdname=kestrel"], CHILD)
    assert seen == {"fd": 3, "family": int(socket.AF_UNIX), "type": int(socket.SOCK_STREAM),
                    "inheritable": False, "name": path, "left": []}


def test_activated_socket_refuses_a_datagram_socket(tmp_path):
    _need("systemd-socket-activate")
    path = str(tmp_path / "kestreld.sock")
    child = subprocess.Popen(["systemd-socket-activate", "--datagram", "-l", path,
                              "-E", f"PYTHONPATH={CHECKOUT}", sys.executable, "-c",
                              "import os; from kestreld.service.systemd import activated_sockets; "
                              "activated_sockets(os.environ)"],
                             stderr=subprocess.PIPE, text=True)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            _retry(lambda: s.sendto(b"x", path), 10)      # activity makes it exec the child
        _, err = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 1
    assert "StartupError: socket activation: expected one AF_UNIX stream socket" in err


def test_activated_sockets_tells_the_http_sockets_by_name(tmp_path):
    """Both units' sockets passed at once (as systemd does for kestreld.service): the one
    named `http` goes to the HTTP API, the other is the RPC socket."""
    with socket.socket() as probe:          # a free port (systemd-socket-activate takes no 0)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    seen = _activated_child(
        str(tmp_path / "kestreld.sock"), ["-l", f"127.0.0.1:{port}", "--fdname=kestreld.socket:http"],
        "import json, os\n"
        "from kestreld.service.systemd import activated_sockets\n"
        "rpc, http = activated_sockets(os.environ)\n"
        "conn, _ = rpc.accept()\n"
        "conn.sendall(json.dumps([int(rpc.family), [int(s.family) for s in http]]).encode())\n")
    assert seen == [int(socket.AF_UNIX), [int(socket.AF_INET)]]


def test_listen_fds_ignores_and_clears_another_process_fds():
    env = {"LISTEN_PID": str(os.getpid() + 1), "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x", "HOME": "/"}
    assert systemd.listen_fds(env) == []
    assert env == {"HOME": "/"}
    assert systemd.activated_sockets({}) == (None, ())


# ---------------------------------------------------------------- the daemon, activated

def test_daemon_under_socket_activation_notifies_and_serves(tmp_path, listener):
    """The real kestreld started by systemd-socket-activate on the first connection: it
    answers `ping` on the passed socket, says READY=1 only after the model is loaded,
    pings the watchdog from its loop, says STOPPING=1 on SIGTERM and leaves the socket
    file (systemd's) in place."""
    _need("systemd-socket-activate")
    notify_path, lst = listener
    path = str(tmp_path / "kestreld.sock")
    log_path = tmp_path / "kestreld.log"
    with open(log_path, "w") as log:
        daemon = subprocess.Popen(
            ["systemd-socket-activate", "-l", path, "-E", f"NOTIFY_SOCKET={notify_path}",
             "-E", "WATCHDOG_USEC=1000000", "-E", f"PYTHONPATH={CHECKOUT}",
             sys.executable, "-m", "kestreld", "--model", model_path(), *BASE_ARGS],
            stdout=log, stderr=subprocess.STDOUT)
    try:
        _connect(path, 10).close()          # the first connection makes it exec kestreld
        message, pid = lst.receive(timeout=START_TIMEOUT_S)
        assert pid == daemon.pid            # exec'd in place: LISTEN_PID is this pid
        assert message.split("\n")[0] == "READY=1", message
        assert "inference state ready" in log_path.read_text()   # READY only after the load
        with Client(path, timeout=30) as client:
            assert client.ping() == {"ok": True, "pid": daemon.pid}
        seen = set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not {"WATCHDOG=1", "STATUS"} <= seen:
            message, pid = lst.receive(timeout=5)
            assert pid == daemon.pid
            seen |= {line.split("=")[0] if line.startswith("STATUS=") else line
                     for line in message.split("\n")}
        assert {"WATCHDOG=1", "STATUS"} <= seen, seen
        daemon.send_signal(signal.SIGTERM)
        messages = []
        while "STOPPING=1" not in "\n".join(messages):
            messages.append(lst.receive(timeout=20)[0])
        assert daemon.wait(30) == 0, log_path.read_text()
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    assert Path(path).is_socket()           # systemd's socket: not the daemon's to unlink
