#!/usr/bin/env bash
# Makes sure Debian's Chromium is at /usr/bin/chromium for the browser tests.
# Installs it with apt-get when missing and this runs as root; otherwise says
# so and leaves it (the browser tests then skip, or fail when CI=true).
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "Installing Debian's chromium for the browser tests..."
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends chromium >/dev/null
else
  echo "No /usr/bin/chromium and no root apt-get: the browser tests will not run." >&2
fi
