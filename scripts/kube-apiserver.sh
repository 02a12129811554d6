#!/usr/bin/env bash
# A real Kubernetes API server for the operator's integration tests, built from Debian's
# kubernetes 1.20.2 source package (no binary can be downloaded here) and cached.
#
#   scripts/kube-apiserver.sh build        build once into the cache, print the binary's path
#   scripts/kube-apiserver.sh start DIR    start etcd + kube-apiserver on loopback, state in DIR;
#                                          prints KUBECONFIG=..., TOKEN=..., SERVER=... lines
#   scripts/kube-apiserver.sh stop DIR     stop what `start DIR` started
#
# Needs root for apt-get (as on the development and CI machines). The cache lives in
# ${HYPERPOD_SDC_CACHE:-~/.cache/hyperpod-sdc}; a build takes about 5 minutes on 2 cores.
set -euo pipefail

VERSION=1.20.2
CACHE="${HYPERPOD_SDC_CACHE:-$HOME/.cache/hyperpod-sdc}"
BIN="$CACHE/kube-apiserver-$VERSION/kube-apiserver"

log() { echo "kube-apiserver.sh: $*" >&2; }

install_packages() {
    local src=/etc/apt/sources.list.d/hyperpod-sdc-src.sources
    if ! grep -rqs "^Types:.*deb-src" /etc/apt/sources.list.d/ && [[ ! -f $src ]]; then
        log "adding a deb-src entry for bookworm main ($src)"
        cat >"$src" <<'SOURCES'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
    fi
    apt-get update -qq
    local packages=(golang-go etcd-server rsync jq golang-github-modern-go-reflect2-dev openssl curl)
    # The tests drive the server with kubectl too; Debian's is 1.20, like the server.
    command -v kubectl >/dev/null || packages+=(kubernetes-client)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${packages[@]}" >/dev/null
}

build() {
    if [[ -x $BIN ]]; then
        echo "$BIN"
        return
    fi
    install_packages
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    log "fetching Debian's kubernetes source into $work"
    (cd "$work" && apt-get source --download-only kubernetes >/dev/null)
    local orig
    orig="$(ls "$work"/kubernetes_*.orig.tar.* | head -n1)"
    mkdir -p "$work/src"
    tar -xf "$orig" -C "$work/src" --strip-components=1
    # The vendored reflect2 1.0.1 crashes under Go 1.19 on the first request; Debian's
    # 1.0.2 does not.
    local vendored="$work/src/vendor/github.com/modern-go/reflect2"
    local debian=/usr/share/gocode/src/github.com/modern-go/reflect2
    rm -f "$vendored"/*.go "$vendored"/*.s
    cp "$debian"/*.go "$vendored"/
    cp "$debian"/*.s "$vendored"/ 2>/dev/null || true
    rm -f "$vendored"/*_test.go
    mkdir -p "$work/src/.go/src/k8s.io"
    ln -s ../../.. "$work/src/.go/src/k8s.io/kubernetes"
    log "building kube-apiserver $VERSION (about 5 minutes)"
    (
        cd "$work/src/.go/src/k8s.io/kubernetes"
        GOPATH="$work/src/.go" GO111MODULE=off CGO_ENABLED=0 GOFLAGS=-mod=vendor \
            KUBE_GIT_VERSION="v$VERSION" KUBE_GIT_TREE_STATE=clean \
            make WHAT=cmd/kube-apiserver >"$work/build.log" 2>&1
    ) || { tail -n 40 "$work/build.log" >&2; log "build failed"; exit 1; }
    mkdir -p "$(dirname "$BIN")"
    cp "$work/src/_output/local/bin/linux/"*/kube-apiserver "$BIN.tmp" 2>/dev/null \
        || cp "$work/src/_output/bin/kube-apiserver" "$BIN.tmp"
    mv "$BIN.tmp" "$BIN"
    echo "$BIN"
}

free_ports() {  # N distinct free ports on loopback (each socket held until all are picked)
    python3 -c 'import socket, sys
held = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in held:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in held))' "$1"
}

start() {
    local dir="$1"
    build >/dev/null
    { command -v etcd && command -v kubectl; } >/dev/null || install_packages
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    local etcd_port peer_port api_port token
    read -r etcd_port peer_port api_port <<<"$(free_ports 3)"
    token="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    openssl genrsa -out "$dir/sa.key" 2048 2>/dev/null
    openssl rsa -in "$dir/sa.key" -pubout -out "$dir/sa.pub" 2>/dev/null
    echo "$token,admin,admin,system:masters" >"$dir/tokens.csv"
    etcd --data-dir "$dir/etcd" --listen-client-urls "http://127.0.0.1:$etcd_port" \
        --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "http://127.0.0.1:$peer_port" >"$dir/etcd.log" 2>&1 &
    echo $! >"$dir/etcd.pid"
    "$BIN" --etcd-servers "http://127.0.0.1:$etcd_port" \
        --bind-address 127.0.0.1 --secure-port "$api_port" --cert-dir "$dir/certs" \
        --token-auth-file "$dir/tokens.csv" --authorization-mode RBAC \
        --service-account-key-file "$dir/sa.pub" \
        --service-account-signing-key-file "$dir/sa.key" \
        --service-account-issuer "https://kubernetes.default.svc" \
        --api-audiences "https://kubernetes.default.svc,hyperpod-sdc" \
        --service-cluster-ip-range 10.96.0.0/16 --allow-privileged \
        --enable-admission-plugins ServiceAccount >"$dir/apiserver.log" 2>&1 &
    echo $! >"$dir/apiserver.pid"
    local server="https://127.0.0.1:$api_port"
    for _ in $(seq 1 120); do
        if curl -fsk -H "Authorization: Bearer $token" "$server/readyz" >/dev/null 2>&1; then
            break
        fi
        sleep 0.5
    done
    curl -fsk -H "Authorization: Bearer $token" "$server/readyz" >/dev/null \
        || {
            tail -n 10 "$dir/etcd.log" >&2
            tail -n 30 "$dir/apiserver.log" >&2
            log "the API server did not become ready (etcd $etcd_port, peer $peer_port, API $api_port)"
            exit 1
        }
    cat >"$dir/kubeconfig" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster: {server: "$server", certificate-authority: "$dir/certs/apiserver.crt"}
users:
- name: admin
  user: {token: "$token"}
contexts:
- name: local
  context: {cluster: local, user: admin}
current-context: local
KUBECONFIG
    echo "KUBECONFIG=$dir/kubeconfig"
    echo "TOKEN=$token"
    echo "SERVER=$server"
}

stop() {
    local dir="$1"
    for name in apiserver etcd; do
        if [[ -f "$dir/$name.pid" ]]; then
            kill "$(cat "$dir/$name.pid")" 2>/dev/null || true
            rm -f "$dir/$name.pid"
        fi
    done
}

case "${1:-}" in
    build) build ;;
    start) start "${2:?start needs a state directory}" ;;
    stop) stop "${2:?stop needs a state directory}" ;;
    *) echo "usage: $0 build | start DIR | stop DIR" >&2; exit 2 ;;
esac
