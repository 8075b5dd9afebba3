#!/usr/bin/env bash
# System packages the test suite uses, installed only where missing (idempotent; run as root):
# - Debian's Chromium for tests/frontends/test_browser.py, which Playwright drives through executable_path
#   (never `playwright install`: no browser downloads; the Python side comes from the `dev` extra);
# - a C compiler for the compiled CPU decode-attention kernel (hf_contbatch/kernels/attention/cpu_decode.c is
#   built with `cc` on first use; without one the engine uses the plain-torch path).
# Where a package cannot be installed, its tests skip.
set -euo pipefail
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
command -v cc >/dev/null || command -v gcc >/dev/null || missing+=(gcc libc6-dev)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-system-packages: not root or no apt-get; tests needing ${missing[*]} will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
echo "install-system-packages: installed ${missing[*]}"
