#!/usr/bin/env bash
# Builds kiln's container image and the router's, with no container registry, and checks them
# running:
#   scripts/image/check.sh [KILN_BINARY]
#
# 1. A Docker engine: the running one, else `dockerd` started here (installed from Debian's
#    `docker.io` when missing and this is root with apt-get), stopped again at the end.
# 2. The base image `kiln-base:bookworm` when missing: Debian bookworm made by debootstrap
#    (`minbase`) from the machine's Debian mirror, then `docker import`.
# 3. The images: the Dockerfile's last stage (the runtime) on that base with KILN_BINARY
#    (default target/release/kiln, built when missing; any kiln binary for glibc 2.36 or older)
#    in place of the build stage's output, which needs the `rust` image of a registry; and
#    deploy/docker/router.Dockerfile on the same base.
# 4. The checks: `kiln --version` and `kiln serve --help`; the default command, run as the
#    non-root user on a read-only root file system (`--read-only`, /cache a volume, /tmp a
#    tmpfs), fetches the default model into the volume and answers /health and a completion; a
#    SIGTERM while a stream runs lets it end with `data: [DONE]`; a second container reuses the
#    volume's model; two kiln containers behind the router on a user-defined network serve
#    requests, and still do with one of them killed.
#
# The host's extra CA certificates (/usr/local/share/ca-certificates) go into the base image, so
# builds and containers trust what the host trusts (a network whose proxy intercepts TLS).
# Ports are published on 127.0.0.1 only. Exits 0 when
# every check passed, 77 (with the reason) when no Docker engine can be had here, 1 otherwise.
# Environment: KILN_IMAGE_MIRROR (Debian mirror for debootstrap), KILN_IMAGE_KEEP=1 (keep the
# images and the volume).
set -euo pipefail
cd "$(dirname "$0")/../.."

say() { echo "[image] $*" >&2; }
skip() { say "SKIPPED: $*"; exit 77; }
fail() { say "FAILED: $*"; exit 1; }

run_id="kiln-check-$$"
work=$(mktemp -d)
started_dockerd=""
cleanup() {
    local status=$?
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then
        docker ps -aq --filter "label=$run_id" | xargs -r docker rm -f >/dev/null 2>&1 || true
        docker network rm "$run_id" >/dev/null 2>&1 || true
        docker volume rm "$run_id" >/dev/null 2>&1 || true
        if [ "${KILN_IMAGE_KEEP:-0}" != 1 ]; then
            docker rmi "kiln:$run_id" "kiln-router:$run_id" >/dev/null 2>&1 || true
        fi
    fi
    if [ -n "$started_dockerd" ]; then
        kill "$started_dockerd" 2>/dev/null || true
        wait "$started_dockerd" 2>/dev/null || true
    fi
    rm -rf "$work"
    exit "$status"
}
trap cleanup EXIT

# 1. The engine.
if ! docker info >/dev/null 2>&1; then
    if ! command -v dockerd >/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            say "installing Debian's docker.io"
            apt-get update -qq >"$work/apt.log" 2>&1 \
                && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io \
                    >>"$work/apt.log" 2>&1 \
                || skip "apt-get install docker.io failed: $(tail -3 "$work/apt.log")"
        else
            skip "no Docker engine, and dockerd cannot be installed here (not root with apt-get)"
        fi
    fi
    say "starting dockerd"
    dockerd >"$work/dockerd.log" 2>&1 &
    started_dockerd=$!
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && break
        kill -0 "$started_dockerd" 2>/dev/null \
            || skip "dockerd could not start here: $(tail -3 "$work/dockerd.log")"
        sleep 0.5
    done
    docker info >/dev/null 2>&1 || skip "dockerd did not answer in 30 s"
fi

# 2. The base image.
base=kiln-base:bookworm
if ! docker image inspect "$base" >/dev/null 2>&1; then
    if ! command -v debootstrap >/dev/null; then
        [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
            || fail "debootstrap is missing (Debian's package) and cannot be installed here"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
    fi
    # The machine's own Debian mirror: the first `deb` or `URIs:` entry that is not security's.
    mirror=${KILN_IMAGE_MIRROR:-$( (cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources 2>/dev/null || true) | grep -E '^(deb|URIs:) ' \
        | grep -oE 'https?://[^ ]+' | grep -v security | head -1 || true)}
    mirror=${mirror:-http://deb.debian.org/debian}
    say "making $base with debootstrap from $mirror"
    debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
        || fail "debootstrap failed: $(tail -5 "$work/debootstrap.log")"
    rm -rf "$work"/rootfs/var/lib/apt/lists/* "$work"/rootfs/var/cache/apt/archives/*.deb
    # The host's own CA certificates (a proxy that intercepts TLS): the images' ca-certificates
    # package adds them to the bundle that apt, pip and kiln read.
    if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
        mkdir -p "$work/rootfs/usr/local/share/ca-certificates"
        cp /usr/local/share/ca-certificates/*.crt "$work/rootfs/usr/local/share/ca-certificates/"
    fi
    tar -C "$work/rootfs" -c . | docker import - "$base" >/dev/null
    rm -rf "$work/rootfs"
fi

# 3. The images.
binary=${1:-target/release/kiln}
if [ ! -x "$binary" ]; then
    say "building $binary"
    cargo build --release -p kiln
fi
mkdir -p "$work/kiln" "$work/router"
strip -o "$work/kiln/kiln" "$binary" 2>/dev/null || cp "$binary" "$work/kiln/kiln"
# The runtime stage, its binary from the build context instead of the build stage.
awk '/^FROM \$\{RUNTIME_IMAGE\}$/ { start = NR } { line[NR] = $0 }
     END { print "ARG RUNTIME_IMAGE"
           for (i = start; i <= NR; i++) { l = line[i]; sub(/^COPY --from=build \/kiln /, "COPY kiln ", l); print l } }' \
    Dockerfile >"$work/kiln/Dockerfile"
grep -q '^COPY kiln /usr/local/bin/kiln$' "$work/kiln/Dockerfile" \
    || fail "the Dockerfile's runtime stage no longer copies /kiln from the build stage"
say "building kiln:$run_id"
docker build --label "$run_id" --build-arg RUNTIME_IMAGE="$base" -t "kiln:$run_id" \
    "$work/kiln" >"$work/build.log" 2>&1 || fail "docker build: $(tail -5 "$work/build.log")"
say "building kiln-router:$run_id"
docker build --label "$run_id" --build-arg RUNTIME_IMAGE="$base" -t "kiln-router:$run_id" \
    -f deploy/docker/router.Dockerfile "$work/router" >"$work/build.log" 2>&1 \
    || fail "docker build of the router: $(tail -5 "$work/build.log")"
size=$(docker image inspect -f '{{.Size}}' "kiln:$run_id")
say "kiln image: $((size / 1000000)) MB"

# 4. The checks.
# Whole outputs first: `docker ... | grep -q` fails under pipefail when grep exits before
# docker has written everything (docker then reports a broken pipe).
# Whether container $1's log (stdout and stderr) matches the pattern $2.
logs_have() {
    local out
    out=$(docker logs "$1" 2>&1)
    grep -q -- "$2" <<<"$out"
}
version=$(docker run --rm "kiln:$run_id" --version) || fail "kiln --version"
grep -q '^kiln ' <<<"$version" || fail "kiln --version: $version"
help=$(docker run --rm "kiln:$run_id" serve --help) || fail "kiln serve --help"
grep -q -- '--max-model-len' <<<"$help" || fail "kiln serve --help names no --max-model-len"

docker volume create "$run_id" >/dev/null
# Starts a kiln container from the image's default command; prints its name.
start_kiln() {
    local name=$1; shift
    docker run -d --name "$name" --label "$run_id" --read-only --tmpfs /tmp \
        -v "$run_id:/cache" "$@" "kiln:$run_id" >/dev/null
    echo "$name"
}
# Waits until http://ADDR/health is 200 (the first start fetches the default model).
wait_healthy() {
    for _ in $(seq 1 300); do
        [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$1/health")" = 200 ] && return 0
        sleep 1
    done
    return 1
}
published() { docker port "$1" 8000 | grep -m1 '^127\.0\.0\.1:'; }

first=$(start_kiln "$run_id-first" -p 127.0.0.1::8000)
addr=$(published "$first")
wait_healthy "$addr" || fail "the first container never answered /health: $(docker logs "$first" 2>&1 | tail -5)"
logs_have "$first" '\[kiln fetch\] ready:' \
    || fail "the first container did not fetch the default model into /cache"
[ "$(docker exec "$first" id -u)" = 10001 ] || fail "kiln does not run as uid 10001"
[ "$(docker inspect -f '{{.HostConfig.ReadonlyRootfs}}' "$first")" = true ] || fail "not read-only"
completion=$(curl -sf "http://$addr/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}') \
    || fail "the completion failed"
echo "$completion" | grep -q '"text_completion"' || fail "not a completion: $completion"
say "served a completion as uid 10001 on a read-only root file system"

# SIGTERM while a stream runs: the stream still ends properly.
curl -sN "http://$addr/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": true, "stream": true}' \
    >"$work/stream.txt" &
stream=$!
for _ in $(seq 1 100); do grep -q '^data: {' "$work/stream.txt" && break; sleep 0.1; done
grep -q '^data: {' "$work/stream.txt" || fail "the stream did not start"
docker stop -t 60 "$first" >/dev/null
wait "$stream" || true
grep -q '^data: \[DONE\]' "$work/stream.txt" \
    || fail "the stream cut by SIGTERM did not end with [DONE]: $(tail -c 300 "$work/stream.txt")"
[ "$(docker inspect -f '{{.State.ExitCode}}' "$first")" = 0 ] || fail "kiln exited non-zero on SIGTERM"
say "SIGTERM drained a running stream ($(grep -c '^data: {' "$work/stream.txt") chunks, then [DONE])"

# The router over two kiln containers on a network of their own.
docker network create "$run_id" >/dev/null
start_kiln "$run_id-a" --network "$run_id" --network-alias kiln-a >/dev/null
start_kiln "$run_id-b" --network "$run_id" --network-alias kiln-b >/dev/null
logs_have "$run_id-a" '\[kiln fetch\] ready:' \
    && fail "a second container fetched the model again instead of reusing the volume"
docker run -d --name "$run_id-router" --label "$run_id" --read-only --tmpfs /tmp --network "$run_id" \
    -p 127.0.0.1::8000 "kiln-router:$run_id" --host 0.0.0.0 --port 8000 --policy round_robin \
    --worker-urls http://kiln-a:8000 http://kiln-b:8000 \
    --worker-startup-check-interval 1 --health-check-interval-secs 1 \
    --health-check-timeout-secs 1 --health-failure-threshold 1 --log-level warning >/dev/null
router=$(published "$run_id-router")
# Requests through the router; prints how many of COUNT answered 200.
through_router() {
    local ok=0
    for _ in $(seq 1 "$1"); do
        code=$(curl -s -o /dev/null -w '%{http_code}' "http://$router/v1/completions" \
            -H 'Content-Type: application/json' \
            -d '{"model": "gemma-3-270m", "prompt": "Hello", "max_tokens": 4, "temperature": 0}')
        [ "$code" = 200 ] && ok=$((ok + 1))
    done
    echo "$ok"
}
for _ in $(seq 1 120); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$router/v1/completions" \
        -H 'Content-Type: application/json' \
        -d '{"model": "gemma-3-270m", "prompt": "Hi", "max_tokens": 1}')" = 200 ] && break
    sleep 1
done
logs_have "$run_id-a" '\[kiln fetch\] cached:' \
    || fail "the second container did not read the model from the volume: $(docker logs "$run_id-a" 2>&1 | tail -3)"
[ "$(through_router 8)" = 8 ] || fail "the router did not serve 8 of 8 requests over two replicas"
docker kill "$run_id-a" >/dev/null
sleep 3
[ "$(through_router 8)" = 8 ] || fail "the router did not serve 8 of 8 requests with a replica killed"
say "the router served 8 of 8 requests over two replicas, and 8 of 8 with one killed"
say "all image checks passed (kiln image $((size / 1000000)) MB)"
