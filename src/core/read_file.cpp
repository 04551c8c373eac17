#include "pipetrain/core/read_file.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "pipetrain/core/error.h"

namespace pipetrain {

namespace {
std::string too_big(const std::string& path, const std::string& what, const std::string& size, std::uint64_t cap) {
  return what + " '" + path + "' is " + size + " bytes, over the cap of " + std::to_string(cap) +
         " bytes for a " + what + ": check that the path names the right file";
}
}  // namespace

std::string read_file_capped(const std::string& path, const std::string& what, std::uint64_t max_bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw UsageError("cannot read " + what + " '" + path + "': " + std::strerror(errno) + "; check the path");
  if (S_ISDIR(st.st_mode))
    throw UsageError(what + " '" + path + "' is a folder, not a file: give the path of the file itself");
  if (!S_ISREG(st.st_mode))
    throw UsageError(what + " '" + path +
                     "' is not a regular file (a device, pipe or socket): save the contents to a file and pass that");
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes)
    throw UsageError(too_big(path, what, std::to_string(st.st_size), max_bytes));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("cannot read " + what + " '" + path + "': permission denied or unreadable; check the path");
  std::string out;
  out.resize(static_cast<std::size_t>(st.st_size));
  in.read(out.data(), static_cast<std::streamsize>(out.size()));
  out.resize(static_cast<std::size_t>(in.gcount()));
  // The file may have grown since stat: read on, but never past the cap.
  char buf[65536];
  while (in) {
    in.read(buf, sizeof buf);
    const auto got = static_cast<std::size_t>(in.gcount());
    if (got == 0) break;
    if (out.size() + got > max_bytes) throw UsageError(too_big(path, what, "more than " + std::to_string(max_bytes), max_bytes));
    out.append(buf, got);
  }
  return out;
}

}  // namespace pipetrain
