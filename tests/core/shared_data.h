// Where the tests find the project's shared data (PipeDream's VGG-16 profile): beside the repository
// (../shared) or inside it (shared/); PIPETRAIN_SHARED overrides both. Empty when absent (tests skip).
#pragma once

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

namespace pipetrain::testing {

inline std::string vgg16_path() {
  std::string root = __FILE__;
  for (int up = 0; up < 3; ++up) root = root.substr(0, root.find_last_of('/'));
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("PIPETRAIN_SHARED")) candidates.push_back(env);
  candidates.push_back(root + "/../shared");
  candidates.push_back(root + "/shared");
  for (const std::string& dir : candidates) {
    const std::string path = dir + "/data/pipedream-profiles/vgg16-graph.txt";
    if (std::ifstream(path)) return path;
  }
  return "";
}

}  // namespace pipetrain::testing
