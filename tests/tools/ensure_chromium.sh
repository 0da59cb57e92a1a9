#!/usr/bin/env bash
# Print the path of a headless-capable Chromium, installing Debian's `chromium`
# (and `chromium-driver`) with apt-get when it is missing and we are root.
#
#   tests/tools/ensure_chromium.sh            -> /usr/bin/chromium on stdout, exit 0
#
# Exit 3 with the reason on stderr when it cannot be had (not root, no apt-get,
# the install failed): the status-page test skips with that reason.
# SLUICE_CHROMIUM=/path/to/chromium uses that binary and installs nothing.
set -u

found() {
    if [ -n "${SLUICE_CHROMIUM:-}" ]; then
        [ -x "$SLUICE_CHROMIUM" ] && { echo "$SLUICE_CHROMIUM"; return 0; }
        return 1
    fi
    for name in chromium chromium-browser; do
        if command -v "$name" >/dev/null 2>&1; then command -v "$name"; return 0; fi
    done
    return 1
}

if found; then exit 0; fi
if [ -n "${SLUICE_CHROMIUM:-}" ]; then
    echo "SLUICE_CHROMIUM=$SLUICE_CHROMIUM is not an executable file" >&2
    exit 3
fi
if [ "$(id -u)" != 0 ]; then
    echo "no chromium on PATH, and not root to apt-get install it (apt-get install -y chromium chromium-driver)" >&2
    exit 3
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "no chromium on PATH, and no apt-get to install it" >&2
    exit 3
fi

log=$(mktemp)
echo "installing Debian's chromium (apt-get; log in $log)" >&2
export DEBIAN_FRONTEND=noninteractive
# The package lists may be missing or old on a fresh machine: update first.
if ! apt-get update -q >"$log" 2>&1 \
   || ! apt-get install -y -q --no-install-recommends chromium chromium-driver fonts-dejavu-core >>"$log" 2>&1; then
    echo "apt-get install chromium failed: $(tail -n 3 "$log" | tr '\n' ' ')" >&2
    exit 3
fi
if found; then exit 0; fi
echo "apt-get installed chromium but no chromium is on PATH" >&2
exit 3
