"""A real systemd as PID 1 of a throw-away container, for testing the units (test helper).

`SystemdContainer` boots the host's own systemd with `systemd-nspawn --volatile=yes`: a
tmpfs root, the host's /usr read-only, and the files the test binds in (the checkout, the
interpreter, unit files, config). Commands run inside with `nsenter`; the container's files
are reachable from the host under /proc/LEADER/root. `unavailable_reason()` says why a
container cannot be booted here (not root, no systemd-nspawn, ...), for a loud skip.
See /work/shared/SYSTEMD-TESTING.md for the facts this relies on.

`unit_with(text, changes)` rewrites keys of a unit file for a test copy and fails when a
key to replace is missing, so a test copy never drifts silently from the real unit.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from typing import Mapping, Optional, Sequence

CGROUP_ROOT = "/sys/fs/cgroup"


def unavailable_reason() -> Optional[str]:
    """None when a container can be booted here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "booting a systemd container needs root"
    for tool in ("systemd-nspawn", "nsenter"):
        if shutil.which(tool) is None:
            return (f"{tool} not found (apt-get install systemd-container="
                    "$(dpkg-query -W -f='${Version}' systemd))")
    if not os.path.isfile("/usr/lib/systemd/systemd") and not os.path.isfile("/lib/systemd/systemd"):
        return "no systemd binary in the host's /usr to boot"
    if not os.access(CGROUP_ROOT, os.W_OK):
        return f"{CGROUP_ROOT} is not writable (cannot give the container its own cgroup)"
    return None


def unit_with(text: str, changes: Mapping[str, Optional[str]]) -> str:
    """`text` with each `Key=` line replaced by `changes[key]` (several lines allowed,
    None deletes it). Raises KeyError if a key is not in the unit."""
    out, seen = [], set()
    for line in text.splitlines():
        key = line.split("=", 1)[0].strip() if "=" in line and not line.startswith("#") else None
        if key in changes:
            if key not in seen and changes[key] is not None:
                out.append(changes[key])
            seen.add(key)
        else:
            out.append(line)
    missing = set(changes) - seen
    if missing:
        raise KeyError(f"unit has no {sorted(missing)} to replace")
    return "\n".join(out) + "\n"


class SystemdContainer:
    """systemd-nspawn --boot of the host's systemd; use as a context manager.

    binds: {host path: container path}, all read-only. Each container gets its own cgroup
    (named like the machine) and its own name, so runs do not collide."""

    def __init__(self, binds: Mapping[str, str], log_path: str, name: Optional[str] = None):
        self.binds = dict(binds)
        self.log_path = log_path                  # the container's console output
        self.name = name or f"kestrel-test-{os.getpid()}"
        self.nspawn: Optional[subprocess.Popen] = None
        self.leader: Optional[int] = None         # the container's systemd, host pid

    # ------------------------------------------------------------------ life cycle
    def boot(self, timeout: float = 60.0) -> None:
        """Start the container and wait until its systemd reports the boot finished."""
        groups = self._make_cgroups()
        notify_path = os.path.join(os.path.dirname(self.log_path), f"{self.name}.notify")
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(notify_path)
        argv = ["systemd-nspawn", "--quiet", "--register=no", "--keep-unit",
                "--console=read-only", "--notify-ready=yes", "-M", self.name, "-D", "/",
                "--volatile=yes"]
        argv += [f"--bind-ro={h}:{c}" for h, c in self.binds.items()]
        argv += ["--bind-ro=/dev/null:/etc/systemd/system/systemd-firstboot.service",
                 "--bind-ro=/dev/null:/etc/systemd/system/console-getty.service",
                 "--boot", "systemd.firstboot=off"]
        env = dict(os.environ, NOTIFY_SOCKET=notify_path)
        with open(self.log_path, "wb") as log:
            self.nspawn = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=subprocess.STDOUT, env=env,
                                           preexec_fn=lambda: _enter_cgroups(groups))
        try:
            # nspawn says READY=1 once the container's systemd finished booting.
            notify.settimeout(timeout)
            deadline = time.monotonic() + timeout
            while b"READY=1" not in notify.recv(4096).split(b"\n"):
                if time.monotonic() > deadline:
                    raise TimeoutError
        except (TimeoutError, socket.timeout):
            self.shutdown()
            raise RuntimeError(f"container {self.name} did not boot in {timeout} s; "
                               f"console: {self.console_tail()}") from None
        finally:
            notify.close()
            os.unlink(notify_path)
        self.leader = self._find_leader()

    def shutdown(self, timeout: float = 20.0) -> None:
        """Halt the container (SIGTERM to nspawn: a clean poweroff), then drop its cgroups."""
        if self.nspawn is not None and self.nspawn.poll() is None:
            self.nspawn.terminate()
            try:
                self.nspawn.wait(timeout)
            except subprocess.TimeoutExpired:
                self.nspawn.kill()
                self.nspawn.wait()
        for group in self._cgroup_dirs():
            for folder, _, _ in os.walk(group, topdown=False):
                try:
                    os.rmdir(folder)
                except OSError:
                    pass    # still populated by a straggler: leave it rather than fail teardown

    def __enter__(self) -> "SystemdContainer":
        self.boot()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ inside
    def run(self, argv: Sequence[str], check: bool = True, timeout: float = 60.0,
            **kw) -> subprocess.CompletedProcess:
        """Run a command in all of the container's namespaces; text output captured."""
        result = subprocess.run(["nsenter", "-t", str(self.leader), "-a", *argv], text=True,
                                capture_output=True, timeout=timeout, **kw)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {result.returncode}: "
                                 f"{result.stdout}{result.stderr}")
        return result

    def systemctl(self, *args: str, check: bool = True) -> str:
        """`systemctl ARGS` inside; its stdout. A failure says what the journal said last."""
        result = self.run(["systemctl", "--no-pager", *args], check=False)
        if check and result.returncode != 0:
            tail = self.run(["journalctl", "--no-pager", "-n", "25"], check=False).stdout
            raise AssertionError(f"systemctl {' '.join(args)} exited {result.returncode}: "
                                 f"{result.stdout}{result.stderr}\njournal:\n{tail}")
        return result.stdout

    def show(self, unit: str, *props: str) -> dict:
        """Unit properties as a dict of strings (`systemctl show -p ...`)."""
        out = self.systemctl("show", unit, *(f"-p{p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str) -> str:
        """The unit's journal since boot, plain text."""
        return self.run(["journalctl", "--no-pager", "-o", "cat", "-u", unit]).stdout

    def host_path(self, path: str) -> str:
        """Where a container path is seen from the host."""
        return f"/proc/{self.leader}/root{path}"

    def console_tail(self, lines: int = 30) -> str:
        """The end of the console log, for error messages."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no console log)"

    # ------------------------------------------------------------------ helpers
    def _find_leader(self) -> int:
        # The container's PID 1 is nspawn's only child (in a new pid namespace).
        with open(f"/proc/{self.nspawn.pid}/task/{self.nspawn.pid}/children") as f:
            children = f.read().split()
        if len(children) != 1:
            raise RuntimeError(f"expected one child of systemd-nspawn, got {children}")
        return int(children[0])

    def _cgroup_dirs(self) -> list[str]:
        hybrid = [os.path.join(CGROUP_ROOT, h) for h in ("systemd", "unified")
                  if os.path.isfile(os.path.join(CGROUP_ROOT, h, "cgroup.procs"))]
        return [os.path.join(h, self.name) for h in (hybrid or [CGROUP_ROOT])]

    def _make_cgroups(self) -> list[str]:
        groups = self._cgroup_dirs()
        for group in groups:
            os.makedirs(group, exist_ok=True)
        return groups


def _enter_cgroups(groups: list[str]) -> None:
    # Runs in the child before exec: move it (nspawn) into the container's own cgroups.
    for group in groups:
        with open(os.path.join(group, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
