#!/usr/bin/env bash
# Build the kubelet for the real-node test tier from the Go module proxy, the
# same way tools/k8s/build.sh builds the control plane (and into the same
# version-keyed cache, so the two share Go's module and build caches):
#   ${QM_K8S_CACHE:-$HOME/.cache/quartermaster/k8s}/<k8s version>-etcd<etcd version>/bin/kubelet
# Pinned to 1.34.x: it still runs on a cgroup v1 host (failCgroupV1: false);
# later releases drop cgroup v1.
#
# Usage: tools/k8s/build-kubelet.sh      build if missing, print the bin folder
set -euo pipefail

K8S_VERSION="${QM_K8S_VERSION:-v1.34.4}"
ETCD_VERSION="${QM_ETCD_VERSION:-v3.6.16}"
CACHE_ROOT="${QM_K8S_CACHE:-$HOME/.cache/quartermaster/k8s}"
BIN_DIR="$CACHE_ROOT/${K8S_VERSION}-etcd${ETCD_VERSION}/bin"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"

if [[ -x "$BIN_DIR/kubelet" ]]; then
    echo "$BIN_DIR"
    exit 0
fi

STAGING_VERSION="v0${K8S_VERSION#v1}"
export CGO_ENABLED=0
export GOFLAGS="-mod=mod"
NICE=(nice -n 10)
LDFLAGS="-s -w"

mkdir -p "$BIN_DIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/qm-kubelet-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
log() { echo "[build-kubelet.sh $(date -u +%H:%M:%S)] $*" >&2; }

start=$(date +%s)
log "building kubelet $K8S_VERSION"
(
    cd "$WORK"
    # As in build.sh: pin every staging module k8s.io/kubernetes replaces with
    # ./staging to its published version, read from the proxy's go.mod.
    upstream_mod="$("$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
        sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
    [[ -f "$upstream_mod" ]] || { log "no go.mod for k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
    go_directive="$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$upstream_mod" | head -1)"
    {
        echo "module qm/kubelet"
        echo
        echo "go ${go_directive:-1.24}"
        echo
        echo "require k8s.io/kubernetes $K8S_VERSION"
        echo
        echo "replace ("
        sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\) => \./staging/src/.*$#\t\1 => \1 '"$STAGING_VERSION"'#p' "$upstream_mod"
        echo ")"
    } >go.mod
    minor="${K8S_VERSION#v1.}"
    minor="${minor%%.*}"
    version_pkg="k8s.io/component-base/version"
    k8s_ldflags="$LDFLAGS -X $version_pkg.gitVersion=$K8S_VERSION"
    k8s_ldflags+=" -X $version_pkg.gitMajor=1 -X $version_pkg.gitMinor=$minor"
    k8s_ldflags+=" -X $version_pkg.gitTreeState=clean"
    "${NICE[@]}" "$GO" build -trimpath -ldflags="$k8s_ldflags" -o "$WORK/kubelet" \
        k8s.io/kubernetes/cmd/kubelet
)
mv "$WORK/kubelet" "$BIN_DIR/kubelet"
log "built in $(( $(date +%s) - start )) s into $BIN_DIR"
echo "$BIN_DIR"
