#!/usr/bin/env bash
# Undo install-service.sh (run as root): stop and disable the units, remove them, the
# venv and models under /opt/kestrel, the kestrelctl link and the group `kestrel`.
# /etc/kestrel (your config) stays unless --purge.
set -euo pipefail

PURGE=no
case "${1:-}" in
  --purge) PURGE=yes ;;
  "") ;;
  *) echo "usage: $0 [--purge]" >&2; exit 2 ;;
esac
say() { echo "uninstall-service: $*"; }
[ "$(id -u)" = 0 ] || { echo "uninstall-service: run as root" >&2; exit 1; }

if [ -d /run/systemd/system ]; then
  systemctl disable --now kestreld-http.socket kestreld.socket kestreld.service 2>/dev/null || true
  # every instance (kestreld@NAME) that is loaded: its HTTP socket, socket and service
  for unit in $(systemctl list-units --all --plain --no-legend 'kestreld-http@*' 'kestreld@*' |
                awk '{print $1}'); do
    systemctl disable --now "$unit" 2>/dev/null || true
  done
fi
rm -f /etc/systemd/system/kestreld.service /etc/systemd/system/kestreld.socket \
      /etc/systemd/system/kestreld-http.socket /etc/systemd/system/kestreld@.service \
      /etc/systemd/system/kestreld@.socket /etc/systemd/system/kestreld-http@.socket
if [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  systemctl reset-failed kestreld.service kestreld.socket kestreld-http.socket 'kestreld@*' \
      'kestreld-http@*' 2>/dev/null || true
fi
say "removed the units"

if [ "$(readlink /usr/local/bin/kestrelctl)" = /opt/kestrel/venv/bin/kestrelctl ]; then
  rm -f /usr/local/bin/kestrelctl
  say "removed /usr/local/bin/kestrelctl"
fi
rm -rf /opt/kestrel
say "removed /opt/kestrel"

if getent group kestrel >/dev/null; then
  groupdel kestrel
  say "removed group kestrel"
fi

if [ "$PURGE" = yes ]; then
  rm -rf /etc/kestrel
  say "removed /etc/kestrel"
elif [ -d /etc/kestrel ]; then
  say "kept /etc/kestrel (use --purge to remove it)"
fi
