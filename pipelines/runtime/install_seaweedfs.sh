#!/usr/bin/env bash
# Build SeaweedFS's `weed` (a Go binary; Apache-2.0) from the Go module proxy into .cache/bin/weed.
# The tests start it as a real S3-compatible object store (tests/s3_helpers.py, docs/storage.md).
#
#   pipelines/runtime/install_seaweedfs.sh               # idempotent; `make install` runs it
#   SEAWEEDFS_VERSION=v0.0.0-... TRAJPIPE_CACHE=/elsewhere pipelines/runtime/install_seaweedfs.sh
#
# `go install github.com/seaweedfs/seaweedfs/weed@V` is refused (its go.mod has replace
# directives), so the module is downloaded, copied somewhere writable (the module cache is
# read-only) and built there as the main module. Needs Go 1.25+; the build downloads a few
# hundred modules and takes ~10 min on 2 cores; the binary is ~230 MB.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${TRAJPIPE_CACHE:-$ROOT/.cache}"
MODULE=github.com/seaweedfs/seaweedfs
VERSION="${SEAWEEDFS_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}"
BIN="$CACHE/bin/weed"
STAMP="$CACHE/bin/.weed-$VERSION"

if [[ -x "$BIN" && -f "$STAMP" ]]; then
  exit 0
fi
command -v go >/dev/null || { echo "install_seaweedfs: \`go\` not found; install Go 1.25+ (https://go.dev/dl/)" >&2; exit 1; }

SRC_DIR="$(go mod download -json "$MODULE@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
[[ -n "$SRC_DIR" && -d "$SRC_DIR" ]] || { echo "install_seaweedfs: go mod download $MODULE@$VERSION gave no source dir" >&2; exit 1; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/seaweedfs-build.XXXXXX")"
trap 'chmod -R u+w "$WORK" 2>/dev/null; rm -rf "$WORK"' EXIT
cp -r "$SRC_DIR/." "$WORK/"
chmod -R u+w "$WORK"

mkdir -p "$CACHE/bin"
rm -f "$CACHE"/bin/.weed-*
# Build to a temporary name and rename, so an interrupted build never leaves a half-written weed.
(cd "$WORK" && GOFLAGS="${GOFLAGS:--trimpath} -buildvcs=false" go build -ldflags="-s -w" -o "$BIN.tmp" ./weed)
mv -f "$BIN.tmp" "$BIN"
touch "$STAMP"
echo "SeaweedFS $VERSION: $BIN ($(du -h "$BIN" | cut -f1))"
