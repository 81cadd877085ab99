#!/usr/bin/env bash
# Build Helm (helm.sh/helm/v3, cmd/helm) from the Go module proxy for the chart
# tests, the same way tools/k8s/build.sh builds the test control plane.
#
# The binary lands in a cache outside the repository, keyed by version, so a
# second run (or a second checkout) finds it and returns at once:
#   ${QM_HELM_CACHE:-$HOME/.cache/quartermaster/helm}/<helm version>/bin/helm
# Go's own module and build caches are reused, so a rebuild after a cache wipe
# downloads nothing it already has.
#
# Usage: tools/k8s/build-helm.sh                       build if missing, print the binary's path
#        QM_HELM_VERSION=v3.21.4 tools/k8s/build-helm.sh
set -euo pipefail

HELM_VERSION="${QM_HELM_VERSION:-v3.22.0}"
CACHE_ROOT="${QM_HELM_CACHE:-$HOME/.cache/quartermaster/helm}"
BIN_DIR="$CACHE_ROOT/$HELM_VERSION/bin"
HELM="$BIN_DIR/helm"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"

if [[ -x "$HELM" ]]; then
    echo "$HELM"
    exit 0
fi

log() { echo "[build-helm.sh $(date -u +%H:%M:%S)] $*" >&2; }

export CGO_ENABLED=0
# `go install pkg@version` builds the module exactly as released (its own
# go.mod, no replacements of ours), which is what Helm's release build does.
unset GOFLAGS
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
# The build competes with other work on a small machine: stay polite.
NICE=(nice -n 10)

mkdir -p "$BIN_DIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/qm-helm-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

start=$(date +%s)
log "building helm $HELM_VERSION"

# Helm stamps its own version and the Kubernetes version it assumes when no
# cluster is asked (`helm template`, `helm lint`) at link time; without the
# stamps it reports v3.x-dev and Kubernetes v1.20. Its Makefile takes the
# Kubernetes version from the client-go it requires (v0.N.x -> v1.N), as here.
helm_mod="$(cd "$WORK" && "$GO" mod download -json "helm.sh/helm/v3@$HELM_VERSION" |
    sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')"
[[ -f "$helm_mod" ]] || { log "no go.mod for helm.sh/helm/v3@$HELM_VERSION"; exit 1; }
client_go="$(sed -n 's/^[[:space:]]*k8s\.io\/client-go \(v[0-9.]*\).*$/\1/p' "$helm_mod" | head -1)"
k8s_minor="$(echo "$client_go" | cut -d. -f2)"
[[ -n "$k8s_minor" ]] || { log "cannot read the client-go version from $helm_mod"; exit 1; }

ldflags="-s -w"
ldflags+=" -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ldflags+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$k8s_minor"
done

(
    cd "$WORK"
    GOBIN="$WORK/bin" "${NICE[@]}" "$GO" install -trimpath -ldflags="$ldflags" \
        "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
)
mv "$WORK/bin/helm" "$HELM.tmp"
mv "$HELM.tmp" "$HELM"
log "built in $(( $(date +%s) - start )) s: $("$HELM" version --short)"
echo "$HELM"
