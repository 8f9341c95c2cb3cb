"""big.LITTLE: the big cores come from cpu*/cpu_capacity (a fake /sys/devices/system/cpu tree
here, shaped like an RK3588's: 4x Cortex-A55 at capacity 414, cpu0-3, and 4x Cortex-A76 at
1024, cpu4-7), the default thread count is their number, and a daemon started without
--threads pins itself, its OpenMP workers included, to them and still answers right."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from daemon import Daemon
from kestreld.service.config import Config, performance_cores

pytestmark = pytest.mark.arm64

LITTLE, BIG = 414, 1024
RK3588 = {cpu: LITTLE if cpu < 4 else BIG for cpu in range(8)}
GOLDEN = json.loads((Path(__file__).parent / "golden" / "smollm2_llamacpp.json").read_text())


def cpu_tree(root: Path, capacities: dict[int, int]) -> str:
    """A /sys/devices/system/cpu-like tree: cpuN/cpu_capacity for each (N, capacity)."""
    for cpu, cap in capacities.items():
        (root / f"cpu{cpu}").mkdir(parents=True)
        (root / f"cpu{cpu}" / "cpu_capacity").write_text(f"{cap}\n")
    (root / "cpufreq").mkdir()                       # not a cpuN entry: ignored
    return str(root)


def test_performance_cores_are_the_rk3588_big_cores(tmp_path):
    sysfs = cpu_tree(tmp_path / "cpu", RK3588)
    assert performance_cores(range(8), sysfs) == [4, 5, 6, 7]      # 4 threads by default
    assert performance_cores([0, 1, 5], sysfs) == [5]
    assert performance_cores([0, 1], sysfs) == [0, 1]              # only little ones allowed
    assert performance_cores([0, 1], str(tmp_path / "none")) == [0, 1]   # no capacities


def test_default_threads_are_the_performance_cores(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    sysfs = cpu_tree(tmp_path / "cpu", {c: BIG if c == allowed[-1] else LITTLE for c in allowed})
    assert Config(cpu_sysfs=sysfs).n_threads == 1
    assert Config(cpu_sysfs=sysfs, threads=3).n_threads == 3
    assert Config(cpu_sysfs=str(tmp_path / "none")).n_threads == len(allowed)


def _cpus_allowed(pid: int, task: str) -> list[int]:
    """The CPUs a thread of `pid` may run on, from /proc (Cpus_allowed_list: "4-7", "1,3")."""
    for line in Path(f"/proc/{pid}/task/{task}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            cpus = []
            for part in line.split(":", 1)[1].strip().split(","):
                lo, _, hi = part.partition("-")
                cpus += range(int(lo), int(hi or lo) + 1)
            return cpus
    raise AssertionError(f"no Cpus_allowed_list for task {task} of {pid}")


def test_daemon_without_threads_pins_itself_to_the_big_cores(tmp_path):
    # The RK3588's shape laid over the CPUs this machine has: the first half little, the rest
    # big (on an 8-CPU machine exactly cpu0-3 / cpu4-7; on 2 CPUs, cpu0 / cpu1).
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one CPU: no big core to tell from a little one")
    little, big = allowed[: len(allowed) // 2], allowed[len(allowed) // 2:]
    sysfs = cpu_tree(tmp_path / "cpu", {**{c: LITTLE for c in little}, **{c: BIG for c in big}})
    conf = tmp_path / "kestreld.conf"
    conf.write_text(f"cpu-sysfs = {sysfs}\n")
    case = GOLDEN["continuations"][0]
    messages = [{"role": "system", "content": GOLDEN["system"]},
                {"role": "user", "content": case["user"]}]
    # --threads 0 (the default: performance cores) overrides the harness's --threads 1
    with Daemon(tmp_path / "k.sock", "--config", str(conf), "--threads", "0") as d:
        with d.client() as c:
            assert c.status()["threads"] == len(big)
            r = c.chat(messages, max_tokens=16, temperature=0.0)
        tasks = os.listdir(f"/proc/{d.pid}/task")
        assert len(tasks) >= len(big)                 # the OpenMP team has started
        assert {t: _cpus_allowed(d.pid, t) for t in tasks} == {t: big for t in tasks}
        assert f"pinned to performance cores {','.join(map(str, big))}" in d.log()
    # and the daemon, over its socket, still answers as llama.cpp does
    assert r.ids == case["generated_ids"][:16]
