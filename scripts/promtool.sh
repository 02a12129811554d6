#!/usr/bin/env bash
# promtool, for the chart's alert-rule tests (`promtool check rules`, `promtool test rules`):
# taken from Debian's prometheus package (no binary can be downloaded here), extracted from
# the .deb into the cache; nothing is installed system-wide and no service is started.
#
#   scripts/promtool.sh        fetch once into the cache, print promtool's path
#
# Needs apt-get (run as root on the development and CI machines, for `apt-get update`
# when the package lists are missing). Cached in ${HYPERPOD_SDC_CACHE:-~/.cache/hyperpod-sdc}.
set -euo pipefail

CACHE="${HYPERPOD_SDC_CACHE:-$HOME/.cache/hyperpod-sdc}"
BIN="$CACHE/promtool/promtool"

log() { echo "promtool.sh: $*" >&2; }

if [[ -x $BIN ]]; then
    echo "$BIN"
    exit 0
fi
command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || {
    log "needs apt-get and dpkg-deb (a Debian or Ubuntu machine)"
    exit 3
}
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
download() { (cd "$work" && apt-get download -qq prometheus >/dev/null 2>&1); }
if ! download; then
    log "package lists missing or stale: apt-get update"
    apt-get update -qq >/dev/null
    download || { log "apt-get download prometheus failed"; exit 1; }
fi
dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
mkdir -p "$(dirname "$BIN")"
cp "$work/root/usr/bin/promtool" "$BIN.tmp"
"$BIN.tmp" --version >/dev/null
mv "$BIN.tmp" "$BIN"
log "$("$BIN" --version 2>&1 | head -n1) in $BIN"
echo "$BIN"
