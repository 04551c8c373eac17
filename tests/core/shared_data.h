// Where the tests find the data vendored in the repository (data/, see data/pipedream/README.md):
// under PIPETRAIN_SOURCE_DIR, the source tree's absolute path, which CMakeLists.txt compiles into
// test_core. Nothing outside the repository is read.
#pragma once

#include <string>

#ifndef PIPETRAIN_SOURCE_DIR
#error "PIPETRAIN_SOURCE_DIR (the source tree's absolute path) must be defined; CMakeLists.txt does it for test_core"
#endif

namespace pipetrain::testing {

// PipeDream's published VGG-16 profile (data/pipedream/vgg16-graph.txt). A test that reads it must
// fail, not skip, when it is missing: the file is part of the repository.
inline std::string vgg16_path() { return std::string(PIPETRAIN_SOURCE_DIR) + "/data/pipedream/vgg16-graph.txt"; }

}  // namespace pipetrain::testing
