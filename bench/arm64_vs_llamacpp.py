"""Kestrel vs llama.cpp as an A76 runs them, by the work: aarch64 instructions per token.

    .venv/bin/python bench/arm64_vs_llamacpp.py
    .venv/bin/python bench/arm64_vs_llamacpp.py --models smollm2:Q4_0 --prefill 32 --decode 4

No RK3588 here, so this counts instead of timing. Both engines run as aarch64 under qemu-user
(`-cpu cortex-a76`) on the same GGUF, one thread each, in one process per engine and model:
Kestrel's A76 build (`sdot`, 4-row interleaved weights) and llama.cpp built from
llama-cpp-python's own source for armv8.2-a+dotprod+fp16 (what `GGML_NATIVE` gives on an
RK3588's A76 cores), its repacking on (on a dotprod CPU it repacks Q4_0 to 4x4 and the K types
to 8x4 groups). A qemu plugin (bench/qemu_insn_marks.c) counts the guest's instructions; the
guest marks load, a cold prefill of P tokens, and D decode steps apart with getppid() (an MoE
file is first warmed up with two prefills of 512 tokens, as Kestrel copies each expert when it
is first chosen). Reported:
instructions per prefill token and per decode step, all and SIMD / floating-point data
processing apart, and llama.cpp's count over Kestrel's (above 1: Kestrel does less work).
Everything a token costs is in it: Python orchestration, sampling, attention, the products.

Then, for speculation (bench/speculate.py), Kestrel's k-cost curve on the A76's sdot tiles:
the instructions of one forward pass over k = 1, 2, 4, 8, 16 tokens with every row's logits,
after 200 tokens (as bench/speculate.py's curve), relative to k = 1 (`--ks`; "" skips it, `--k-cost-only` skips the
comparison). A pass that verifies k drafted tokens pays off when it costs less than the
tokens it is expected to yield; by instructions, not by time (decode on a board is DRAM-bound,
so a k-token pass costs at least one token's time).

What it says of speed: prefill on an A76 is bound by its two SIMD pipes, so its time follows
these counts roughly (not exactly: instructions differ in cost, and cache misses are not
counted). Decode on 4 A76 cores is bound by DRAM for both engines, so a lower count there is
headroom, not speed. On a board, bench/README.md's "On an RK3588" times the real thing.

Needs `make test-arm64`'s arm64 root and the kernels built for it (`scripts/arm64-env.sh build`;
`make bench-arm64` does both, then runs this). Made once into $KESTREL_ARM64_CACHE/bench
(default ~/.cache/kestrel-arm64/bench): Debian's dynamic qemu-user (which loads plugins; the
static one the tests use cannot), the plugin, and llama.cpp cross-compiled (about 10 minutes on
2 cores; g++-aarch64-linux-gnu and cmake are installed if missing).

    .venv/bin/python bench/arm64_vs_llamacpp.py --count PROGRAM [ARGS...]

runs any aarch64 program under the same counting qemu and prints "ALL SIMD": what it executed
(bench/arm64_insns.sh counts single products so).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, REPO)
sys.path.insert(1, os.path.join(REPO, "bench"))

A76_ARCH = "armv8.2-a+dotprod+fp16"
PYPI = "https://pypi.org/simple"
DEFAULT_MODELS = "smollm2:Q4_0,smollm2:Q4_K_M,qwen3-0.6b:Q4_0,qwen3-0.6b:Q4_K_M,qwen3moe:Q4_K_M"
GUEST_VENV = "/opt/kestrel-venv/lib/python3.11/site-packages"   # scripts/arm64-env.sh's venv


def cache_dir() -> str:
    base = os.environ.get("KESTREL_ARM64_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kestrel-arm64")
    return os.path.join(base, "bench")


def arm64_root() -> str:
    roots = glob.glob(os.path.join(os.path.dirname(cache_dir()), "root-*"))
    if not roots:
        raise SystemExit("arm64_vs_llamacpp: no arm64 root (run make test-arm64 first)")
    return roots[0]


def run(cmd: list, log: str, **kw) -> None:
    """cmd with its output in log; on failure, the log's tail and exit."""
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    if rc:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"arm64_vs_llamacpp: {' '.join(cmd[:3])}... failed ({rc}):\n{tail}")


def qemu_user(work: str) -> tuple:
    """Debian's dynamic qemu-aarch64 and its library dir, unpacked from the packages."""
    dest = os.path.join(work, "qemu-user")
    binary = os.path.join(dest, "usr/bin/qemu-aarch64")
    libdir = os.path.join(dest, "usr/lib/x86_64-linux-gnu")
    if not os.path.exists(binary):
        debs = tempfile.mkdtemp(dir=work)
        run(["apt-get", "download", "qemu-user", "libcapstone4", "liburing2"],
            os.path.join(work, "apt.log"), cwd=debs)
        for deb in glob.glob(os.path.join(debs, "*.deb")):
            run(["dpkg-deb", "-x", deb, dest], os.path.join(work, "dpkg.log"))
        shutil.rmtree(debs)
    return binary, libdir


def plugin(work: str) -> str:
    src = os.path.join(REPO, "bench", "qemu_insn_marks.c")
    out = os.path.join(work, "insn_marks.so")
    if not os.path.exists(out) or os.path.getmtime(out) < os.path.getmtime(src):
        run(["gcc", "-shared", "-fPIC", "-O2", "-o", out, src], os.path.join(work, "plugin.log"))
    return out


def pypi_file(project: str, suffix: str, dest: str) -> str:
    """The file of project whose name ends with suffix, from PyPI's simple index (sha256
    checked)."""
    with urllib.request.urlopen(f"{PYPI}/{project}/") as r:
        page = r.read().decode()
    found = [m for m in re.findall(r'href="([^"]+)"', page) if m.split("#")[0].endswith(suffix)]
    if not found:
        raise SystemExit(f"arm64_vs_llamacpp: no {suffix} of {project} on {PYPI}")
    url, _, digest = found[-1].partition("#sha256=")
    path = os.path.join(dest, os.path.basename(url.split("#")[0]))
    with urllib.request.urlopen(url) as r:
        data = r.read()
    if digest and hashlib.sha256(data).hexdigest() != digest:
        raise SystemExit(f"arm64_vs_llamacpp: {url}: sha256 mismatch")
    with open(path, "wb") as f:
        f.write(data)
    return path


def llama_cpp_a76(work: str, version: str) -> tuple:
    """llama-cpp-python `version`'s Python package dir and its libraries cross-built for the
    A76 (repacking on, as its default build on the board)."""
    top = os.path.join(work, f"llama-cpp-python-{version}-{A76_ARCH}")
    libs, pydir = os.path.join(top, "build", "bin"), os.path.join(top, "python")
    if os.path.exists(os.path.join(libs, "libllama.so")):
        return pydir, libs
    os.makedirs(top, exist_ok=True)
    sdist = pypi_file("llama-cpp-python", f"-{version}.tar.gz", top)
    with tarfile.open(sdist) as t:
        t.extractall(top, filter="data")
    src = os.path.join(top, f"llama_cpp_python-{version}")
    os.makedirs(pydir, exist_ok=True)
    shutil.copytree(os.path.join(src, "llama_cpp"), os.path.join(pydir, "llama_cpp"),
                    dirs_exist_ok=True)
    # llama_cpp imports diskcache (pure Python), which the test venv does not have
    with zipfile.ZipFile(pypi_file("diskcache", "-py3-none-any.whl", top)) as z:
        z.extractall(pydir)
    if not shutil.which("aarch64-linux-gnu-g++"):
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends",
             "g++-aarch64-linux-gnu"], os.path.join(top, "apt.log"))
    if not shutil.which("cmake"):
        run([sys.executable, "-m", "pip", "install", "-q", "cmake"], os.path.join(top, "pip.log"))
    build = os.path.join(top, "build")
    run(["cmake", "-S", os.path.join(src, "vendor", "llama.cpp"), "-B", build,
         "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
         "-DCMAKE_C_COMPILER=aarch64-linux-gnu-gcc", "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++",
         "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF",
         f"-DGGML_CPU_ARM_ARCH={A76_ARCH}", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TOOLS=OFF"],
        os.path.join(top, "cmake.log"))
    run(["cmake", "--build", build, "-j", str(os.cpu_count() or 2), "--target", "llama"],
        os.path.join(top, "build.log"))
    return pydir, libs


# ---------------------------------------------------------------- the guest side


def mark() -> None:
    """Tell the plugin to write its count (bench/qemu_insn_marks.c)."""
    os.getppid()


# An MoE file's warm-up prefills (two, in both engines): Kestrel copies each expert into
# interleaved groups when it is first chosen, and the counts are of the work after that.
MOE_WARMUP_PROMPT = 512


def guest(engine: str, path: str, prefill: int, decode: int, depth: int) -> None:
    """Load, warm up, then a cold prefill of `prefill` tokens, a cold prefill of `depth`, and
    `depth` tokens + `decode` steps, each between marks. One thread."""
    import numpy as np
    from vs_llamacpp import KestrelRunner, LlamaCppRunner, random_prompt
    if engine == "kestrel":
        from kestreld.kernels import K
        runner = KestrelRunner(path, threads=1, max_seq=max(1024, 2 * (prefill + depth)))
        print(f"kestrel: {K.__name__}, Q4_0 interleave {K.interleaves(2)}", flush=True)
    else:
        runner = LlamaCppRunner(path, threads=1, n_ctx=max(1024, 2 * (prefill + depth)),
                                n_batch=512, flash_attn=True, extra_buffer_types=True)
    rng = np.random.default_rng(0)
    for _ in range(2 if runner.moe else 0):     # Kestrel copies each expert when first chosen
        runner.prefill(random_prompt(rng, MOE_WARMUP_PROMPT, runner.vocab))
    runner.decode(random_prompt(rng, 16, runner.vocab), 2)    # warm-up
    mark()
    runner.prefill(random_prompt(rng, prefill, runner.vocab))
    mark()
    runner.prefill(random_prompt(rng, depth, runner.vocab))
    mark()
    runner.decode(random_prompt(rng, depth, runner.vocab), decode + 1)
    mark()
    if os.environ.get("KESTREL_GUEST_MAPS"):     # for --profile: where the libraries lie
        shutil.copyfile("/proc/self/maps", os.environ["KESTREL_GUEST_MAPS"])


K_COST_DEPTH = 200      # the context before the k-cost passes, as bench/speculate.py's


def guest_k_cost(path: str, depth: int, ks: list) -> None:
    """Kestrel only: after `depth` tokens, one forward pass over each k of ks tokens (every
    row's logits, as speculation verifies a draft), each between marks. One thread."""
    import numpy as np
    from kestreld.engine.generate import Engine
    from kestreld.model.load import load_model
    model = load_model(path)
    engine = Engine(model, max_seq=depth + max(ks) + 8, threads=1)
    rng = np.random.default_rng(0)
    ids = rng.integers(256, min(model.config.vocab, 49152), depth + max(ks)).tolist()
    out = np.empty((max(ks), model.config.vocab), np.float32)
    engine.forward_logits(ids[:depth], 0)
    for k in [ks[0]] + ks:                  # the first pass again: a warm-up
        engine.kv.truncate(depth)
        mark()
        engine.forward(ids[depth:depth + k], logits_out=out[:k])
    mark()


# ---------------------------------------------------------------- the host side


def counting_qemu(qemu: str, qemu_libs: str, plugin_args: str, **env) -> tuple:
    """(command prefix, environment) that run an aarch64 program as an A76 under qemu with the
    counting plugin (plugin_args: its path and options); env: more for the guest."""
    return ([qemu, "-U", "LD_LIBRARY_PATH", "-cpu", "cortex-a76", "-plugin", plugin_args],
            dict(os.environ, LD_LIBRARY_PATH=qemu_libs, **env))   # qemu's own libraries


def count(engine: str, path: str, args, tools: dict) -> dict:
    """Instructions per prefill token and per decode step of one engine on one file, all and
    SIMD ("prefill", "prefill SIMD", ...); with args.profile, also "profile" (profile's) of the
    measured work."""
    marked, prof = run_marked(engine, path, args, tools, 4)
    out = {}
    for col, kind in enumerate(("", " SIMD")):
        m = [int(fields[col]) for fields in marked]
        out["prefill" + kind] = (m[1] - m[0]) / args.prefill
        out["decode" + kind] = ((m[3] - m[2]) - (m[2] - m[1])) / args.decode
    if prof is not None:
        out["profile"] = prof
    return out


def k_cost(path: str, args, tools: dict) -> dict:
    """k -> instructions of Kestrel's pass over k tokens (guest_k_cost)."""
    ks = parse_ks(args.ks)
    marked, _ = run_marked("k-cost", path, args, tools, len(ks) + 2)
    m = [int(fields[0]) for fields in marked]
    return {k: m[i + 2] - m[i + 1] for i, k in enumerate(ks)}


def parse_ks(text: str) -> list:
    return [int(k) for k in text.split(",") if k]


def run_marked(engine: str, path: str, args, tools: dict, n_marks: int) -> tuple:
    """(the plugin's n_marks counts [all, SIMD] at the guest's marks, profile's list or None):
    the guest `engine` on one file under the counting qemu."""
    root = tools["root"]
    with tempfile.TemporaryDirectory(dir=tools["work"]) as tmp:
        marks, blocks, maps = (os.path.join(tmp, n) for n in ("marks", "blocks", "maps"))
        plugin_args = f"{tools['plugin']},out={marks}"
        llama = [tools["llama_py"]] if "llama_py" in tools else []    # built for the comparison
        guest_env = {"PYTHONPATH": os.pathsep.join(
                         [GUEST_VENV, *llama, REPO, os.path.join(REPO, "bench")]),
                     "LLAMA_CPP_LIB_PATH": tools.get("llama_libs", ""), "OMP_NUM_THREADS": "1"}
        if args.profile:
            plugin_args += f",blocks={blocks}"
            guest_env["KESTREL_GUEST_MAPS"] = maps
        prefix, env = counting_qemu(tools["qemu"], tools["qemu_libs"], plugin_args, **guest_env)
        cmd = prefix + ["-L", root, os.path.join(root, "usr/bin/python3.11"),
                        os.path.abspath(__file__), "--guest", engine, "--model", path,
                        "--prefill", str(args.prefill), "--decode", str(args.decode),
                        "--depth", str(args.depth), "--ks", args.ks]
        run(cmd, os.path.join(tools["work"], f"guest-{engine}.log"), env=env)
        marked = [line.split() for line in open(marks)][:-1]     # the last: at exit
        if len(marked) != n_marks:
            raise SystemExit(f"arm64_vs_llamacpp: {engine}: {len(marked)} marks, expected "
                             f"{n_marks}")
        return marked, profile(blocks, maps, root) if args.profile else None


def profile(blocks: str, maps: str, root: str) -> list:
    """[(instructions, SIMD instructions, "symbol (file)")], most first: the plugin's blocks by
    the function of the guest's mapped files (aarch64-linux-gnu-nm's symbols) that holds each."""
    import bisect
    spans = []                                   # (start, end, file offset, path) executable
    for line in open(maps):
        f = line.split()
        if len(f) >= 6 and "x" in f[1]:
            lo, hi = (int(a, 16) for a in f[0].split("-"))
            spans.append((lo, hi, int(f[2], 16), f[5]))
    spans.sort()
    symbols = {}

    def symbols_of(path: str) -> tuple:
        if path not in symbols:
            host = root + path if os.path.exists(root + path) else path
            nm = subprocess.run(["aarch64-linux-gnu-nm", "--defined-only", "-n", host],
                                capture_output=True, text=True).stdout.split("\n")
            rows = [(int(r[0], 16), r[2]) for r in (x.split() for x in nm)
                    if len(r) == 3 and r[1] in "tTwW"]
            symbols[path] = ([a for a, _ in rows], [n for _, n in rows])
        return symbols[path]

    total = {}
    for line in open(blocks):
        addr_hex, n, n_simd = line.split()
        addr = int(addr_hex, 16)
        i = bisect.bisect_right(spans, (addr, float("inf"))) - 1
        name = "?"
        if i >= 0 and spans[i][0] <= addr < spans[i][1]:
            lo, _, off, path = spans[i]
            addrs, names = symbols_of(path)
            j = bisect.bisect_right(addrs, addr - lo + off) - 1
            name = f"{names[j] if j >= 0 else '?'} ({os.path.basename(path)})"
        done = total.get(name, (0, 0))
        total[name] = (done[0] + int(n), done[1] + int(n_simd))
    return sorted(((n, v, s) for s, (n, v) in total.items()), reverse=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS,
                   help=f"as bench/vs_llamacpp.py's (default {DEFAULT_MODELS})")
    p.add_argument("--prefill", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--decode", type=int, default=8, help="decode steps (default 8)")
    p.add_argument("--depth", type=int, default=16,
                   help="the context the decode steps follow, in tokens (default 16)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print each engine's N functions that execute most (prefill and "
                        "decode together)")
    p.add_argument("--count", nargs=argparse.REMAINDER, metavar="PROGRAM",
                   help="only run the aarch64 PROGRAM [ARGS...] under the counting qemu and "
                        "print the instructions it executed: all, SIMD (bench/arm64_insns.sh)")
    p.add_argument("--ks", default="1,2,4,8,16",
                   help="the k-cost curve's pass sizes (default 1,2,4,8,16; \"\": none)")
    p.add_argument("--k-cost-only", action="store_true",
                   help="only Kestrel's k-cost curve, not the comparison with llama.cpp")
    p.add_argument("--guest", choices=["kestrel", "llama.cpp", "k-cost"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def count_program(cmd: list) -> str:
    """"ALL SIMD": the instructions the aarch64 program cmd executes, as an A76 (-cpu
    cortex-a76), by the plugin's count at its exit."""
    work = cache_dir()
    os.makedirs(work, exist_ok=True)
    qemu, qemu_libs = qemu_user(work)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        out = os.path.join(tmp, "counts")
        prefix, env = counting_qemu(qemu, qemu_libs, f"{plugin(work)},out={out}")
        subprocess.run(prefix + cmd, env=env, check=True,
                       stdout=sys.stderr)      # stdout: the counts alone
        return open(out).read().splitlines()[-1]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.count:
        print(count_program(args.count))
        return 0
    if args.guest == "k-cost":
        guest_k_cost(args.model, K_COST_DEPTH, parse_ks(args.ks))
        return 0
    if args.guest:
        guest(args.guest, args.model, args.prefill, args.decode, args.depth)
        return 0
    from vs_llamacpp import LLAMA_CPP_VERSION, model_path
    from kestreld.service.config import default_cache_dir
    work = cache_dir()
    os.makedirs(work, exist_ok=True)
    qemu, qemu_libs = qemu_user(work)
    tools = {"root": arm64_root(), "work": work, "qemu": qemu, "qemu_libs": qemu_libs,
             "plugin": plugin(work)}
    paths = [(spec, model_path(spec, default_cache_dir(os.environ)))
             for spec in args.models.split(",")]
    if not args.k_cost_only:
        tools["llama_py"], tools["llama_libs"] = llama_cpp_a76(work, LLAMA_CPP_VERSION)
        compare(paths, args, tools, LLAMA_CPP_VERSION)
    ks = parse_ks(args.ks)
    if ks:
        print(f"\nKestrel's pass over k tokens (every row's logits) after {K_COST_DEPTH} tokens, "
              f"in instructions, relative to k = {ks[0]} (millions for k = {ks[0]})")
        print("| model | " + " | ".join(f"k={k}" for k in ks) + " |")
        print("|---|" + "---:|" * len(ks))
        for spec, path in paths:
            c = k_cost(path, args, tools)
            print(f"| {spec} | {c[ks[0]] / 1e6:.0f} | "
                  + " | ".join(f"{c[k] / c[ks[0]]:.2f}" for k in ks[1:]) + " |", flush=True)
    return 0


def compare(paths: list, args, tools: dict, version: str) -> None:
    """The table of both engines' instructions per prefill token and decode step."""
    print(f"aarch64 instructions per token under qemu -cpu cortex-a76, 1 thread; prefill of "
          f"{args.prefill} tokens (cold), decode: {args.decode} steps after {args.depth} tokens; "
          f"llama.cpp {version} built for {A76_ARCH}, repacking on")
    print("Millions of instructions per token, all / SIMD and FP data processing only; the "
          "ratio is llama.cpp's over Kestrel's (above 1: Kestrel does less)")
    print("| model | case | Kestrel | llama.cpp | ratio: all | ratio: SIMD |")
    print("|---|---|---:|---:|---:|---:|")
    for spec, path in paths:
        k = count("kestrel", path, args, tools)
        l = count("llama.cpp", path, args, tools)
        for case in ("prefill", "decode"):
            simd = case + " SIMD"
            print(f"| {spec} | {case} | {k[case] / 1e6:.1f} / {k[simd] / 1e6:.1f} | "
                  f"{l[case] / 1e6:.1f} / {l[simd] / 1e6:.1f} | {l[case] / k[case]:.2f} | "
                  f"{l[simd] / k[simd]:.2f} |", flush=True)
        for name, r in (("Kestrel", k), ("llama.cpp", l)):
            if args.profile:
                done = sum(n for n, _, _ in r["profile"])
                done_simd = sum(v for _, v, _ in r["profile"])
                print(f"  {name}, {spec}: {done / 1e9:.2f} G instructions measured, "
                      f"{done_simd / 1e9:.2f} G SIMD; the top functions' shares of each:")
                for n, v, sym in r["profile"][:args.profile]:
                    print(f"    {100 * n / done:5.1f}% {100 * v / done_simd:5.1f}%  {sym}")


if __name__ == "__main__":
    sys.exit(main())
