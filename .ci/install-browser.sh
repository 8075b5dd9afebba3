#!/usr/bin/env bash
# System packages for tests/test_browser.py: Debian's Chromium, which Playwright drives through
# executable_path (never `playwright install`: no browser downloads). Idempotent; run as root.
# The Python side (playwright, jupyterlab) comes from the `dev` extra in pyproject.toml.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-browser: not root or no apt-get; tests/test_browser.py will skip (no /usr/bin/chromium)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq chromium >/dev/null
echo "install-browser: chromium $(dpkg-query -W -f='${Version}' chromium) installed"
