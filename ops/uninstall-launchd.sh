#!/usr/bin/env bash
# Stop and remove the launchd job that ops/install-launchd.sh installed. The worker gets its
# drain (launchd waits ExitTimeOut after SIGTERM). Logs, the working directory and the Redis URL
# file are kept; the paths are printed so they can be removed by hand.
set -euo pipefail

usage() {
    cat <<'USAGE'
usage: ops/uninstall-launchd.sh [--system] [--label LABEL] [--dry-run]

  --system        the LaunchDaemon in /Library/LaunchDaemons (needs root)
  --label LABEL   launchd label (default: com.mlx-redis-worker)
  --dry-run       print what would be done; changes nothing
  -h, --help      this text
USAGE
}

system=0 dry_run=0 label=com.mlx-redis-worker
while [ $# -gt 0 ]; do
    case "$1" in
        --system) system=1 ;;
        --label) label=$2; shift ;;
        --dry-run) dry_run=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "uninstall-launchd: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

die() { echo "uninstall-launchd: $*" >&2; exit 1; }

run() {
    if [ "$dry_run" = 1 ]; then
        printf '+'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}

[[ $label =~ ^[A-Za-z0-9][A-Za-z0-9.-]*$ ]] || die "--label must be a reverse-DNS style name"
if [ "$system" = 1 ]; then
    domain=system
    plist="/Library/LaunchDaemons/$label.plist"
else
    domain="gui/$(id -u)"
    plist="$HOME/Library/LaunchAgents/$label.plist"
fi
if [ "$dry_run" = 0 ]; then
    [ "$(uname -s)" = Darwin ] || die "launchd is macOS only (use --dry-run elsewhere)"
    if [ "$system" = 1 ] && [ "$(id -u)" != 0 ]; then die "--system needs root (sudo)"; fi
fi

if [ "$dry_run" = 1 ] || launchctl print "$domain/$label" >/dev/null 2>&1; then
    run launchctl bootout "$domain/$label"
else
    echo "$domain/$label is not loaded"
fi
if [ "$dry_run" = 1 ] || [ -e "$plist" ]; then
    run rm -f "$plist"
fi
echo "removed $label ($domain); logs, working directory and the Redis URL file are kept"
