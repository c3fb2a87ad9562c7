#!/usr/bin/env bash
# Install Beam's Prism runner (a Go binary) from the Go module proxy into .cache/bin/prism.
#
#   pipelines/runtime/install_prism.sh                  # idempotent; `make install` runs it
#   BEAM_VERSION=v2.77.0 TRAJPIPE_CACHE=/elsewhere pipelines/runtime/install_prism.sh
#
# The version must match the Python SDK (apache-beam 2.77.0): Prism and the SDK speak the
# portable Fn API of the same release. Needs Go 1.21+; a fresh build downloads ~70 modules
# and takes a few minutes on 2 cores; the binary is ~65 MB.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${TRAJPIPE_CACHE:-$ROOT/.cache}"
VERSION="${BEAM_VERSION:-v2.77.0}"
BIN="$CACHE/bin/prism"
STAMP="$CACHE/bin/.prism-$VERSION"

if [[ -x "$BIN" && -f "$STAMP" ]]; then
  exit 0
fi
command -v go >/dev/null || { echo "install_prism: \`go\` not found; install Go 1.21+ (https://go.dev/dl/)" >&2; exit 1; }

mkdir -p "$CACHE/bin"
rm -f "$CACHE"/bin/.prism-*
GOBIN="$CACHE/bin" GOFLAGS="${GOFLAGS:--trimpath}" \
  go install "github.com/apache/beam/sdks/v2/go/cmd/prism@$VERSION"
touch "$STAMP"
echo "Prism $VERSION: $BIN ($(du -h "$BIN" | cut -f1))"
