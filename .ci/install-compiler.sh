#!/usr/bin/env bash
# A C compiler for the compiled CPU decode-attention kernel (hf_contbatch/attention/cpu_decode.c is
# built with `cc` on first use; tests/test_cpu_kernel.py checks it against the reference). Without
# one the engine uses the plain-torch path and those kernel tests skip. Idempotent; run as root.
set -euo pipefail
if command -v cc >/dev/null || command -v gcc >/dev/null; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  echo "install-compiler: not root or no apt-get; the CPU kernel tests will skip (no C compiler)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq gcc libc6-dev >/dev/null
echo "install-compiler: $(gcc --version | head -n 1)"
