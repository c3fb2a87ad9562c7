#!/usr/bin/env bash
# Install a Flink 1.19 standalone session cluster's jars into .cache/jars/flink-cluster/lib.
#
#   pipelines/runtime/install_flink_cluster.sh            # idempotent; `make install` runs it
#   TRAJPIPE_CACHE=/elsewhere pipelines/runtime/install_flink_cluster.sh
#
# Result: $CACHE/jars/flink-cluster/lib/*.jar (flink-runtime, the Akka RPC loader, clients, the Java and
# streaming APIs, the optimizer, log4j2), the classpath of the JobManager
# (org.apache.flink.runtime.entrypoint.StandaloneSessionClusterEntrypoint) and the TaskManagers
# (org.apache.flink.runtime.taskexecutor.TaskManagerRunner) that pipelines/flink_cluster.py starts
# (`trajpipe flink-cluster up`). Same Flink release as the job server (install_flink_jobserver.sh).
# Needs Java 11+ and Maven with access to Maven Central. See pipelines/runtime/flink-cluster/pom.xml
# for why this is assembled instead of unpacking flink-dist.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${TRAJPIPE_CACHE:-$ROOT/.cache}"
POM="$ROOT/pipelines/runtime/flink-cluster/pom.xml"
DEST="$CACHE/jars/flink-cluster"
STAMP="$DEST/.done"

if [[ -f "$STAMP" && "$STAMP" -nt "$POM" ]] && compgen -G "$DEST/lib/flink-runtime-*.jar" >/dev/null; then
  exit 0
fi
source "$ROOT/pipelines/runtime/maven_lib.sh"
need_jdk_and_maven install_flink_cluster mvn java
maven_copy_deps "$POM" "$DEST.tmp"
# The entry points must be on this classpath, or the cluster would fail only at start.
for cls in org/apache/flink/runtime/entrypoint/StandaloneSessionClusterEntrypoint \
           org/apache/flink/runtime/taskexecutor/TaskManagerRunner; do
  unzip -l "$DEST.tmp"/lib/flink-runtime-*.jar "$cls.class" >/dev/null \
    || { echo "install_flink_cluster: $cls not in flink-runtime" >&2; exit 1; }
done
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
touch "$STAMP"
echo "Flink session cluster jars: $DEST/lib ($(ls "$DEST/lib" | wc -l) jars, $(du -sh "$DEST/lib" | cut -f1))"
