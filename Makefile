# make demo | make test | make build | make deps | make clean
# Variables: TORCH_DIR=/path/to/share/cmake/Torch picks another LibTorch (e.g. a pip PyTorch's);
#            BUILD_TYPE (Release), JOBS (all cores), CMAKE_ARGS (passed to cmake as they are).
BUILD_DIR  := build
BUILD_TYPE ?= Release
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
ifneq ($(strip $(TORCH_DIR)),)
CMAKE_ARGS += -DTorch_DIR=$(TORCH_DIR)
endif

.PHONY: all deps build demo test clean
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
	  --trace $(BUILD_DIR)/demo/train-trace.json --save $(BUILD_DIR)/demo/checkpoint
	./$(BUILD_DIR)/pipetrain demo --out $(BUILD_DIR)/demo

test: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j2

clean:
	rm -rf $(BUILD_DIR)
