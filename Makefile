# meshkit: `make demo` runs the main job on the local lab, `make test` runs the tests.
# Both set themselves up on a fresh Debian/Ubuntu machine (run as root).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
# molecule and ansible-lint find ansible's tools through PATH.
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
# Ansible's own state (tmp, installed collections) stays in the checkout: a copy of this collection
# installed in ~/.ansible by some other run must never shadow the code being tested.
export ANSIBLE_HOME := $(CURDIR)/.cache/ansible-home
# A compiler cache outside the checkout (ccache, from `make deps`) for every CMake build (meshccl's C++
# suites, the pip build of the package, the portable build): a fresh clone on this machine recompiles
# only what changed. Paths inside the checkout are hashed relative to it, so another clone's hit too.
ifneq ($(shell command -v ccache 2>/dev/null),)
export CMAKE_C_COMPILER_LAUNCHER := ccache
export CMAKE_CXX_COMPILER_LAUNCHER := ccache
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := true
endif

.PHONY: all demo demo-down test test-steps test-checks lint sanity unit integration deps venv clean meshccl meshccl-cpp meshccl-sanitize meshccl-fuzz \
	meshccl-portable meshccl-macos bench bench-deps bench-scale bench-ab torch-suite

# meshccl: the package (pip, CMake via scikit-build-core), its C++ tests, and the same tests
# under AddressSanitizer + UndefinedBehaviorSanitizer, each built in its own directory.
MESHCCL_SRC := $(shell find collective/src collective/include collective/python collective/tests -type f) \
	collective/CMakeLists.txt collective/pyproject.toml
MESHCCL_BUILD := $(CURDIR)/.cache/meshccl
# PyTorch (CPU) for the DLPack tests and bench/: this machine's local wheel, never another torch.
TORCH_WHEEL := $(firstword $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl))

all: test

deps:
	@bash scripts/system-deps

$(VENV)/.installed: requirements.txt requirements-dev.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet "$(or $(TORCH_WHEEL),torch==2.13.0)"
	@touch $@

$(VENV)/.meshccl: $(VENV)/.installed $(MESHCCL_SRC)
	$(BIN)/python -m pip install --quiet ./collective
	$(BIN)/python -c "import meshccl"
	@touch $@

# The controller package (the `meshkit` command), editable: it runs this checkout's code and collection.
$(VENV)/.meshkit: $(VENV)/.installed pyproject.toml hatch_build.py
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

venv: deps $(VENV)/.installed $(VENV)/.meshccl $(VENV)/.meshkit

meshccl: venv

## meshccl's C++ suite, warnings as errors.
meshccl-cpp: deps
	cmake -S collective -B $(MESHCCL_BUILD)/release -G Ninja -DMESHCCL_BUILD_TESTS=ON -DMESHCCL_WERROR=ON \
		-DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
	cmake --build $(MESHCCL_BUILD)/release
	$(MESHCCL_BUILD)/release/meshccl_tests --gtest_brief=1

## The same suite under ASan + UBSan (the 5-8 rank sweeps left to the plain run, for time).
meshccl-sanitize: deps
	cmake -S collective -B $(MESHCCL_BUILD)/sanitize -G Ninja -DMESHCCL_BUILD_TESTS=ON -DMESHCCL_WERROR=ON \
		-DMESHCCL_SANITIZE=address,undefined -DCMAKE_BUILD_TYPE=Debug > /dev/null
	cmake --build $(MESHCCL_BUILD)/sanitize
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
		$(MESHCCL_BUILD)/sanitize/meshccl_tests --gtest_brief=1 '--gtest_filter=-*n5_*:*n6_*:*n7_*:*n8_*' 

## libFuzzer (clang++-14, ASan + UBSan) on every byte a stranger can send before authentication:
## the acceptor's and the connector's side of meshccl's handshake, each for MESHCCL_FUZZ_SECONDS over
## a copy of the regression corpus (collective/tests/fuzz/corpus: the checkout is never written).
## Fails on any crash; the input is kept as $(MESHCCL_BUILD)/fuzz/crash-<target>-*, and
## $(MESHCCL_BUILD)/release/meshccl_fuzz_replay <target> FILE reruns it with gcc.
MESHCCL_FUZZ_SECONDS ?= 15
meshccl-fuzz: deps
	cmake -S collective -B $(MESHCCL_BUILD)/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 -DMESHCCL_BUILD_FUZZERS=ON \
		-DMESHCCL_WERROR=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
	cmake --build $(MESHCCL_BUILD)/fuzz --target meshccl_fuzz_acceptor meshccl_fuzz_connector
	for target in acceptor connector; do \
		rm -rf $(MESHCCL_BUILD)/fuzz/corpus-$$target; \
		cp -r collective/tests/fuzz/corpus/$$target $(MESHCCL_BUILD)/fuzz/corpus-$$target; \
		$(MESHCCL_BUILD)/fuzz/meshccl_fuzz_$$target -max_total_time=$(MESHCCL_FUZZ_SECONDS) -rss_limit_mb=1024 \
			-timeout=10 -print_final_stats=1 -artifact_prefix=$(MESHCCL_BUILD)/fuzz/crash-$$target- \
			$(MESHCCL_BUILD)/fuzz/corpus-$$target 2>&1 | { grep -v -E '^(#[0-9]+.*(NEW|REDUCE|pulse)|"|######)' || true; }; \
	done

## meshccl built on Linux but forced onto the code paths macOS takes (no accept4 flags, no single copy,
## the portable shared-memory names; scripts/meshccl-portable): its C++ suite, then meshccl's Python
## jobs (tests/meshccl) against a Python module built the same way.
meshccl-portable: venv
	bash scripts/meshccl-portable

## meshccl compiled and linked for aarch64-macos and x86_64-macos against macOS's headers (zig from
## PyPI; scripts/meshccl-macos): the core, the C ABI, the C++ test binary and the Python module.
## A build, not a run: behaviour on macOS needs a Mac (.github/workflows/meshccl.yml).
meshccl-macos: venv
	bash scripts/meshccl-macos

## The main job on the local lab: a 4-host mesh reached over SSH, its network converged and meshccl
## installed on every host (each host's own virtual environment), then meshccl-bench launched on
## every host from that install (rank 0 prints the table).
DEMO_BENCH ?= -b 64K -e 16M -n 10
demo: venv
	time ansible-playbook playbooks/lab.yml
	ansible -i inventory/lab.yml all -m ansible.builtin.ping
	time ansible-playbook -i inventory/lab.yml setup.yml
	time ansible-playbook -i inventory/lab.yml launch.yml \
		-e '{"launch_program": "meshccl-bench all_reduce $(DEMO_BENCH)", "launch_timeout": 300}'
	@echo "The cabling picture: $(CURDIR)/artifacts/lab-lab/cabling.png (and .svg, .dot); the job's logs: $(CURDIR)/artifacts/lab-lab/launch/"
	@echo "The lab stays up: ssh via 'ansible -i inventory/lab.yml ...', jobs via 'meshkit launch -i inventory/lab.yml -- ...' (.venv/bin/meshkit); remove it with 'make demo-down'."

demo-down: venv
	ansible-playbook playbooks/lab.yml -e lab_state=absent

lint: venv
	@# A copy of this collection that molecule or ansible-lint installed under ANSIBLE_HOME would shadow the checkout.
	rm -rf $(ANSIBLE_HOME)/collections/ansible_collections/meshkit
	ruff check .
	ruff format --check .
	ansible-lint

unit: venv
	pytest tests/unit

integration: venv
	pytest tests/integration

## Lint, then two lanes at once (scripts/test-lanes; every lab test waits for conditions, not times, and a
## lane of its own leaves cores idle): `labs`, the lab tests (tests/integration) on two pytest-xdist
## workers, its output on the terminal; `checks` (test-checks: ansible-test sanity, meshccl's C++ suites
## plain, sanitized and fuzzed, its macOS builds and macOS code paths on Linux, then tests/meshccl and
## tests/unit), its log printed whole at the end. Tests sharing a lab stay on one worker (conftest.py).
## Its wall time, from lint to the last lane's end, is printed at the end (also when it fails).
test:
	@start=$$(date +%s); rc=0; $(MAKE) --no-print-directory test-steps || rc=$$?; took=$$(( $$(date +%s) - start )); \
	  echo "make test: $$(( took / 60 )) min $$(( took % 60 )) s, exit $$rc"; exit $$rc

test-steps: lint
	$(BIN)/python scripts/test-lanes "labs=pytest tests/integration -n 2 --dist loadgroup --durations=25" \
	  "checks=$(MAKE) --no-print-directory test-checks"

test-checks: sanity meshccl-cpp meshccl-sanitize meshccl-fuzz meshccl-macos meshccl-portable
	pytest tests/meshccl tests/unit --durations=10

## PyTorch's own distributed tests (torch's _DistTestBase, as PyTorch runs it for Gloo) against Gloo and meshccl,
## side by side (tests/meshccl/torch_suite_run.py): the table in .cache/torch-suite/suite-w2.md, exit 1 on a test
## Gloo passes and meshccl does not. `make test` runs a selection (tests/meshccl/test_torch_suite.py).
## Extra flags: make torch-suite SUITE_ARGS="-n 8 -k group".
torch-suite: venv
	$(BIN)/python tests/meshccl/torch_suite_run.py $(SUITE_ARGS)

## Ansible's own checks on the collection as ansible-galaxy builds it (scripts/ansible-sanity).
sanity: venv
	bash scripts/ansible-sanity

## Side-by-side all-reduce on this machine (bench/README.md): meshccl, Gloo, MLX, Open MPI (shared
## memory and TCP) at 2 and 4 ranks, plus the loopback TCP ceiling; bench/results/loopback.{md,json,png}.
## A benchmark, not a test: `make test` never runs it. Extra flags: make bench BENCH_ARGS="-r 3 -e 16M".
## The rate-limited lab (root): .venv/bin/python bench/allreduce.py lab --shape ring|mesh --rate 1gbit
BENCH_ARGS ?=
$(VENV)/.bench: $(VENV)/.installed bench/requirements.txt
	$(BIN)/python -m pip install --quiet -r bench/requirements.txt
	@touch $@

bench-deps: venv
	@bash bench/system-deps
	@$(MAKE) --no-print-directory $(VENV)/.bench

bench: bench-deps
	$(BIN)/python bench/allreduce.py loopback $(BENCH_ARGS)

## setup.yml (first run, no-change run) and launch.yml timed on lab rings of 4, 8, 16 and 32 hosts, per task
## and per host (root; bench/README.md): bench/results/scale.{md,json,png}. About half an hour on this machine.
## Extra flags: make bench-scale SCALE_ARGS="--sizes 4,8,16,32 --label before --reference"
SCALE_ARGS ?=
bench-scale: bench-deps
	$(BIN)/python bench/scale.py $(SCALE_ARGS)

## meshccl A/B (bench/README.md): the working tree's meshccl against commit REF's, both built alike outside the
## checkout (.cache/bench-ab/), meshccl.bench interleaved round by round; per rank count and size both medians, B/A and
## the run-to-run spread: bench/results/ab-meshccl-<sha>.{md,json}. Needs REF: make bench-ab REF=HEAD~1
## Extra flags: make bench-ab REF=main AB_ARGS="--ranks 2 --rounds 3 --min 64K --max 16M"
REF ?=
AB_ARGS ?=
ifneq ($(filter bench-ab,$(MAKECMDGOALS)),)
ifeq ($(strip $(REF)),)
$(error bench-ab needs REF, the commit to compare the working tree against: make bench-ab REF=HEAD~1 [AB_ARGS="--ranks 2"])
endif
endif
bench-ab: bench-deps
	@test -n "$(REF)" || { echo "bench-ab needs REF=<commit>, e.g. make bench-ab REF=HEAD~1" >&2; exit 2; }
	$(BIN)/python bench/meshccl_ab.py --ref '$(REF)' $(AB_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .cache/meshccl collective/build "$${XDG_CACHE_HOME:-$$HOME/.cache}/meshkit/meshccl-wheels"
