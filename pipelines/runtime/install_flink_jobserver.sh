#!/usr/bin/env bash
# Install Beam's Flink job server (runner + Flink 1.19 in local mode) into .cache/jars/flink-job-server/.
#
#   pipelines/runtime/install_flink_jobserver.sh            # idempotent; `make install` runs it
#   TRAJPIPE_CACHE=/elsewhere pipelines/runtime/install_flink_jobserver.sh
#
# Result: $CACHE/jars/flink-job-server/beam-runners-flink-job-server.jar, a manifest-only jar
# (Main-Class FlinkJobServerDriver, Class-Path lib/*.jar) that `--flink_job_server_jar` takes.
# Needs Java 11+ (`jar`) and Maven with access to Maven Central. See pipelines/runtime/flink-job-server/pom.xml
# for why this is assembled instead of downloading beam-runners-flink-1.XX-job-server.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${TRAJPIPE_CACHE:-$ROOT/.cache}"
POM="$ROOT/pipelines/runtime/flink-job-server/pom.xml"
DEST="$CACHE/jars/flink-job-server"
JAR="$DEST/beam-runners-flink-job-server.jar"
STAMP="$DEST/.done"
MAIN_CLASS="org.apache.beam.runners.flink.FlinkJobServerDriver"

if [[ -f "$STAMP" && -f "$JAR" && "$STAMP" -nt "$POM" ]]; then
  exit 0
fi
source "$ROOT/pipelines/runtime/maven_lib.sh"
need_jdk_and_maven install_flink_jobserver mvn jar
maven_copy_deps "$POM" "$DEST.tmp"

# Manifest lines are limited to 72 bytes; a continuation line starts with one space.
(
  cd "$DEST.tmp"
  {
    echo "Manifest-Version: 1.0"
    echo "Main-Class: $MAIN_CLASS"
    { printf 'Class-Path:'; for j in lib/*.jar; do printf ' %s' "$j"; done; echo; } \
      | fold -b -w 70 | sed '2,$s/^/ /'
    echo "Created-By: trajpipe pipelines/runtime/install_flink_jobserver.sh"
  } > MANIFEST.MF
  jar --create --file "$(basename "$JAR")" --manifest MANIFEST.MF
  rm MANIFEST.MF
)
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
touch "$STAMP"
echo "Flink job server: $JAR ($(du -sh "$DEST" | cut -f1))"
