#!/usr/bin/env bash
# Build a Kubernetes control plane for tests from the Go module proxy:
# etcd, kube-apiserver, kube-controller-manager and kube-scheduler.
#
# The binaries land in a cache outside the repository, keyed by version, so a
# second run (or a second checkout) finds them and returns at once:
#   ${QM_K8S_CACHE:-$HOME/.cache/quartermaster/k8s}/<k8s version>-etcd<etcd version>/bin
# Go's own module and build caches are reused, so a rebuild after a cache wipe
# downloads nothing it already has.
#
# Usage: tools/k8s/build.sh            build if missing, print the bin folder
#        QM_K8S_VERSION=v1.34.4 QM_ETCD_VERSION=v3.6.16 tools/k8s/build.sh
set -euo pipefail

K8S_VERSION="${QM_K8S_VERSION:-v1.34.4}"
ETCD_VERSION="${QM_ETCD_VERSION:-v3.6.16}"
CACHE_ROOT="${QM_K8S_CACHE:-$HOME/.cache/quartermaster/k8s}"
BIN_DIR="$CACHE_ROOT/${K8S_VERSION}-etcd${ETCD_VERSION}/bin"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"

BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler)

all_built() {
    for b in "${BINARIES[@]}"; do
        [[ -x "$BIN_DIR/$b" ]] || return 1
    done
}

if all_built; then
    echo "$BIN_DIR"
    exit 0
fi

# Staging modules of k8s.io/kubernetes are published as k8s.io/<name> v0.<minor>.<patch>.
STAGING_VERSION="v0${K8S_VERSION#v1}"

export CGO_ENABLED=0
export GOFLAGS="-mod=mod"
# The build competes with other work on a small machine: stay polite.
NICE=(nice -n 10)
LDFLAGS="-s -w"

mkdir -p "$BIN_DIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/qm-k8s-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

log() { echo "[build.sh $(date -u +%H:%M:%S)] $*" >&2; }

build_etcd() {
    [[ -x "$BIN_DIR/etcd" ]] && return 0
    log "building etcd $ETCD_VERSION"
    local dir="$WORK/etcd"
    mkdir -p "$dir"
    # A one-line main around etcdmain keeps us independent of where the etcd
    # repository keeps its own main package in a given release.
    cat >"$dir/main.go" <<'GO'
// Command etcd runs the etcd server for the Quartermaster test control plane.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
    (
        cd "$dir"
        "$GO" mod init qm/etcd >/dev/null 2>&1
        "$GO" get "go.etcd.io/etcd/server/v3@$ETCD_VERSION" >&2
        "$GO" mod tidy >&2
        "${NICE[@]}" "$GO" build -trimpath -ldflags="$LDFLAGS" -o "$BIN_DIR/etcd.tmp" .
    )
    mv "$BIN_DIR/etcd.tmp" "$BIN_DIR/etcd"
}

build_kubernetes() {
    local missing=0
    for b in kube-apiserver kube-controller-manager kube-scheduler; do
        [[ -x "$BIN_DIR/$b" ]] || missing=1
    done
    [[ $missing == 1 ]] || return 0
    log "building kube-apiserver, kube-controller-manager, kube-scheduler $K8S_VERSION"
    local dir="$WORK/kubernetes"
    mkdir -p "$dir"
    (
        cd "$dir"
        # k8s.io/kubernetes requires its staging modules at v0.0.0 and points
        # them at ./staging with replace directives, which do not apply to a
        # module that depends on it. Read its go.mod from the proxy and pin
        # every staging module it replaces to the published matching version.
        local upstream_mod
        upstream_mod="$("$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
            sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
        [[ -f "$upstream_mod" ]] || { log "no go.mod for k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
        local go_directive
        go_directive="$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$upstream_mod" | head -1)"
        {
            echo "module qm/kubernetes"
            echo
            echo "go ${go_directive:-1.24}"
            echo
            echo "require k8s.io/kubernetes $K8S_VERSION"
            echo
            echo "replace ("
            sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/src/.*$#\t\1 => \1 '"$STAGING_VERSION"'#p' "$upstream_mod"
            echo ")"
        } >go.mod
        log "pinned $(grep -c '=>' go.mod) staging modules to $STAGING_VERSION"
        # Stamp the real version: a module build has no git tree to take it from.
        local minor="${K8S_VERSION#v1.}"
        minor="${minor%%.*}"
        local version_pkg="k8s.io/component-base/version"
        local k8s_ldflags="$LDFLAGS -X $version_pkg.gitVersion=$K8S_VERSION"
        k8s_ldflags+=" -X $version_pkg.gitMajor=1 -X $version_pkg.gitMinor=$minor"
        k8s_ldflags+=" -X $version_pkg.gitTreeState=clean"
        "${NICE[@]}" "$GO" build -trimpath -ldflags="$k8s_ldflags" -o "$dir/out/" \
            k8s.io/kubernetes/cmd/kube-apiserver \
            k8s.io/kubernetes/cmd/kube-controller-manager \
            k8s.io/kubernetes/cmd/kube-scheduler
    )
    for b in kube-apiserver kube-controller-manager kube-scheduler; do
        mv "$dir/out/$b" "$BIN_DIR/$b"
    done
}

start=$(date +%s)
build_etcd
build_kubernetes
log "built in $(( $(date +%s) - start )) s into $BIN_DIR"
echo "$BIN_DIR"
