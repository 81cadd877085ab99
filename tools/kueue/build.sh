#!/usr/bin/env bash
# Build Kueue's own scalability test (sigs.k8s.io/kueue, test/performance/scheduler):
# its runner and minimalkueue, from the Go module proxy.
#
# Everything lands in a cache outside the repository, keyed by version, so a
# second run (or a second checkout) finds it and returns at once:
#   ${QM_KUEUE_CACHE:-$HOME/.cache/quartermaster/kueue}/<version>/
#       src/   a writable copy of the module (the runner is started from here:
#              Kueue's test utilities look upward from the working directory for
#              its Makefile, and its CRDs and generator configs live here)
#       bin/   performance-scheduler-runner and minimalkueue
#       .stamp written last, once both binaries and the source copy are in place
# A folder without a matching stamp (an interrupted build) is rebuilt from
# scratch. Go's own module and build caches are reused, so a rebuild after a
# cache wipe downloads nothing it already has. The module cache itself is
# read-only, hence the copy.
#
# Usage: tools/kueue/build.sh            build if missing, print the version folder
#        tools/kueue/build.sh --check    exit 0 and print the folder if built, 1 if not
#        QM_KUEUE_VERSION=v0.17.0 tools/kueue/build.sh
set -euo pipefail

KUEUE_MODULE="sigs.k8s.io/kueue"
KUEUE_VERSION="${QM_KUEUE_VERSION:-v0.17.0}"
CACHE_ROOT="${QM_KUEUE_CACHE:-$HOME/.cache/quartermaster/kueue}"
VERSION_DIR="$CACHE_ROOT/$KUEUE_VERSION"
SRC_DIR="$VERSION_DIR/src"
BIN_DIR="$VERSION_DIR/bin"
STAMP="$VERSION_DIR/.stamp"
GO="${GO:-$(command -v go || echo /usr/local/go/bin/go)}"

BINARIES=(performance-scheduler-runner minimalkueue)
# What the runner is given from the module's own tree.
SOURCE_PATHS=(Makefile config/components/crd/bases test/performance/scheduler/configs)

log() { echo "[kueue/build.sh $(date -u +%H:%M:%S)] $*" >&2; }

expected_stamp() { echo "$KUEUE_MODULE@$KUEUE_VERSION"; }

# Why the version folder is not usable as it is (empty output when it is).
not_built_reason() {
    [[ -f "$STAMP" ]] || { echo "no stamp at $STAMP"; return; }
    local first_line
    first_line="$(head -n 1 "$STAMP")"
    [[ "$first_line" == "$(expected_stamp)" ]] ||
        { echo "stamp says '$first_line', expected '$(expected_stamp)'"; return; }
    local b p
    for b in "${BINARIES[@]}"; do
        [[ -x "$BIN_DIR/$b" ]] || { echo "missing binary $BIN_DIR/$b"; return; }
    done
    for p in "${SOURCE_PATHS[@]}"; do
        [[ -e "$SRC_DIR/$p" ]] || { echo "missing source path $SRC_DIR/$p"; return; }
    done
}

if [[ "${1:-}" == "--check" ]]; then
    reason="$(not_built_reason)"
    if [[ -z "$reason" ]]; then
        echo "$VERSION_DIR"
        exit 0
    fi
    echo "$reason" >&2
    exit 1
fi

if [[ -z "$(not_built_reason)" ]]; then
    echo "$VERSION_DIR"
    exit 0
fi
log "building $KUEUE_MODULE $KUEUE_VERSION: $(not_built_reason)"

export CGO_ENABLED=0
# The module is built exactly as released: its own go.mod and go.sum.
unset GOFLAGS
export GOFLAGS="-buildvcs=false"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"
# The build competes with other work on a small machine: stay polite.
NICE=(nice -n 10)

WORK="$(mktemp -d "${TMPDIR:-/tmp}/qm-kueue-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
start=$(date +%s)

module_json="$(cd "$WORK" && "$GO" mod download -json "$KUEUE_MODULE@$KUEUE_VERSION")"
module_dir="$(echo "$module_json" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')"
module_sum="$(echo "$module_json" | sed -n 's/^[[:space:]]*"Sum": "\(.*\)",\{0,1\}$/\1/p')"
[[ -d "$module_dir" ]] || { log "no module folder for $KUEUE_MODULE@$KUEUE_VERSION"; exit 1; }

# Start from nothing: whatever a previous, unstamped attempt left is not trusted.
rm -rf "$STAMP" "$SRC_DIR" "$BIN_DIR" "$VERSION_DIR/src.tmp" "$VERSION_DIR/bin.tmp"
mkdir -p "$VERSION_DIR"
cp -R "$module_dir" "$VERSION_DIR/src.tmp"
chmod -R u+w "$VERSION_DIR/src.tmp"

ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
(
    cd "$VERSION_DIR/src.tmp"
    # go build fetches only the modules these two packages need.
    log "building ${BINARIES[*]}"
    "${NICE[@]}" "$GO" build -trimpath -ldflags="$ldflags" \
        -o "$VERSION_DIR/bin.tmp/performance-scheduler-runner" ./test/performance/scheduler/runner
    "${NICE[@]}" "$GO" build -trimpath -ldflags="$ldflags" \
        -o "$VERSION_DIR/bin.tmp/minimalkueue" ./test/performance/scheduler/minimalkueue
)
mv "$VERSION_DIR/src.tmp" "$SRC_DIR"
mv "$VERSION_DIR/bin.tmp" "$BIN_DIR"
{
    expected_stamp
    echo "sum $module_sum"
    echo "go $("$GO" env GOVERSION)"
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
log "built in $(( $(date +%s) - start )) s into $VERSION_DIR"
echo "$VERSION_DIR"
