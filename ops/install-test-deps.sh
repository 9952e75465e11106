#!/usr/bin/env bash
# System packages only the tests need on Linux: Chromium, the headless browser that the status
# page's test drives (through Playwright, which is told to use it and never downloads its own).
# Installed with apt when missing; elsewhere, install Chromium or Chrome yourself and point
# $CHROMIUM at it if it is not on the PATH.
set -euo pipefail

[ "$(uname -s)" = "Linux" ] || exit 0
[ -n "${CHROMIUM:-}" ] && exit 0
command -v chromium >/dev/null 2>&1 && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "warning: please install chromium with your package manager (the status page test needs it)" >&2
    exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "installing chromium" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
