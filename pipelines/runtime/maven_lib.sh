# Shared by the install scripts that assemble Java runtimes from Maven Central (sourced, not run).

# need_jdk_and_maven WHO TOOL...: exit 1 with one line naming the first missing tool.
need_jdk_and_maven() {
  local who=$1 tool
  shift
  for tool in "$@"; do
    command -v "$tool" >/dev/null || { echo "$who: \`$tool\` not found; install a JDK (11+) and Maven" >&2; exit 1; }
  done
}

# maven_copy_deps POM DIR: POM's runtime dependencies into a fresh DIR/lib.
maven_copy_deps() {
  rm -rf "$2"
  mkdir -p "$2/lib"
  mvn -q -B -f "$1" dependency:copy-dependencies -DoutputDirectory="$2/lib" -DincludeScope=runtime
}
