# make demo | make test | make build | make deps | make clean | make fuzz | make test-sanitize-core
# make test-libtorch2: the suite against Debian 13's LibTorch 2.6, in a Debian 13 root under build/debian13
# make python: the Python module alone (no LibTorch build), in build-python/python; `make build` builds it too
# Variables: TORCH_DIR=/path/to/share/cmake/Torch picks another LibTorch (e.g. a pip PyTorch's);
#            BUILD_TYPE (Release), JOBS (all cores), CMAKE_ARGS (passed to cmake as they are);
#            SANITIZE=address,undefined (or thread): `make test` builds in build-san-<list> with
#            -fsanitize=<list> and runs the suite there; FUZZ_SECONDS (60): time per fuzz target;
#            FUZZ_MAX_LEN (4096): largest fuzz input in bytes.
comma      := ,
BUILD_DIR  := build
SANITIZE   ?=
ifneq ($(strip $(SANITIZE)),)
BUILD_DIR  := build-san-$(subst $(comma),-,$(SANITIZE))
CMAKE_ARGS += -DPIPETRAIN_SANITIZE=$(SANITIZE)
endif
FUZZ_SECONDS ?= 60
FUZZ_MAX_LEN ?= 4096
FUZZ_TARGETS := action schedule_csv torch_csv profile_json pipedream plan plan_file config json pattern
BUILD_TYPE ?= Release
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
ifneq ($(strip $(TORCH_DIR)),)
CMAKE_ARGS += -DTorch_DIR=$(TORCH_DIR)
endif

.PHONY: all deps build demo test clean fuzz fuzz-build test-sanitize-core test-libtorch2 python
all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(CMAKE_ARGS)
	cmake --build $(BUILD_DIR) -j$(JOBS)

# The main job: a GPT learns the King James Bible on 2 pipeline stages (1f1b), about 2 minutes on 2 cores;
# then the schedule gallery (timelines of every schedule, simulated).
demo: build
	mkdir -p $(BUILD_DIR)/demo
	./$(BUILD_DIR)/pipetrain train --log $(BUILD_DIR)/demo/train-log.jsonl --svg $(BUILD_DIR)/demo/train-timeline.svg \
	  --trace $(BUILD_DIR)/demo/train-trace.json --save $(BUILD_DIR)/demo/checkpoint --overwrite
	./$(BUILD_DIR)/pipetrain demo --out $(BUILD_DIR)/demo

test: build
	cd $(BUILD_DIR) && LSAN_OPTIONS=suppressions=$(CURDIR)/scripts/lsan.supp ctest --output-on-failure -j2

# libFuzzer over the torch-free parsers (fuzz/): clang, ASan+UBSan, no LibTorch. Each target runs
# FUZZ_SECONDS; new inputs go to build-fuzz/corpus/<target> (fuzz/corpus/<target> is the seed corpus,
# read only); a crash leaves build-fuzz/crash-* and stops with its target's name.
fuzz-build:
	CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPIPETRAIN_FUZZ=ON $(CMAKE_ARGS)
	cmake --build build-fuzz -j$(JOBS) --target $(addprefix fuzz_,$(FUZZ_TARGETS))

fuzz: fuzz-build
	@set -e; for t in $(FUZZ_TARGETS); do \
	  mkdir -p build-fuzz/corpus/$$t; \
	  echo "fuzz_$$t: $(FUZZ_SECONDS) s"; \
	  ./build-fuzz/fuzz_$$t -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 -max_len=$(FUZZ_MAX_LEN) \
	    -artifact_prefix=build-fuzz/crash-$$t- -print_final_stats=1 build-fuzz/corpus/$$t fuzz/corpus/$$t \
	    2>build-fuzz/fuzz_$$t.log || { tail -40 build-fuzz/fuzz_$$t.log; echo "fuzz_$$t found a crash"; exit 1; }; \
	  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" build-fuzz/fuzz_$$t.log; \
	done

# The torch-free tests under ASan+UBSan (a few minutes on 2 cores): CI's quick memory-safety check.
test-sanitize-core:
	cmake -S . -B build-san-core -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPIPETRAIN_CORE_ONLY=ON \
	  -DPIPETRAIN_SANITIZE=address,undefined $(CMAKE_ARGS)
	cmake --build build-san-core -j$(JOBS) --target test_core
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 ASAN_OPTIONS=detect_leaks=1 ./build-san-core/test_core

# The same source tree against Debian 13's LibTorch 2.6 (scripts/test-libtorch2.sh): a Debian 13 root made
# with debootstrap once (build/debian13/root, reused), the build dependencies installed there, a build in
# build/debian13-build and the whole ctest suite. Needs root; JOBS and BUILD_TYPE apply, CTEST_ARGS too.
# PYTHON_ONLY=1: the torch-free core and the Python module only, and the Python tests (pipetrain.torch against
# Debian 13's PyTorch 2.6), in build/debian13-python: minutes instead of a LibTorch build.
test-libtorch2:
	JOBS=$(JOBS) BUILD_TYPE=$(BUILD_TYPE) bash scripts/test-libtorch2.sh

# The Python module over the torch-free layers (python/), built without LibTorch, and its own tests.
python: deps
	cmake -S . -B build-python -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DPIPETRAIN_CORE_ONLY=ON -DPIPETRAIN_PYTHON=ON $(CMAKE_ARGS)
	cmake --build build-python -j$(JOBS) --target pipetrain_python
	cd build-python && ctest --output-on-failure -R '^Python\.'
	@echo "use it: PYTHONPATH=$(CURDIR)/build-python/python python3 -c 'import pipetrain'"

clean:
	rm -rf $(BUILD_DIR)
