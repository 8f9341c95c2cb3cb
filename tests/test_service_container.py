"""The units under a real systemd: one throw-away container (tests/container.py) for the
module, booted with the checkout bound read-only at its own path.

The service runs from a test copy of systemd/kestreld.service that differs only where it
must: ExecStart is this checkout's interpreter (`python -m kestreld`, PYTHONPATH = the
checkout), WatchdogSec=4 and RestartSec=1 so the failure tests are quick, and, when the
interpreter or checkout lives under /root, /home or /tmp, those folders bound back
read-only (BindReadOnlyPaths=, with ProtectHome=tmpfs for a home folder: ProtectHome=yes
and the PrivateTmp= implied by DynamicUser= would hide them). The config is the sample with the
model set to the Q8_0 SmolLM2 and a small arena. The instance templates (kestreld@.service,
kestreld@.socket, kestreld-http@.socket) are installed beside them, changed the same way,
with /etc/kestrel/chat.conf (SmolLM2) and /etc/kestrel/embed.conf (the generated Qwen3
embedding model, tests/modelgen_embed.py). The tests run in file order, each building on
the state the previous one left.
"""
from __future__ import annotations

import os
import re
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

import modelgen_embed
from container import SystemdContainer, unavailable_reason, unit_with
from daemon import START_TIMEOUT_S, model_path
from kestrelctl import Client, KestrelClientError

CHECKOUT = Path(__file__).resolve().parent.parent
UNITS = CHECKOUT / "systemd"
SOCKET = "/run/kestrel/kestreld.sock"
MODEL_IN_BOX = "/opt/kestrel-test/model.gguf"
EMBED_MODEL_IN_BOX = "/opt/kestrel-test/embed.gguf"
WATCHDOG_S = 4
MAX_SEQ = 2048
MAX_NEW_TOKENS = 1800           # the long request's cap (prompt + this < MAX_SEQ)
# Long enough for a prefix hit (>= 16 tokens); the follow-up extends it.
PROMPT = ("The kestrel is a small falcon that hovers over open fields, watching the grass "
          "for mice and beetles, then drops on its prey.")
FOLLOW_UP = PROMPT + " Where does the kestrel build its nest?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HTTP_PORT = _free_port()        # the container shares the host's loopback


def _bound_folders() -> list[str]:
    """Host folders the service needs: the checkout, its venv, the interpreter's install."""
    folders = {str(CHECKOUT), os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    folders = {f for f in folders if not f.startswith("/usr/") and f != "/usr"}
    return sorted(f for f in folders if not any(f.startswith(o + "/") for o in folders))


def _test_service(folders: list[str], unit: str = "kestreld.service",
                  config: str = "/etc/kestrel/kestreld.conf") -> str:
    changes = {
        "ExecStart": f"ExecStart={sys.executable} -m kestreld --config {config}",
        "Environment": f"Environment=PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH={CHECKOUT}",
        "WatchdogSec": f"WatchdogSec={WATCHDOG_S}",
        "RestartSec": "RestartSec=1",
    }
    # ProtectHome= and PrivateTmp= (implied by DynamicUser=) hide these from the service.
    hidden = [f for f in folders if f.startswith(("/root/", "/home/", "/tmp/", "/var/tmp/"))]
    if hidden:
        homes = any(f.startswith(("/root/", "/home/")) for f in hidden)
        changes["ProtectHome"] = (f"ProtectHome={'tmpfs' if homes else 'yes'}\n"
                                  f"BindReadOnlyPaths={' '.join(hidden)}")
    return unit_with((UNITS / unit).read_text(), changes)


def _test_config(model: str = MODEL_IN_BOX) -> str:
    text = (UNITS / "kestreld.conf.sample").read_text()
    for key, value in (("model", model), ("max-seq", str(MAX_SEQ)), ("threads", "1")):
        text, n = re.subn(rf"^{key} = .*$", f"{key} = {value}", text, flags=re.M)
        assert n == 1, f"sample config has no single `{key} =` line"
    return text


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        print(f"\nSKIP test_service_container: {reason}", file=sys.stderr)
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("box")
    folders = _bound_folders()
    embed_model = modelgen_embed.generate(tmp, ("q8_0",)).gguf["q8_0"]
    files = {
        "kestreld.service": _test_service(folders),
        "kestreld@.service": _test_service(folders, "kestreld@.service", "/etc/kestrel/%i.conf"),
        "chat.conf": _test_config(),
        "embed.conf": _test_config(EMBED_MODEL_IN_BOX),
        "kestreld-http.socket": unit_with((UNITS / "kestreld-http.socket").read_text(), {
            "ListenStream": f"ListenStream=127.0.0.1:{HTTP_PORT}"}),
        "kestreld.conf": _test_config(),
        # Presets would enable every unit with an [Install] section on this first boot.
        "preset": "".join(f"disable {unit}\n" for unit in (
            "kestreld.service", "kestreld.socket", "kestreld-http.socket", "kestreld@.service",
            "kestreld@.socket", "kestreld-http@.socket")),
        # Stands in for install-service.sh's `groupadd --system kestrel`.
        "sysusers.conf": "g kestrel -\n",
    }
    for name, text in files.items():
        (tmp / name).write_text(text)
    binds = {f: f for f in folders}
    binds.update({
        model_path(): MODEL_IN_BOX,
        str(tmp / "kestreld.service"): "/etc/systemd/system/kestreld.service",
        str(UNITS / "kestreld.socket"): "/etc/systemd/system/kestreld.socket",
        str(tmp / "kestreld-http.socket"): "/etc/systemd/system/kestreld-http.socket",
        str(tmp / "kestreld.conf"): "/etc/kestrel/kestreld.conf",
        str(embed_model): EMBED_MODEL_IN_BOX,
        str(tmp / "kestreld@.service"): "/etc/systemd/system/kestreld@.service",
        str(UNITS / "kestreld@.socket"): "/etc/systemd/system/kestreld@.socket",
        str(UNITS / "kestreld-http@.socket"): "/etc/systemd/system/kestreld-http@.socket",
        str(tmp / "chat.conf"): "/etc/kestrel/chat.conf",
        str(tmp / "embed.conf"): "/etc/kestrel/embed.conf",
        str(tmp / "preset"): "/etc/systemd/system-preset/00-test.preset",
        str(tmp / "sysusers.conf"): "/etc/sysusers.d/kestrel.conf",
    })
    with SystemdContainer(binds, str(tmp / "console.log")) as c:
        yield c


def _client(box: SystemdContainer, timeout: float = START_TIMEOUT_S) -> Client:
    return Client(box.host_path(SOCKET), timeout=timeout)


def _main_pid(box: SystemdContainer) -> int:
    return int(box.show("kestreld.service", "MainPID")["MainPID"])


def _wait_for(what: str, predicate, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def test_socket_activation_starts_the_daemon_on_first_request(box):
    box.systemctl("start", "kestreld.socket")
    assert box.show("kestreld.service", "ActiveState")["ActiveState"] == "inactive"
    assert box.run(["stat", "-c", "%a %U %G", SOCKET]).stdout.split() == ["660", "root", "kestrel"]
    assert box.run(["stat", "-c", "%a", "/run/kestrel"]).stdout.split() == ["755"]
    with _client(box) as kc:
        result = kc.generate(prompt=PROMPT, max_tokens=4)
        assert result.usage["completion_tokens"] == 4
        assert kc.ping()["pid"] == _main_pid(box)
    props = box.show("kestreld.service", "ActiveState", "SubState", "StatusText", "User")
    assert (props["ActiveState"], props["SubState"], props["User"]) == ("active", "running", "kestreld")
    assert props["StatusText"], "no STATUS= reached systemd"


def test_socket_access_is_for_group_kestrel(box):
    connect = [sys.executable, "-c", f"import socket; socket.socket(socket.AF_UNIX).connect({SOCKET!r})"]
    def as_nobody(group: str) -> list:
        return ["setpriv", "--reuid=65534", f"--regid={group}", "--clear-groups", *connect]
    denied = box.run(as_nobody("65534"), check=False)
    assert denied.returncode != 0 and "PermissionError" in denied.stderr, denied.stderr
    box.run(as_nobody("kestrel"))


def test_journal_has_inference_state_ready(box):
    journal = box.journal("kestreld.service")
    assert "inference state ready" in journal, journal[-2000:]


def test_restart_gives_a_new_pid_and_an_empty_cache(box):
    with _client(box, 60) as kc:
        before = kc.generate(prompt=FOLLOW_UP, max_tokens=4)
    assert before.usage["cached_tokens"] >= 16      # a hit on the first test's prompt
    old = _main_pid(box)
    box.systemctl("restart", "kestreld.service")     # returns once READY=1 came
    new = _main_pid(box)
    assert new not in (0, old)
    with _client(box, 60) as kc:
        assert kc.ping()["pid"] == new
        assert kc.status()["cache_len"] == 0
        after = kc.generate(prompt=FOLLOW_UP, max_tokens=4)
    assert after.usage["cached_tokens"] == 0
    assert after.ids == before.ids                  # greedy: a miss computes the same tokens


def test_sigkill_brings_an_automatic_restart(box):
    old = _main_pid(box)
    restarts = int(box.show("kestreld.service", "NRestarts")["NRestarts"])
    box.systemctl("kill", "--kill-who=main", "--signal=KILL", "kestreld.service")
    _wait_for("the restart after SIGKILL",
              lambda: int(box.show("kestreld.service", "NRestarts")["NRestarts"]) == restarts + 1,
              30)
    with _client(box) as kc:
        pid = kc.ping()["pid"]
    assert pid not in (0, old) and pid == _main_pid(box)
    assert "code=killed, status=9/KILL" in box.journal("kestreld.service")


def test_a_long_request_does_not_trip_the_watchdog(box):
    """The watchdog watches the event loop, not the engine: a request that keeps the engine
    thread busy for longer than WatchdogSec is served, and the daemon is not restarted."""
    before = box.show("kestreld.service", "NRestarts", "MainPID")
    # one token a pass: drafts from a long answer that repeats itself would outrun the rate
    # measured on a short one
    plain = dict(prompt=PROMPT, ignore_eos=True, speculate=False)
    with _client(box, 120) as kc:
        rate = kc.generate(max_tokens=16, **plain).timings["decode_tok_s"]
        n = min(MAX_NEW_TOKENS, int(rate * 2 * WATCHDOG_S) + 16)
        result = kc.generate(max_tokens=n, **plain)
    busy_s = (result.timings["prefill_ms"] + result.timings["decode_ms"]) / 1000
    print(f"long request: {n} tokens at {rate:.1f} tok/s, engine busy {busy_s:.1f} s")
    assert busy_s > WATCHDOG_S, f"{n} tokens took only {busy_s:.1f} s: proves nothing"
    assert result.usage["completion_tokens"] == n
    assert box.show("kestreld.service", "NRestarts", "MainPID") == before


def test_sigstop_trips_the_watchdog(box):
    props = box.show("kestreld.service", "NRestarts", "WatchdogUSec")
    assert props["WatchdogUSec"] == f"{WATCHDOG_S}s"
    restarts = int(props["NRestarts"])
    box.systemctl("kill", "--kill-who=main", "--signal=SIGSTOP", "kestreld.service")
    _wait_for("the watchdog restart",
              lambda: int(box.show("kestreld.service", "NRestarts")["NRestarts"]) == restarts + 1,
              WATCHDOG_S + 30)
    journal = box.journal("kestreld.service")
    assert "Watchdog timeout" in journal and "Failed with result 'watchdog'" in journal


def test_http_api_through_its_socket_unit(box):
    """kestreld-http.socket passes its TCP socket (FileDescriptorName=http) to the service,
    whose sandbox is unchanged (PrivateNetwork=yes, RestrictAddressFamilies=AF_UNIX,
    IPAddressDeny=any): /health and a chat answer on 127.0.0.1 through the unit."""
    box.systemctl("stop", "kestreld.service")      # systemd refuses a socket whose service runs
    box.systemctl("start", "kestreld-http.socket")
    box.systemctl("start", "kestreld.service")     # now started with both sockets
    url = f"http://127.0.0.1:{HTTP_PORT}"
    with httpx.Client(base_url=url, timeout=120) as http:
        assert http.get("/health").json() == {"status": "ok"}
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    with _client(box, 60) as kc:                       # the RPC socket as before
        assert kc.ping()["pid"] == _main_pid(box)
    assert "HTTP API listening on http://127.0.0.1" in box.journal("kestreld.service")


def test_a_chat_and_an_embedding_instance_side_by_side(box):
    """kestreld@chat (SmolLM2) and kestreld@embed (an embedding model): two processes, each
    with its own socket, arena and model, started by their own socket units; the embedding
    instance's HTTP API on its kestreld-http@embed.socket (a Unix socket)."""
    box.systemctl("start", "kestreld@chat.socket", "kestreld@embed.socket",
                  "kestreld-http@embed.socket")
    with Client(box.host_path("/run/kestrel/chat.sock"), timeout=START_TIMEOUT_S) as chat, \
            Client(box.host_path("/run/kestrel/embed.sock"), timeout=START_TIMEOUT_S) as embed:
        assert chat.generate(prompt=PROMPT, max_tokens=3).usage["completion_tokens"] == 3
        vector = embed.embed(PROMPT)["embeddings"][0]
        assert len(vector) == modelgen_embed.SPEC.hidden
        with pytest.raises(KestrelClientError) as refused:
            chat.embed(PROMPT)
        assert refused.value.code == "not_embedding_model"
        pids = (chat.ping()["pid"], embed.ping()["pid"])
    assert pids == (int(box.show("kestreld@chat.service", "MainPID")["MainPID"]),
                    int(box.show("kestreld@embed.service", "MainPID")["MainPID"]))
    assert len(set(pids) | {_main_pid(box)}) == 3      # and the plain kestreld.service
    transport = httpx.HTTPTransport(uds=box.host_path("/run/kestrel/embed.http.sock"))
    with httpx.Client(transport=transport, base_url="http://localhost", timeout=120) as http:
        r = http.post("/v1/embeddings", json={"input": PROMPT, "encoding_format": "float"})
    assert r.status_code == 200 and r.json()["data"][0]["embedding"] == vector, r.text
