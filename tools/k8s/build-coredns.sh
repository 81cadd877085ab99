#!/usr/bin/env bash
# Build CoreDNS, the cluster DNS of the real-node test tier, from the Go module
# proxy, into a cache outside the repository keyed by its version:
#   ${QM_COREDNS_CACHE:-$HOME/.cache/quartermaster/coredns}/<version>/bin/coredns
# Only the plugins the tier's Corefile names are compiled in (bind, errors, log,
# health, ready, kubernetes): the full plugin set pulls in every cloud SDK and
# takes several times as long to build on a small machine. CoreDNS documents
# this way of building it from outside its repository: a main of our own that
# imports the plugins and sets dnsserver.Directives, their order.
#
# Usage: tools/k8s/build-coredns.sh      build if missing, print the bin folder
set -euo pipefail

COREDNS_VERSION="${QM_COREDNS_VERSION:-v1.14.7}"
CACHE_ROOT="${QM_COREDNS_CACHE:-$HOME/.cache/quartermaster/coredns}"
BIN_DIR="$CACHE_ROOT/$COREDNS_VERSION/bin"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"

if [[ -x "$BIN_DIR/coredns" ]]; then
    echo "$BIN_DIR"
    exit 0
fi

export CGO_ENABLED=0
export GOFLAGS="-mod=mod"
NICE=(nice -n 10)

mkdir -p "$BIN_DIR"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/qm-coredns-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
log() { echo "[build-coredns.sh $(date -u +%H:%M:%S)] $*" >&2; }

start=$(date +%s)
log "building coredns $COREDNS_VERSION"
cat >"$WORK/main.go" <<'GO'
// Command coredns serves the cluster domain of the Quartermaster test cluster.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

// The order CoreDNS's own zdirectives.go gives these plugins.
var directives = []string{"bind", "ready", "health", "errors", "log", "kubernetes"}

func init() { dnsserver.Directives = directives }

func main() { coremain.Run() }
GO
(
    cd "$WORK"
    "$GO" mod init qm/coredns >/dev/null 2>&1
    "$GO" get "github.com/coredns/coredns@$COREDNS_VERSION" >&2
    "$GO" mod tidy >&2
    "${NICE[@]}" "$GO" build -trimpath \
        -ldflags="-s -w -X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" \
        -o "$WORK/coredns" .
)
mv "$WORK/coredns" "$BIN_DIR/coredns"
log "built in $(( $(date +%s) - start )) s into $BIN_DIR"
echo "$BIN_DIR"
