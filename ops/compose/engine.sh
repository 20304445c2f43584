# shellcheck shell=bash
# The container engine, base images and torch index of ./ops/compose-test (sourced after
# ops/lib.sh, not executed).
#
# Everything here is for the test only: a private dockerd whose data root is a cache of this
# machine, stand-ins for the registry images the Dockerfiles and compose name, made from Debian
# packages when no registry answers, and a local PEP 503 index of the CPU torch wheel when the
# PyTorch index cannot be reached. The Dockerfiles and compose files stay as users run them.

COMPOSE_CACHE="${SLUICE_COMPOSE_CACHE:-/var/cache/sluice-compose}"
DEBIAN_MIRROR="${SLUICE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
STANDIN_LABEL="org.sluice.compose-test.standin"
ENGINE_PID=""
ENGINE_EXEC=""
INDEX_PID=""

# cache_lock: take the cache for this run (a second run on this machine waits for the first),
# then stop what a killed run left behind: holding the lock, an engine on this data root or an
# index serving this cache is an orphan (the run's containers, restarted with its engine, go
# with the `down` before the build). The long-lived children close the lock's descriptor, or an
# orphan would hold the lock forever.
cache_lock() {
    local name stale
    mkdir -p "$COMPOSE_CACHE"
    exec 9>"$COMPOSE_CACHE/lock"
    flock 9
    for name in dockerd index; do
        stale="$(cat "$COMPOSE_CACHE/$name.pid" 2>/dev/null || true)"
        if [[ -n "$stale" ]] && grep -qs -- "$COMPOSE_CACHE" "/proc/$stale/cmdline"; then
            log "stopping an orphaned $name ($stale)"
            kill "$stale" && while kill -0 "$stale" 2>/dev/null; do sleep 0.5; done
        fi
    done
}

# engine_start SCRATCH: use the engine DOCKER_HOST names if one answers; otherwise start a
# private dockerd (socket and exec root in SCRATCH, data root in the cache so base images and
# build layers outlive the run). iptables and masquerading stay off so the host's firewall is
# never touched: containers then reach each other and the host, not the internet, and builds go
# through the host's network (SLUICE_BUILD_NETWORK=host).
engine_start() {
    local scratch="$1" _
    if [[ -n "${DOCKER_HOST:-}" ]] && docker info >/dev/null 2>&1; then
        log "using the engine at $DOCKER_HOST"
        return 0
    fi
    [[ "$(id -u)" == 0 ]] || die "no container engine answers, and starting one needs root"
    ensure_tool dockerd docker.io || die "no dockerd (apt-get install docker.io)"
    ensure_tool docker-compose docker-compose || die "no docker-compose"
    mkdir -p "$COMPOSE_CACHE/docker"
    # Debian's client, matching the engine; another docker earlier on PATH may be newer.
    [[ -x /usr/bin/docker ]] && export PATH="/usr/bin:$PATH"
    dockerd --data-root "$COMPOSE_CACHE/docker" --exec-root "$scratch/exec" \
        --pidfile "$COMPOSE_CACHE/dockerd.pid" -H "unix://$scratch/docker.sock" \
        --storage-driver overlay2 --iptables=false --ip-masq=false \
        >"$scratch/dockerd.log" 2>&1 9>&- &
    ENGINE_PID=$!
    ENGINE_EXEC="$scratch/exec"
    export DOCKER_HOST="unix://$scratch/docker.sock"
    for _ in $(seq 60); do
        docker info >/dev/null 2>&1 && { log "private dockerd up ($DOCKER_HOST)"; return 0; }
        kill -0 "$ENGINE_PID" 2>/dev/null || break
        sleep 0.5
    done
    tail -20 "$scratch/dockerd.log" >&2
    die "dockerd did not start"
}

# engine_stop: stop the dockerd engine_start started (none: nothing to do), and unmount what
# it leaves in its exec root (the default network namespace stays bound after it exits).
engine_stop() {
    local mount
    [[ -n "$ENGINE_PID" ]] || return 0
    kill "$ENGINE_PID" 2>/dev/null || true
    wait "$ENGINE_PID" 2>/dev/null || true
    ENGINE_PID=""
    while read -r _ mount _; do
        if [[ "$mount" == "$ENGINE_EXEC"/* ]]; then umount -l "$mount" || true; fi
    done </proc/mounts
}

# compose_shim BIN_DIR: make `docker compose` work where only docker-compose 1.29 exists (Debian
# bookworm ships no Compose v2), so README lines run as written.
compose_shim() {
    local bin="$1" real
    docker compose version >/dev/null 2>&1 && return 0
    real="$(command -v docker)"
    mkdir -p "$bin"
    cat >"$bin/docker" <<EOF
#!/bin/sh
# docker compose ... -> docker-compose ... (Compose v1.29 reads the same files).
if [ "\$1" = compose ]; then shift; exec docker-compose "\$@"; fi
exec "$real" "\$@"
EOF
    chmod +x "$bin/docker"
    export PATH="$bin:$PATH"
}

# _image NAME DOCKERFILE: make sure image NAME is here: present (a stand-in only if made from
# this very recipe), else pulled, else built from DOCKERFILE on the Debian rootfs image.
_image() {
    local name="$1" recipe key label
    recipe="$(printf 'FROM sluice-compose-test/bookworm\n%s\n' "$2")"
    key="$(sha256sum <<<"$recipe" | cut -c1-16)"
    if docker image inspect "$name" >/dev/null 2>&1; then
        label="$(docker image inspect -f "{{index .Config.Labels \"$STANDIN_LABEL\"}}" "$name")"
        # The real image (no such label), or this recipe's stand-in; an older one is remade.
        [[ -z "$label" || "$label" == "<no value>" || "$label" == "$key" ]] && return 0
    fi
    timeout 120 docker pull -q "$name" >/dev/null 2>&1 && return 0
    # Stand-ins under the real names only in the private engine, never in one a user runs.
    [[ -n "$ENGINE_PID" ]] || die "$name cannot be pulled into the engine at $DOCKER_HOST"
    _rootfs
    log "$name cannot be pulled: making a stand-in from Debian bookworm packages"
    printf '%s\nLABEL %s=%s\n' "$recipe" "$STANDIN_LABEL" "$key" |
        docker build -q --network host -t "$name" - >/dev/null
}

# _rootfs: the debootstrapped bookworm base image, made once per cache.
_rootfs() {
    local root
    docker image inspect sluice-compose-test/bookworm >/dev/null 2>&1 && return 0
    ensure_tool debootstrap debootstrap || die "no debootstrap to make base images with"
    root="$(mktemp -d "$COMPOSE_CACHE/rootfs.XXXXXX")"
    log "debootstrap bookworm (minbase)"
    debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$DEBIAN_MIRROR" \
        >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; die "debootstrap failed"; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . |
        docker import -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        -c 'CMD ["bash"]' - sluice-compose-test/bookworm >/dev/null
    rm -rf "$root" "$root.log"
}

# base_images: make sure every image the Dockerfiles and the CPU stack name is here: already
# present, pulled, or made from Debian packages (stand-ins carry the $STANDIN_LABEL label).
# Grafana has no Debian package, so where it cannot be pulled the caller leaves it out.
base_images() {
    local python redis prometheus
    # Like the official image: `python` and `pip` on PATH, pip installs as root, useradd, and
    # the Debian image's docker-clean, so apt keeps no .deb files or caches in later layers
    # (136 MB in the worker image without it).
    read -r -d '' python <<'EOF' || true
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN clean='"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true";' \
    && printf '%s\n' "DPkg::Post-Invoke { $clean };" "APT::Update::Post-Invoke { $clean };" \
        'Dir::Cache::pkgcache "";' 'Dir::Cache::srcpkgcache "";' >/etc/apt/apt.conf.d/docker-clean \
    && apt-get update && apt-get install -y --no-install-recommends passwd \
        python3 python3-pip python3-venv \
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3.11/EXTERNALLY-MANAGED \
    && ln -s /usr/bin/python3 /usr/local/bin/python && ln -s /usr/bin/pip3 /usr/local/bin/pip
CMD ["python3"]
EOF
    # The official image's entrypoint turns protected mode off when redis-server gets no config
    # file; without that a passwordless Redis refuses every other container.
    read -r -d '' redis <<'EOF' || true
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* && mkdir /data \
    && printf '%s\n' '#!/bin/sh' \
        'if [ "$1" = redis-server ]; then set -- "$@" --protected-mode no; fi' 'exec "$@"' \
        >/entrypoint && chmod +x /entrypoint
WORKDIR /data
ENTRYPOINT ["/entrypoint"]
CMD ["redis-server"]
EOF
    # Debian's prometheus (2.42) with the upstream image's entrypoint, user and workdir.
    read -r -d '' prometheus <<'EOF' || true
RUN apt-get update && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
ENTRYPOINT ["/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOF
    _image python:3.11-slim "$python"
    _image redis:7-alpine "$redis"
    _image prom/prometheus:v2.55.1 "$prometheus"
}

_have_or_pull() {
    docker image inspect "$1" >/dev/null 2>&1 || timeout 120 docker pull -q "$1" >/dev/null 2>&1
}

# torch_index SCRATCH: export SLUICE_TORCH_INDEX_URL for the worker build, unless it is set or
# the Dockerfile's default index answers.
# Where the PyTorch index cannot be reached, serve a PEP 503 index of the pinned CPU wheel (from
# pip's own sources, e.g. a wheel directory in its find-links) and its dependencies (from PyPI)
# on 127.0.0.1, for builds on the host's network; cached between runs.
torch_index() {
    local scratch="$1" dir="$COMPOSE_CACHE/torch-index" pin port _
    [[ -n "${SLUICE_TORCH_INDEX_URL:-}" ]] && return 0
    curl -fs -o /dev/null --max-time 10 https://download.pytorch.org/whl/cpu/torch/ && return 0
    pin="$(grep -E '^torch==' "$CONSTRAINTS")+cpu"
    if [[ ! -f "$dir/.done-$pin" ]]; then
        log "download.pytorch.org is unreachable: a local index of $pin"
        rm -rf "$dir" && mkdir -p "$dir/files"
        "$PY" -m pip download -q --only-binary :all: --python-version 3.11 \
            --platform manylinux_2_28_x86_64 -d "$dir/files" "$pin" >&2 ||
            die "pip cannot find $pin (put the wheel in a pip find-links directory)"
        "$PY" - "$dir" <<'EOF'
import html
import re
import sys
from pathlib import Path

root = Path(sys.argv[1])
projects: dict[str, list[str]] = {}
for wheel in sorted((root / "files").iterdir()):
    name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    projects.setdefault(name, []).append(wheel.name)
for name, files in projects.items():
    page = root / "simple" / name
    page.mkdir(parents=True)
    links = "".join(f'<a href="../../files/{html.escape(f)}">{html.escape(f)}</a>\n' for f in files)
    (page / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
EOF
        touch "$dir/.done-$pin"
    fi
    # A fixed port when free: the URL is a build argument, and a new value each run would miss
    # the build cache of every layer after it (torch, the project).
    port="$("$PY" - <<'EOF'
import socket

s = socket.socket()
try:
    s.bind(("127.0.0.1", 47631))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
EOF
)"
    "$PY" -m http.server --bind 127.0.0.1 --directory "$dir" "$port" \
        >"$scratch/index.log" 2>&1 9>&- &
    INDEX_PID=$!
    echo "$INDEX_PID" >"$COMPOSE_CACHE/index.pid"
    for _ in $(seq 50); do
        curl -fs -o /dev/null "http://127.0.0.1:$port/simple/torch/" && break
        sleep 0.1
    done
    export SLUICE_TORCH_INDEX_URL="http://127.0.0.1:$port/simple"
}

# index_stop: stop the index torch_index started.
index_stop() {
    [[ -n "$INDEX_PID" ]] || return 0
    kill "$INDEX_PID" 2>/dev/null || true
    wait "$INDEX_PID" 2>/dev/null || true
    INDEX_PID=""
}
