// type:REGEX patterns (core/pattern.h): the first line is the pattern, the rest the text searched.
#include "fuzz_common.h"
#include "pipetrain/core/pattern.h"

PIPETRAIN_FUZZ_TARGET({
  const std::size_t nl = text.find('\n');
  const pipetrain::Pattern p(text.substr(0, nl), true);
  p.search(nl == std::string::npos ? std::string() : text.substr(nl + 1));
})
