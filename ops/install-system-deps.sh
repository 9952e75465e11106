#!/usr/bin/env bash
# System packages the worker needs on Linux: OpenBLAS (MLX's fast CPU matmuls) and redis-server
# (integration tests and the demo). Installed with apt when missing; macOS needs neither.
set -euo pipefail

[ "$(uname -s)" = "Linux" ] || exit 0

missing=()
ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1 || missing+=(libopenblas0-pthread)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ ${#missing[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "warning: please install ${missing[*]} with your package manager" >&2
    exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "installing ${missing[*]}" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
