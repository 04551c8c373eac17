#include "pipetrain/runtime/checkpoint.h"

#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>
#include <zlib.h>

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "pipetrain/core/error.h"
#include "pipetrain/core/json_limits.h"

namespace pipetrain {
namespace fs = std::filesystem;

namespace {

// LibTorch's pickler keeps process-wide caches (type names among them) that it fills without a lock:
// ThreadSanitizer reports a race when two in-process ranks (the local transport's threads) load their
// layers at the same time. Pickling is serialised per process; ranks in separate processes are unaffected.
std::mutex& pickle_mutex() {
  static std::mutex mu;
  return mu;
}

constexpr const char* kFormat = "pipetrain-checkpoint";
constexpr int kVersion = 1;

std::string layer_file(int layer) { return fmt::format("layer-{:05d}.pt", layer); }

uint32_t crc_of(const std::vector<char>& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  std::size_t at = 0;
  while (at < bytes.size()) {  // zlib takes at most uInt bytes per call
    const auto n = static_cast<uInt>(std::min<std::size_t>(bytes.size() - at, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + at), n);
    at += n;
  }
  return static_cast<uint32_t>(crc);
}

// Caps on what a reader takes from a checkpoint folder (anything larger is refused before it is read).
constexpr int64_t kMaxManifestBytes = int64_t{64} << 20;   // 64 MiB: a million layers' entries
constexpr int64_t kMaxLayerFileBytes = int64_t{1} << 42;   // 4 TiB: no layer of a real model is larger
constexpr int64_t kMaxLayers = 1000000;
constexpr const char* kPartialMarker = ".pipetrain-partial";

std::string errno_text(int err) { return std::strerror(err); }

// A JSON value as a short excerpt for messages (never the whole of a crafted manifest).
std::string short_json(const nlohmann::json& v) { return json_excerpt(v, 60); }

// Reads a regular file that is not a symbolic link, at most `max_bytes` (and, when given, exactly
// `expect` bytes: a size that differs is refused before anything is read). Throws UsageError naming the
// file and what is wrong.
std::vector<char> read_regular_file(const fs::path& path, int64_t max_bytes, std::optional<int64_t> expect) {
  // O_NONBLOCK: opening a FIFO planted in the folder must not block; O_NOFOLLOW: no symlinks.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP)
      throw UsageError("checkpoint file " + path.string() + " is a symbolic link: a checkpoint's files must be "
                       "regular files inside its folder; copy the real file there (cp -L)");
    if (err == ENOENT)
      throw UsageError("checkpoint file " + path.string() + " is missing: the checkpoint is incomplete; use another one");
    throw UsageError("cannot read checkpoint file " + path.string() + ": " + errno_text(err));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw UsageError("cannot read checkpoint file " + path.string() + ": " + errno_text(errno));
  if (!S_ISREG(st.st_mode))
    throw UsageError("checkpoint file " + path.string() + " is not a regular file (a folder, device or pipe): "
                     "the checkpoint is corrupted; use another one");
  const int64_t size = static_cast<int64_t>(st.st_size);
  if (expect && size != *expect)
    throw UsageError("checkpoint file " + path.string() + " has " + std::to_string(size) +
                     " bytes but the manifest says " + std::to_string(*expect) +
                     ": it is truncated or was changed; use another checkpoint");
  if (size > max_bytes)
    throw UsageError("checkpoint file " + path.string() + " has " + std::to_string(size) + " bytes, more than the " +
                     std::to_string(max_bytes) + " a file of this kind may have: it is not a pipetrain checkpoint file");
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  std::vector<char> bytes(static_cast<std::size_t>(size));
  std::size_t at = 0;
  while (at < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + at, bytes.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw UsageError("checkpoint file " + path.string() + " shrank while it was read (" + std::to_string(at) + " of " +
                       std::to_string(size) + " bytes): is another run writing it?");
    at += static_cast<std::size_t>(n);
  }
  return bytes;
}

void fsync_path(const fs::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + path.string() + " to flush it: " + errno_text(errno));
  const int r = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (r != 0) throw std::runtime_error("cannot flush " + path.string() + " to disk: " + errno_text(err));
}
void fsync_dir(const fs::path& dir) { fsync_path(dir.empty() ? fs::path(".") : dir, O_RDONLY | O_DIRECTORY); }

// Writes `bytes` to `path` through path.tmp, flushed to disk before the rename.
void write_durable(const fs::path& path, const char* data, std::size_t size) {
  const fs::path tmp = path.string() + ".tmp";
  const auto error = [&](const std::string& what, int err) {
    return std::runtime_error(what + " " + tmp.string() + ": " + errno_text(err) +
                              (err == ENOSPC || err == EDQUOT ? " (the disk is full: free space or save elsewhere)" : ""));
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw error("cannot create", errno);
  auto fail = [&](const std::string& what) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    throw error(what, err);
  };
  std::size_t at = 0;
  while (at < size) {
    const ssize_t n = ::write(fd, data + at, size - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("cannot write");
    at += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) fail("cannot flush");
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw std::runtime_error("cannot close " + tmp.string() + ": " + errno_text(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw std::runtime_error("cannot rename " + tmp.string() + ": " + errno_text(err));
  }
}

// The folder name of a --save/--resume argument without trailing slashes; refuses names that cannot be
// a checkpoint folder of their own.
std::string normalised_dir(const std::string& dir, const std::string& flag) {
  const std::string example = flag.rfind("--", 0) == 0 ? ", e.g. " + flag + " ckpt" : "";
  if (dir.empty()) throw UsageError(flag + " needs a folder name" + example);
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  const std::string name = fs::path(d).filename().string();
  if (d == "/" || name == "." || name == "..")
    throw UsageError(flag + " " + dir + " names an existing folder that holds other things (the current, parent or "
                     "root folder); a checkpoint needs a folder of its own: name a new one" + example);
  return d;
}

// What a save may prove to be its own. A save deletes or replaces nothing else (file comment):
//  - DIR.partial with our marker: a save of ours that is running (its leader holds an flock on the
//    marker) or failed; only the names a save writes may be in it.
//  - DIR.partial without the marker: the checkpoint DIR replaced, left by a stop before its removal.
//    Proof: DIR's manifest records the size and CRC-32 of the manifest it replaced ("replaces").
//  - DIR.old (the two-rename fallback only): likewise, DIR's, or a complete DIR.partial's, predecessor.
//  - DIR itself: a checkpoint (our manifest) holding nothing but its manifest and the files it lists.

// The size and CRC-32 of a manifest's bytes: what a newer manifest records under "replaces".
struct Fingerprint {
  int64_t bytes = -1;
  uint32_t crc32 = 0;
  bool operator==(const Fingerprint& o) const { return bytes == o.bytes && crc32 == o.crc32; }
};

// A checkpoint manifest found on disk, read leniently (no UsageError): absent when `dir` holds none,
// or one that is not a pipetrain manifest, or one that is not valid JSON.
struct FoundManifest {
  nlohmann::json json;
  Fingerprint fingerprint;
};
std::optional<FoundManifest> find_manifest(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_regular_file(fs::symlink_status(dir / "manifest.json", ec))) return std::nullopt;
  try {
    const std::vector<char> bytes = read_regular_file(dir / "manifest.json", kMaxManifestBytes, std::nullopt);
    FoundManifest f{parse_json_text(std::string_view(bytes.data(), bytes.size()), (dir / "manifest.json").string()),
                    {static_cast<int64_t>(bytes.size()), crc_of(bytes)}};
    if (!f.json.is_object() || f.json.value("format", std::string()) != kFormat) return std::nullopt;
    return f;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The fingerprint a manifest records for the checkpoint it replaced, if any.
std::optional<Fingerprint> replaced_by(const std::optional<FoundManifest>& m) {
  if (!m || !m->json.contains("replaces") || !m->json.at("replaces").is_object()) return std::nullopt;
  const nlohmann::json& r = m->json.at("replaces");
  if (!r.contains("bytes") || !r.contains("crc32") || !r.at("bytes").is_number_integer() ||
      !r.at("crc32").is_number_unsigned())
    return std::nullopt;
  return Fingerprint{r.at("bytes").get<int64_t>(), r.at("crc32").get<uint32_t>()};
}
// True when `older` is the checkpoint that `newer`'s manifest says it replaced.
bool replaced(const std::optional<FoundManifest>& newer, const std::optional<FoundManifest>& older) {
  const std::optional<Fingerprint> r = replaced_by(newer);
  return r && older && *r == older->fingerprint;
}

bool is_empty_dir(const fs::path& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && fs::is_empty(dir, ec) && !ec;
}

// The names in `dir`, sorted (at most `limit`, then "..." when there are more).
std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}
std::string name_list(const std::vector<std::string>& names) {
  std::string s;
  for (std::size_t i = 0; i < names.size() && i < 3; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > 3) s += fmt::format(" and {} more", names.size() - 3);
  return s;
}

// The entries of `dir` that a checkpoint with manifest `m` does not account for: anything but
// manifest.json and the layer files it lists.
std::vector<std::string> foreign_in_checkpoint(const fs::path& dir, const nlohmann::json& m) {
  std::set<std::string> listed{"manifest.json"};
  if (m.contains("files") && m.at("files").is_array())
    for (const auto& f : m.at("files"))
      if (f.is_object() && f.contains("file") && f.at("file").is_string()) listed.insert(f.at("file").get<std::string>());
  std::vector<std::string> out;
  for (const std::string& n : names_in(dir)) {
    std::error_code ec;
    if (!listed.count(n) || !fs::is_regular_file(fs::symlink_status(dir / n, ec))) out.push_back(n);
  }
  return out;
}

// The entries of a marked DIR.partial that a save does not write: anything but the marker, the
// manifest and layer files (and their .tmp forms).
bool save_writes(const std::string& name) {
  const auto ends_with = [&](const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (name == kPartialMarker || name == "manifest.json" || name == "manifest.json.tmp") return true;
  if (name.rfind("layer-", 0) != 0) return false;
  const std::string digits = name.substr(6, name.find('.') == std::string::npos ? 0 : name.find('.') - 6);
  const bool numbered = !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos;
  return numbered && (ends_with(".pt") || ends_with(".pt.tmp"));
}
std::vector<std::string> foreign_in_partial(const fs::path& dir) {
  std::vector<std::string> out;
  for (const std::string& n : names_in(dir)) {
    std::error_code ec;
    if (!save_writes(n) || !fs::is_regular_file(fs::symlink_status(dir / n, ec))) out.push_back(n);
  }
  return out;
}

// Removes the named files from `dir`, then `dir` itself if that empties it. Returns true when `dir` is gone.
bool remove_files_then_dir(const fs::path& dir, const std::vector<std::string>& names) {
  std::error_code ec;
  for (const std::string& n : names) fs::remove(dir / n, ec);
  return ::rmdir(dir.c_str()) == 0 || errno == ENOENT;
}
// Removes a checkpoint we proved ours: its manifest's files and the manifest, then the folder.
bool remove_checkpoint(const fs::path& dir, const nlohmann::json& m) {
  std::vector<std::string> names;
  for (const auto& f : m.at("files"))
    if (f.is_object() && f.contains("file") && f.at("file").is_string()) {
      const std::string n = f.at("file").get<std::string>();
      if (n.find('/') == std::string::npos && n != "." && n != "..") names.push_back(n);
    }
  names.push_back("manifest.json");
  return remove_files_then_dir(dir, names);
}

// An exclusive, non-blocking flock on a marker file: held by a save's leader from the marker's creation
// until the new checkpoint is in place, so a second run saving to the same DIR is told so.
class MarkerLock {
 public:
  MarkerLock() = default;
  MarkerLock(const MarkerLock&) = delete;
  MarkerLock& operator=(const MarkerLock&) = delete;
  ~MarkerLock() { release(); }
  // True when the lock was taken (or the marker is gone); false when a saving run holds it. The saver
  // takes it exclusive; a check takes it shared, so that the ranks of one run checking at once never
  // see each other as a saver.
  bool take(const fs::path& marker, bool exclusive = true) {
    release();
    fd_ = ::open(marker.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd_ < 0) return true;
    if (::flock(fd_, (exclusive ? LOCK_EX : LOCK_SH) | LOCK_NB) == 0) return true;
    release();
    return false;
  }
  void release() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

// After a failed save: each rank removes the files it wrote, if it still runs: a transport stops a
// process whose peer aborted (shm's and gloo's watchdogs _Exit it), often before it gets here. So the
// leader gives the others a moment (2 s) to remove theirs, so that the folder cannot vanish while another
// rank has yet to write (that rank would then fail with "No such file or directory" instead of the first
// rank's error); then it removes what is left of what a save writes (layer files, manifest, their .tmp
// forms: the folder is marked ours, so only those names can be a save's), the marker and the folder. A
// folder that then still holds something else stays, marked; the next save proves it its own and clears
// it. Where the leader itself is stopped first (another rank failed), the marked folder stays for the
// next save likewise; DIR, the previous checkpoint, is untouched either way.
void remove_partial_share(const fs::path& partial, const std::vector<fs::path>& written, bool leader) {
  std::error_code ec;
  for (const auto& f : written) {
    fs::remove(f, ec);
    fs::remove(f.string() + ".tmp", ec);
  }
  if (!leader) return;
  fs::remove(partial / "manifest.json", ec);
  fs::remove(partial / "manifest.json.tmp", ec);
  const auto only_marker_left = [&] {
    const std::vector<std::string> left = names_in(partial);
    return left.empty() || (left.size() == 1 && left[0] == kPartialMarker);
  };
  for (int waited_ms = 0; waited_ms < 2000 && !only_marker_left(); waited_ms += 10) ::usleep(10 * 1000);
  if (!only_marker_left() && foreign_in_partial(partial).empty())  // the stopped ranks' files
    for (const std::string& n : names_in(partial))
      if (n != kPartialMarker) fs::remove(partial / n, ec);
  if (only_marker_left()) {
    fs::remove(partial / kPartialMarker, ec);
    ::rmdir(partial.c_str());
  }
}

enum class Recover { No, Yes };

// Why DIR itself may not be replaced by a save (empty when it may): a symbolic link, a file, or a folder
// holding anything that is not a checkpoint's (see above). `current` is DIR's manifest, if any.
std::string target_blocker(const fs::path& final_dir, const std::optional<FoundManifest>& current,
                           const std::string& flag) {
  std::error_code ec;
  const std::string d = final_dir.string();
  if (fs::is_symlink(final_dir, ec))
    return flag + " " + d + " is a symbolic link: name the real folder (a save replaces the folder, which would "
           "replace the link)";
  if (fs::exists(final_dir, ec) && !fs::is_directory(final_dir, ec))
    return flag + " " + d + " is a file, not a folder: name a folder (it is created)";
  if (fs::is_directory(final_dir, ec) && !is_empty_dir(final_dir)) {
    if (!current)
      return flag + " " + d + " is a folder that is not a pipetrain checkpoint (no pipetrain manifest.json) and is "
             "not empty (it holds " + name_list(names_in(final_dir)) + "); a save replaces the whole folder: name a "
             "new or empty folder, or an existing checkpoint";
    const std::vector<std::string> foreign = foreign_in_checkpoint(final_dir, current->json);
    if (!foreign.empty())
      return flag + " " + d + " is a pipetrain checkpoint that also holds " + name_list(foreign) +
             ", which the checkpoint does not list; a save replaces the whole folder: move " +
             (foreign.size() == 1 ? "it" : "them") + " out of " + d + ", or save elsewhere";
  }
  return std::string();
}

// The checks that keep a save from touching what is not ours (see above). With Recover::Yes (the
// leader, at save time) it also clears what it proved ours: a failed save's marked DIR.partial, the
// previous checkpoint a stop left in DIR.partial or DIR.old, and finishes a two-rename swap that a stop
// interrupted (no DIR, a complete DIR.partial that replaced DIR.old).
// Returns why DIR itself may not be replaced (target_blocker; empty when it may): Recover::No throws it
// as a UsageError; Recover::Yes returns it, so that the save can still keep the new checkpoint elsewhere
// (a file that appeared in DIR during the run must not cost the run its training).
std::string check_save_target(const fs::path& final_dir, const fs::path& partial, const fs::path& old,
                              const std::string& flag, Recover recover) {
  std::error_code ec;
  const std::string d = final_dir.string();
  // A stop between the fallback's two renames: no DIR, the new checkpoint complete in DIR.partial
  // (unmarked) and the one it replaced in DIR.old. The save at hand finishes that swap first.
  if (!fs::exists(fs::symlink_status(final_dir, ec)) &&
      !fs::exists(fs::symlink_status(partial / kPartialMarker, ec))) {
    const std::optional<FoundManifest> newer = find_manifest(partial), older = find_manifest(old);
    if (replaced(newer, older) && foreign_in_checkpoint(partial, newer->json).empty() &&
        foreign_in_checkpoint(old, older->json).empty()) {
      if (recover == Recover::No) return std::string();  // provably ours; the save finishes it
      fs::rename(partial, final_dir);
      fsync_dir(final_dir.parent_path());
      remove_checkpoint(old, older->json);
    }
  }
  const std::optional<FoundManifest> current = find_manifest(final_dir);
  const std::string blocker = target_blocker(final_dir, current, flag);
  if (!blocker.empty() && recover == Recover::No) throw UsageError(blocker);
  if (fs::exists(fs::symlink_status(partial, ec))) {
    const std::optional<FoundManifest> left = find_manifest(partial);
    const bool marked = fs::is_regular_file(fs::symlink_status(partial / kPartialMarker, ec));
    // A kill between the save's last marker removal and its rename leaves the run's newest checkpoint,
    // complete, in DIR.partial (it replaces DIR's, or it is the first): it was called foreign, and the
    // advice to move it away lost it. Nothing is moved here; the message says how to continue from it.
    if (fs::is_directory(fs::symlink_status(partial, ec)) && !marked && left &&
        (replaced(left, current) || (!current && !fs::exists(fs::symlink_status(final_dir, ec)))) &&
        foreign_in_checkpoint(partial, left->json).empty()) {
      const auto step_of = [](const FoundManifest& f) {
        return f.json.contains("step") && f.json["step"].is_number_integer() ? std::to_string(f.json["step"].get<int64_t>())
                                                                            : std::string("?");
      };
      const std::string p = partial.string();
      if (current)  // provably the save after DIR's: its manifest names DIR's as what it replaces
        throw UsageError(flag + " " + d + ": " + p + " holds a complete checkpoint at step " + step_of(*left) +
                         ", newer than " + d + "'s (step " + step_of(*current) + "): a save was stopped before its "
                         "last rename, so it is this run's newest checkpoint. Nothing was deleted; make it " + d +
                         " and continue from it: mv " + d + " " + d + ".step-" + step_of(*current) + " && mv " + p +
                         " " + d + ", then --resume " + d);
      throw UsageError(flag + " " + d + ": " + p + " holds a complete checkpoint at step " + step_of(*left) +
                       " and " + d + " does not exist: a first save stopped before its last rename leaves this (or it "
                       "was copied there). Nothing was deleted; if it is this run's, make it " + d + ": mv " + p + " " +
                       d + ", then --resume " + d + "; otherwise move it away");
    }
    if (!fs::is_directory(fs::symlink_status(partial, ec)) || (!marked && !replaced(current, left)))
      throw UsageError(flag + " " + d + ": " + partial.string() + " exists and was not made by pipetrain (or "
                       "cannot be proved to be a checkpoint that " + d + " replaced); a save writes there first: "
                       "move it away or save elsewhere");
    if (marked) {
      const std::vector<std::string> foreign = foreign_in_partial(partial);
      if (!foreign.empty())
        throw UsageError(flag + " " + d + ": " + partial.string() + " is a save's unfinished folder but also holds " +
                         name_list(foreign) + ", which a save does not write: move it away or save elsewhere");
      MarkerLock probe;
      if (!probe.take(partial / kPartialMarker, /*exclusive=*/false))
        throw UsageError(flag + " " + d + ": another run is saving to " + d + " now (it holds " + partial.string() +
                         "): wait for it to finish, or save elsewhere");
    } else {
      const std::vector<std::string> foreign = foreign_in_checkpoint(partial, left->json);
      if (!foreign.empty())
        throw UsageError(flag + " " + d + ": " + partial.string() + " is the checkpoint " + d + " replaced but also "
                         "holds " + name_list(foreign) + ": move it away or save elsewhere");
    }
    if (recover == Recover::Yes) {
      if (marked) {
        remove_files_then_dir(partial, names_in(partial));
      } else {
        remove_checkpoint(partial, left->json);
      }
      if (fs::exists(partial, ec))
        throw UsageError(flag + " " + d + ": cannot clear " + partial.string() + ", left by an earlier save: remove it");
    }
  }
  if (fs::exists(fs::symlink_status(old, ec)) && recover == Recover::Yes) {
    const std::optional<FoundManifest> previous = find_manifest(old);
    if (previous && fs::is_directory(fs::symlink_status(old, ec)) && replaced(current, previous) &&
        foreign_in_checkpoint(old, previous->json).empty())
      remove_checkpoint(old, previous->json);  // the fallback's leftover: DIR replaced it
  }
  return blocker;
}

// The checkpoint in DIR.partial (complete, manifest written) takes DIR's place, and only then is the
// previous one removed, file by file from its manifest (a stop before the removal leaves it in
// DIR.partial, where the next save proves it ours). `previous` is DIR's manifest, if DIR held one.
void swap_in(const fs::path& partial, const fs::path& final_dir, const fs::path& old,
             const std::optional<FoundManifest>& previous) {
  const fs::path parent = final_dir.parent_path();
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(final_dir, ec))) {
    fs::rename(partial, final_dir);
    fsync_dir(parent);
    return;
  }
  if (::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_dir(parent);
    if (previous) remove_checkpoint(partial, previous->json);
    else ::rmdir(partial.c_str());  // DIR was an empty folder
    return;
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
    throw std::runtime_error("cannot put the new checkpoint in place of " + final_dir.string() + ": " +
                             errno_text(errno));
  // A file system without RENAME_EXCHANGE: two renames, through DIR.old. That name must be free: a
  // DIR.old that this save cannot prove its own (check_save_target cleared the provable ones) stays.
  if (fs::exists(fs::symlink_status(old, ec)))
    throw UsageError("cannot put the new checkpoint in place of " + final_dir.string() + ": this file system cannot "
                     "exchange folders, and the fallback needs the name " + old.string() + ", which holds something "
                     "pipetrain did not make: move it away and save again");
  fs::rename(final_dir, old);
  fs::rename(partial, final_dir);  // a stop before this: the next save finishes the swap (check_save_target)
  fsync_dir(parent);
  if (previous) remove_checkpoint(old, previous->json);
  else ::rmdir(old.c_str());
}

// Whether `dir` is a mount point (its own file system, or the root of one): a rename cannot replace it.
bool is_mount_point(const fs::path& dir) {
  struct stat self {}, up {};
  const fs::path parent = fs::absolute(dir).lexically_normal().parent_path();
  if (::stat(dir.c_str(), &self) != 0 || ::stat(parent.c_str(), &up) != 0) return false;
  return S_ISDIR(self.st_mode) && (self.st_dev != up.st_dev || self.st_ino == up.st_ino);
}

// A complete, unmarked DIR.partial that may not replace DIR: renamed to DIR.step-N (or DIR.step-N-2 ...,
// never over an existing name), so that the next save's DIR.partial does not meet it; where no such name
// is free (or the rename fails) it stays in DIR.partial. Returns where it is.
fs::path keep_aside(const fs::path& partial, const std::string& dir, int step) {
  for (int k = 1; k <= 9; ++k) {
    const fs::path to(dir + ".step-" + std::to_string(step) + (k > 1 ? "-" + std::to_string(k) : ""));
    if (::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) {
      try {
        fsync_dir(to.parent_path());
      } catch (const std::exception&) {
      }
      return to;
    }
    if (errno == EEXIST) continue;
    if (errno == EINVAL || errno == ENOSYS || errno == ENOTSUP) {  // no RENAME_NOREPLACE: check, then rename
      std::error_code ec;
      if (fs::exists(fs::symlink_status(to, ec))) continue;
      if (::rename(partial.c_str(), to.c_str()) == 0) return to;
    }
    break;
  }
  return partial;
}

std::string kind_of(const nlohmann::json& j) { return j.is_null() ? "absent" : short_json(j); }

void diff(const nlohmann::json& a, const nlohmann::json& b, const std::string& path, std::vector<std::string>& out) {
  if (a.is_object() && b.is_object()) {
    std::set<std::string> keys;
    for (auto it = a.begin(); it != a.end(); ++it) keys.insert(it.key());
    for (auto it = b.begin(); it != b.end(); ++it) keys.insert(it.key());
    for (const auto& k : keys)
      diff(a.contains(k) ? a.at(k) : nlohmann::json(), b.contains(k) ? b.at(k) : nlohmann::json(), path + "." + k, out);
    return;
  }
  if (a != b) {
    const std::string as = kind_of(a), bs = kind_of(b);
    out.push_back(path + ": " + as + " in the checkpoint, " + bs + " in this run");
  }
}

}  // namespace

std::vector<std::string> run_differences(const nlohmann::json& saved, const nlohmann::json& now,
                                         const std::vector<std::string>& keys) {
  std::vector<std::string> out;
  for (const auto& k : keys)
    diff(saved.contains(k) ? saved.at(k) : nlohmann::json(), now.contains(k) ? now.at(k) : nlohmann::json(), k, out);
  return out;
}

namespace {

constexpr const char* kLockHeader = "pipetrain run lock";

// The lock file's text (at most 512 bytes): what its holder wrote, for the other run's message.
std::string read_lock_text(int fd) {
  char buf[512] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

// "pid 123 on host" from a holder's text; "another process" when it wrote none (yet).
std::string holder_of(const std::string& text) {
  const std::string head = std::string(kLockHeader) + ": ";
  if (text.rfind(head, 0) != 0) return "another process";
  std::string who = text.substr(head.size());
  while (!who.empty() && (who.back() == '\n' || who.back() == '\r')) who.pop_back();
  for (char& c : who)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return who.empty() ? "another process" : who.substr(0, 200);
}

UsageError locked_error(const std::string& flag, const std::string& dir, const std::string& path,
                        const std::string& text) {
  return UsageError(flag + " " + dir + ": another run is saving to " + dir + " (" + holder_of(text) +
                    " holds its lock " + path + "): wait for that run to end or stop it, or save elsewhere");
}

UsageError foreign_lock_error(const std::string& flag, const std::string& dir, const std::string& path) {
  return UsageError(flag + " " + dir + ": " + path + " exists and was not written by pipetrain (a run saving to " +
                    dir + " locks that file): move it away, or save elsewhere");
}

std::string host_name() {
  char h[256] = {};
  if (::gethostname(h, sizeof h - 1) != 0) return "this host";
  return h;
}

}  // namespace

CheckpointDirLock::CheckpointDirLock(const std::string& dir_text, const std::string& flag) {
  const std::string dir = normalised_dir(dir_text, flag);
  path_ = dir + ".pipetrain-lock";
  std::error_code ec;
  fs::create_directories(fs::absolute(fs::path(dir)).parent_path(), ec);
  // Lock, then check that the name still refers to the locked file: a holder removes the file while it
  // holds the lock, so a lock taken on a removed file is retried on the new one.
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0644);
    if (fd < 0) {
      const int err = errno;
      throw UsageError(flag + " " + dir + ": cannot create its lock file " + path_ + " (" + errno_text(err) +
                       (err == ELOOP ? ": a symbolic link" : "") + "): pick a writable place");
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      throw foreign_lock_error(flag, dir, path_);
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      const std::string text = read_lock_text(fd);
      ::close(fd);
      if (err == EWOULDBLOCK) throw locked_error(flag, dir, path_, text);
      throw UsageError(flag + " " + dir + ": cannot lock " + path_ + " (" + errno_text(err) + "): this file system "
                       "has no flock; save to a local folder");
    }
    struct stat now {};
    if (::stat(path_.c_str(), &now) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino) {
      const std::string text = read_lock_text(fd);
      if (!text.empty() && text.rfind(kLockHeader, 0) != 0) {  // a user's file of that name: not ours to write
        ::close(fd);
        throw foreign_lock_error(flag, dir, path_);
      }
      const std::string mine = std::string(kLockHeader) + ": pid " + std::to_string(::getpid()) + " on " + host_name() + "\n";
      if (::ftruncate(fd, 0) == 0 && ::pwrite(fd, mine.data(), mine.size(), 0) < 0) {
        // The text is only for messages: the flock is the lock.
      }
      fd_ = fd;
      return;
    }
    ::close(fd);
    if (attempt >= 100)
      throw UsageError(flag + " " + dir + ": cannot lock " + path_ + ": it keeps being replaced (another run is "
                       "starting or ending there?): try again, or save elsewhere");
  }
}

CheckpointDirLock::~CheckpointDirLock() {
  if (fd_ < 0) return;
  // Removed while held (the constructor's check makes a waiting taker retry on a new file), then released.
  struct stat st {}, now {};
  if (::fstat(fd_, &st) == 0 && ::stat(path_.c_str(), &now) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino)
    ::unlink(path_.c_str());
  ::close(fd_);
}

void check_checkpoint_dir_unlocked(const std::string& dir_text, const std::string& flag) {
  const std::string dir = normalised_dir(dir_text, flag);
  const std::string path = dir + ".pipetrain-lock";
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return;  // no lock file (or not ours to open): CheckpointDirLock says more when it is taken
  if (::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
    const std::string text = read_lock_text(fd);
    ::close(fd);
    throw locked_error(flag, dir, path, text);
  }
  ::close(fd);
}

std::string prepare_checkpoint_dir(const std::string& dir_text, const std::string& flag) {
  const std::string dir = normalised_dir(dir_text, flag);
  const fs::path final_dir(dir), partial(dir + ".partial"), old(dir + ".old");
  check_save_target(final_dir, partial, old, flag, Recover::No);
  // A save renames a new folder over DIR: a mount point (a container's volume, a disk) cannot be, and the
  // whole run's training was lost at its first save ("Device or resource busy").
  if (is_mount_point(final_dir))
    throw UsageError(flag + " " + dir_text + " is a mount point (a file system of its own): a save puts a new "
                     "folder in its place by renaming, which a mount point cannot take: save to a folder inside it, "
                     "e.g. " + flag + " " + (fs::path(dir) / "run1").string());
  // The ranks a launcher started run this too, while their rank 0 may hold the lock already: only a
  // process that no launcher started probes (the run's rank 0 refuses a held lock when it takes it).
  if (!std::getenv("RANK") && !std::getenv("OMPI_COMM_WORLD_RANK")) check_checkpoint_dir_unlocked(dir, flag);
  const fs::path parent = fs::absolute(final_dir).parent_path();
  std::error_code ec;
  fs::create_directories(parent, ec);
  std::error_code is_dir_ec;
  if (ec && !fs::is_directory(parent, is_dir_ec))  // another rank may have made it meanwhile: that is fine
    throw UsageError(flag + " " + dir_text + ": cannot create the folder " + parent.string() + " (" + ec.message() +
                     "): pick a writable place");
  // Probe: the save will create DIR.partial in the parent and rename it; create and remove a folder there
  // now. Every rank of a run probes at start-up, at the same moment: the probe's name is this process's
  // and this call's own, so two probes never meet (with one shared name, a rank whose mkdir came second
  // failed with "File exists").
  static std::atomic<unsigned> probes{0};
  const fs::path probe(dir + ".probe-" + std::to_string(::getpid()) + "-" + std::to_string(probes++));
  if (::mkdir(probe.c_str(), 0755) != 0) {
    if (errno == ENAMETOOLONG)  // the name alone fits, not with the suffixes a save adds
      throw UsageError(flag + " " + excerpt(dir_text) + ": the folder's name is too long for the names a save makes "
                       "beside it (it adds .partial, .pipetrain-lock, .step-N): use a name of at most 200 characters");
    throw UsageError(flag + " " + dir_text + ": cannot create folders in " + parent.string() + " (" +
                     errno_text(errno) + "): pick a writable place");
  }
  ::rmdir(probe.c_str());
  return dir;
}

void save_checkpoint(PipelineRank& rank, Transport& transport, const std::string& dir_text, const nlohmann::json& run) {
  const bool leader = transport.rank() == 0;
  std::string dir;
  MarkerLock lock;  // the leader's, from the marker's creation until the swap
  std::string blocked;  // the leader's: why DIR may not be replaced (empty: it may)
  std::optional<FoundManifest> previous;
  // Rank 0 prepares the folder; the others wait for it (and learn of its failure through the abort).
  if (leader) {
    bool made_partial = false;
    try {
      dir = normalised_dir(dir_text, "checkpoint folder");
      try {
        (void)run.dump();  // JSON text holds only UTF-8: found here, before anything is written
      } catch (const nlohmann::json::exception& e) {
        throw UsageError(std::string("the run description cannot be stored in the checkpoint manifest (") + e.what() +
                         "): store byte strings as arrays of numbers");
      }
      const fs::path final_dir(dir), partial(dir + ".partial"), old(dir + ".old");
      blocked = check_save_target(final_dir, partial, old, "checkpoint folder", Recover::Yes);
      // DIR cannot be replaced (a file appeared in it during the run): the save still writes the whole
      // checkpoint, then keeps it beside DIR (keep_aside) instead of losing the run's training.
      if (blocked.empty()) previous = find_manifest(final_dir);
      // mkdir, not create_directories: a folder that appeared since the check (another run's save) is
      // not ours to write into.
      if (::mkdir(partial.c_str(), 0755) != 0) {
        const int err = errno;
        throw UsageError("cannot create " + partial.string() + ": " + errno_text(err) +
                         (err == EEXIST ? " (another run is saving to " + dir + " now: wait for it, or save elsewhere)"
                                        : std::string()));
      }
      made_partial = true;
      write_durable(partial / kPartialMarker, "", 0);
      if (!lock.take(partial / kPartialMarker))
        throw UsageError("another run is saving to " + dir + " now: wait for it, or save elsewhere");
    } catch (const std::exception& e) {
      transport.abort(std::string("cannot prepare the checkpoint folder: ") + e.what());
      if (made_partial) remove_partial_share(dir + ".partial", {}, true);
      throw;
    }
  } else {
    dir = normalised_dir(dir_text, "checkpoint folder");  // the same pure function: every rank agrees
  }
  const fs::path final_dir(dir), partial(dir + ".partial"), old(dir + ".old");
  try {
    transport.barrier();
  } catch (...) {
    // Another rank may pass the barrier, fail and abort before this one leaves it: the leader still
    // removes the folder it made (a marker was left behind when it did not).
    if (leader) remove_partial_share(partial, {}, true);
    throw;
  }
  int layers = 0;
  for (int n : rank.balance()) layers += n;
  // (bytes, crc) per layer, filled by the rank that owns it (a replicated stage's first replica: its
  // replicas hold the same weights) and summed over ranks.
  torch::Tensor info = torch::zeros({layers, 2}, torch::kDouble);
  bool swapped = false;
  std::vector<fs::path> written;  // this rank's files in DIR.partial
  try {
    try {
      for (int layer : rank.owned_layers()) {
        c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
        for (const auto& [name, t] : rank.layer_state(layer)) {
          // A diverged run's weights are not saved over the last good checkpoint.
          if (t.is_floating_point() && !torch::isfinite(t).all().item<bool>())
            throw NonFiniteError("tensor '" + name + "' of layer " + std::to_string(layer) + " holds NaN or infinite "
                                 "values (the run diverged): not saved; the previous checkpoint is kept");
          dict.insert(name, t);
        }
        const std::vector<char> bytes = [&] {
          std::lock_guard<std::mutex> lk(pickle_mutex());
          return torch::pickle_save(dict);
        }();
        written.push_back(partial / layer_file(layer));
        write_durable(written.back(), bytes.data(), bytes.size());
        info[layer][0] = static_cast<double>(bytes.size());
        info[layer][1] = static_cast<double>(crc_of(bytes));
      }
    } catch (const std::exception& e) {
      transport.abort("rank " + std::to_string(transport.rank()) + ": saving the checkpoint failed: " + e.what());
      throw;
    }
    transport.all_reduce_sum(info);
    if (leader) {
      try {
        nlohmann::json m;
        m["format"] = kFormat;
        m["version"] = kVersion;
        m["step"] = rank.step();
        m["layers"] = layers;
        m["stages"] = rank.schedule().stages;
        m["balance"] = rank.balance();
        m["files"] = nlohmann::json::array();
        for (int l = 0; l < layers; ++l)
          m["files"].push_back({{"layer", l},
                                {"file", layer_file(l)},
                                {"bytes", static_cast<int64_t>(info[l][0].item<double>())},
                                {"crc32", static_cast<uint32_t>(info[l][1].item<double>())}});
        // What this checkpoint replaces, so that the next save can prove a leftover of it its own.
        if (previous) m["replaces"] = {{"bytes", previous->fingerprint.bytes}, {"crc32", previous->fingerprint.crc32}};
        m["run"] = run;
        const std::string text = m.dump(2) + "\n";
        written.push_back(partial / "manifest.json");
        write_durable(written.back(), text.data(), text.size());
        fs::remove(partial / kPartialMarker);
        fsync_dir(partial);
        // Checked again at the swap: a file may have appeared in DIR while the layers were written.
        if (blocked.empty()) blocked = target_blocker(final_dir, find_manifest(final_dir), "checkpoint folder");
        if (!blocked.empty()) {
          const fs::path kept = keep_aside(partial, dir, rank.step());
          swapped = true;  // complete and unmarked: none of it is removed
          throw UsageError(
              "the checkpoint at step " + std::to_string(rank.step()) + " is complete in " + kept.string() +
              " but did not replace " + dir + ": " + blocked + ". Nothing was deleted; continue from it with --resume " +
              kept.string());
        }
        try {
          swap_in(partial, final_dir, old, previous);
        } catch (const std::exception& e) {
          // The checkpoint is complete: a swap that fails (DIR a mount point: EBUSY; another file system:
          // EXDEV; a sticky folder DIR is not ours in: EPERM) keeps it aside instead of deleting the run.
          swapped = true;
          if (!fs::exists(fs::symlink_status(partial / "manifest.json"))) throw;  // the swap moved it already
          const fs::path kept = keep_aside(partial, dir, rank.step());
          throw UsageError("the checkpoint at step " + std::to_string(rank.step()) + " is complete in " + kept.string() +
                           " but could not take the place of " + dir + " (" + e.what() + "). Nothing was deleted; "
                           "continue from it with --resume " + kept.string() +
                           (is_mount_point(final_dir) ? std::string(" (") + dir + " is a mount point, which a rename "
                                                        "cannot replace: save to a folder inside it)"
                                                      : std::string()));
        }
        swapped = true;
      } catch (const std::exception& e) {
        transport.abort(std::string("rank 0: finishing the checkpoint failed: ") + e.what());
        throw;
      }
    }
  } catch (...) {
    // The previous checkpoint (DIR) is untouched; what this save wrote goes.
    if (!swapped) remove_partial_share(partial, written, leader);
    throw;
  }
  lock.release();
  transport.barrier();
}

namespace {

// A whole number in [lo, hi] at m[key], or UsageError naming the manifest, the key and the range.
int64_t bounded_integer(const nlohmann::json& m, const std::string& key, int64_t lo, int64_t hi,
                        const std::string& where) {
  const auto bad = [&](const std::string& got) {
    return UsageError("checkpoint manifest " + where + ": " + key + " is " + got + ", not a whole number in " +
                      std::to_string(lo) + ".." + std::to_string(hi) + ": the checkpoint is corrupted");
  };
  if (!m.contains(key)) throw bad("missing");
  const nlohmann::json& v = m.at(key);
  if (v.is_number_unsigned()) {
    const auto u = v.get<uint64_t>();
    if (u < static_cast<uint64_t>(std::max<int64_t>(lo, 0)) || u > static_cast<uint64_t>(hi)) throw bad(short_json(v));
    return static_cast<int64_t>(u);
  }
  if (!v.is_number_integer()) throw bad(short_json(v));
  const auto i = v.get<int64_t>();
  if (i < lo || i > hi) throw bad(short_json(v));
  return i;
}

// The manifest, with its format, version, every field's type and range, and the layer file names
// checked (not the layer files themselves).
nlohmann::json read_manifest(const std::string& dir) {
  const fs::path d(dir), manifest_path = d / "manifest.json";
  if (!fs::is_directory(d)) {
    if (fs::is_directory(dir + ".old"))
      throw UsageError("checkpoint " + dir + " is missing but " + dir + ".old exists: if a save was interrupted while "
                       "swapping folders, " + dir + ".old holds the previous checkpoint (rename it to " + dir + ")");
    std::error_code ec;
    const fs::path partial = dir + ".partial";
    if (!fs::exists(fs::symlink_status(d, ec)) && !fs::exists(fs::symlink_status(partial / kPartialMarker, ec)) &&
        find_manifest(partial))
      throw UsageError("checkpoint folder " + dir + " does not exist, but " + partial.string() + " holds a complete "
                       "checkpoint (a save stopped before its last rename): mv " + partial.string() + " " + dir +
                       ", then --resume " + dir);
    if (fs::is_regular_file(d, ec))  // the manifest or a layer file given for its folder: a common slip
      throw UsageError("checkpoint " + dir + " is a file; a checkpoint is the folder a save wrote" +
                       (d.has_parent_path() ? ": pass " + d.parent_path().string() : std::string(": pass its folder")));
    throw UsageError("checkpoint folder " + dir + " does not exist: pass the folder a save wrote");
  }
  if (!fs::exists(fs::symlink_status(manifest_path)))
    throw UsageError("checkpoint " + dir + " has no manifest.json: it is not a pipetrain checkpoint, or its save "
                     "did not finish");
  const std::string where = manifest_path.string();
  const std::vector<char> bytes = read_regular_file(manifest_path, kMaxManifestBytes, std::nullopt);
  const nlohmann::json m = parse_json_text(std::string_view(bytes.data(), bytes.size()), "checkpoint manifest " + where);
  if (!m.is_object() || m.value("format", nlohmann::json()) != kFormat)
    throw UsageError(where + " is not a pipetrain checkpoint manifest (format is not '" + std::string(kFormat) + "')");
  if (m.value("version", nlohmann::json()) != kVersion)
    throw UsageError(where + " has version " + short_json(m.value("version", nlohmann::json())) +
                     "; this pipetrain reads version " + std::to_string(kVersion));
  const int64_t layers = bounded_integer(m, "layers", 1, kMaxLayers, where);
  bounded_integer(m, "step", 0, INT_MAX, where);
  bounded_integer(m, "stages", 1, layers, where);
  if (m.contains("balance")) {
    const auto& b = m.at("balance");
    int64_t sum = 0;
    bool ok = b.is_array() && !b.empty() && static_cast<int64_t>(b.size()) <= layers;
    for (std::size_t i = 0; ok && i < b.size(); ++i) {
      ok = b[i].is_number_integer() && b[i].get<int64_t>() >= 1 && b[i].get<int64_t>() <= layers;
      if (ok) sum += b[i].get<int64_t>();
    }
    if (!ok || sum != layers)
      throw UsageError("checkpoint manifest " + where + ": balance " + short_json(b) + " is not a list of positive layer "
                       "counts that add up to its " + std::to_string(layers) + " layers: the checkpoint is corrupted");
  }
  const auto& files = m.contains("files") ? m.at("files") : nlohmann::json();
  if (!files.is_array() || static_cast<int64_t>(files.size()) != layers)
    throw UsageError("checkpoint manifest " + where + " lists " + (files.is_array() ? std::to_string(files.size()) : "no") +
                     " layer files for " + std::to_string(layers) + " layers: the checkpoint is corrupted");
  for (std::size_t i = 0; i < files.size(); ++i) {
    const auto& f = files[i];
    const std::string entry = where + " files[" + std::to_string(i) + "]";
    if (!f.is_object()) throw UsageError("checkpoint manifest " + entry + " is not an object: the checkpoint is corrupted");
    if (bounded_integer(f, "layer", 0, layers - 1, entry) != static_cast<int64_t>(i))
      throw UsageError("checkpoint manifest " + entry + " is for layer " + short_json(f.at("layer")) + ", not " +
                       std::to_string(i) + ": the checkpoint is corrupted");
    // The file must be this layer's own name inside the folder: no path, no "..", nothing outside.
    if (!f.contains("file") || !f.at("file").is_string() || f.at("file").get<std::string>() != layer_file(static_cast<int>(i)))
      throw UsageError("checkpoint manifest " + entry + " names the file " + (f.contains("file") ? short_json(f.at("file")) : "(none)") +
                       "; a checkpoint's layer " + std::to_string(i) + " is " + layer_file(static_cast<int>(i)) +
                       " inside its folder: the manifest is corrupted or crafted; use another checkpoint");
    bounded_integer(f, "bytes", 0, kMaxLayerFileBytes, entry);
    bounded_integer(f, "crc32", 0, UINT32_MAX, entry);
  }
  return m;
}

// The bytes of layer file `f` (a manifest entry, checked by read_manifest), checked against its
// recorded size (before reading) and CRC-32.
std::vector<char> read_layer_file(const std::string& dir, const nlohmann::json& f) {
  const fs::path path = fs::path(dir) / f.at("file").get<std::string>();
  const std::vector<char> bytes = read_regular_file(path, kMaxLayerFileBytes, f.at("bytes").get<int64_t>());
  if (crc_of(bytes) != f.at("crc32").get<uint32_t>())
    throw UsageError("checkpoint file " + path.string() + " fails its CRC-32 check: it is corrupted; use another "
                     "checkpoint");
  return bytes;
}

}  // namespace

namespace {

// The manifest's fingerprint now (bytes -1 when it cannot be read).
Fingerprint manifest_fingerprint(const std::string& dir) {
  const std::optional<FoundManifest> m = find_manifest(dir);
  return m ? m->fingerprint : Fingerprint{};
}

// Runs `read` (reads of DIR's layer files under the manifest `before`); when it fails and DIR's manifest
// has changed meanwhile, says that a save replaced the checkpoint (a false "corrupted" otherwise).
template <class F>
auto unless_replaced(const std::string& dir, const Fingerprint& before, F&& read) {
  try {
    return read();
  } catch (const UsageError&) {
    if (!(manifest_fingerprint(dir) == before))
      throw UsageError("checkpoint " + dir + " was replaced by a save while it was read (another run saves there): "
                       "read it again once that save is done, or stop that run");
    throw;
  }
}

}  // namespace

nlohmann::json read_checkpoint(const std::string& dir) {
  const Fingerprint before = manifest_fingerprint(dir);
  const nlohmann::json m = read_manifest(dir);
  unless_replaced(dir, before, [&] {
    for (const auto& f : m.at("files")) read_layer_file(dir, f);
    return 0;
  });
  return m;
}

// Each rank reads, checks and loads only the layers it holds (the CLI checks the whole checkpoint once
// before ranks start, with read_checkpoint).
void load_checkpoint(PipelineRank& rank, const std::string& dir) {
  const Fingerprint before = manifest_fingerprint(dir);
  const nlohmann::json m = read_manifest(dir);
  int layers = 0;
  for (int n : rank.balance()) layers += n;
  if (m.at("layers").get<int>() != layers)
    throw UsageError("checkpoint " + dir + " holds " + std::to_string(m.at("layers").get<int>()) +
                     " layers but this model has " + std::to_string(layers) + ": it was saved from another model");
  auto read_state = [&](int layer) {
    const nlohmann::json& entry = m.at("files").at(static_cast<std::size_t>(layer));
    const fs::path path = fs::path(dir) / entry.at("file").get<std::string>();
    c10::IValue v;
    try {
      const std::vector<char> bytes = unless_replaced(dir, before, [&] { return read_layer_file(dir, entry); });
      std::lock_guard<std::mutex> lk(pickle_mutex());
      v = torch::pickle_load(bytes);
    } catch (const c10::Error& e) {
      throw UsageError("checkpoint file " + path.string() + " cannot be read: " + e.what_without_backtrace());
    }
    if (!v.isGenericDict()) throw UsageError("checkpoint file " + path.string() + " does not hold a tensor dictionary");
    // Weights or optimizer state with NaN or infinity (saved from a run that diverged) would train NaN.
    std::vector<std::pair<std::string, torch::Tensor>> state;
    for (const auto& item : v.toGenericDict()) {
      if (!item.key().isString() || !item.value().isTensor())
        throw UsageError("checkpoint file " + path.string() + " holds an entry that is not a named tensor");
      const std::string& name = item.key().toStringRef();
      const torch::Tensor t = item.value().toTensor();
      if (t.is_floating_point() && !torch::isfinite(t).all().item<bool>())
        throw UsageError("checkpoint file " + path.string() + ": tensor '" + name + "' of layer " +
                         std::to_string(layer) + " holds NaN or infinite values (saved from a run that diverged): "
                         "resume from an earlier checkpoint");
      state.emplace_back(name, t);
    }
    return state;
  };
  auto layer_state_of = [&](int layer) {
    std::vector<std::pair<std::string, torch::Tensor>> state = read_state(layer);
    // A tied parameter stored with another layer: its tensors (parameter and optimizer state) under
    // this layer's name for it.
    for (const auto& [name, source] : rank.tied_sources(layer)) {
      if (source.layer < 0 || source.layer >= layers)
        throw UsageError("tied parameter " + name + " of layer " + std::to_string(layer) + " is stored with layer " +
                         std::to_string(source.layer) + ", which checkpoint " + dir + " does not have");
      const std::string param = "param/" + source.name, optim = "optim/" + source.name + "/";
      for (auto& [key, t] : read_state(source.layer)) {
        if (key == param) state.emplace_back("param/" + name, t);
        if (key.rfind(optim, 0) == 0) state.emplace_back("optim/" + name + "/" + key.substr(optim.size()), t);
      }
    }
    return state;
  };
  // Two passes, so that a refusal leaves this rank as it was (it loaded the layers before the bad one,
  // and their step, and trained on with the mixture): every file is read and checked (size, CRC-32,
  // finite values) and each parameter found with the model's type and shape first; then read again and
  // loaded. One layer's tensors in memory at a time, as before; the files are read twice.
  for (int layer : rank.local_layers()) {
    std::map<std::string, torch::Tensor> saved;
    for (auto& [name, t] : layer_state_of(layer)) saved.emplace(name, t);
    const std::string at = "layer " + std::to_string(layer);
    auto same = [&](const std::string& name, const torch::Tensor& got, const torch::Tensor& like) {
      if (got.scalar_type() != like.scalar_type())
        throw UsageError(at + " tensor '" + name + "' is " + c10::toString(got.scalar_type()) + " in the checkpoint but " +
                         c10::toString(like.scalar_type()) + " in the model: convert it, or build the model with that type");
      if (got.sizes() != like.sizes())
        throw UsageError(at + " tensor '" + name + "' has shape " + c10::str(got.sizes()) + " in the checkpoint but " +
                         c10::str(like.sizes()) + " in the model");
    };
    // The model's parameters and buffers (a tied member stored elsewhere has the shape of its source).
    std::map<std::string, torch::Tensor> params;  // parameter key -> the model's tensor (or the source's)
    std::set<std::string> buffers;
    for (const auto& [name, now] : rank.layer_state(layer)) {
      const bool param = name.rfind("param/", 0) == 0, buffer = name.rfind("buffer/", 0) == 0;
      if (!param && !buffer) continue;
      const auto it = saved.find(name);
      if (it == saved.end()) throw UsageError(at + " has no tensor '" + name + "' in the checkpoint");
      same(name, it->second, now);
      if (param) params[name.substr(6)] = now;
      if (buffer) buffers.insert(name);
    }
    for (const auto& [name, source] : rank.tied_sources(layer)) {
      const auto it = saved.find("param/" + name);
      if (it != saved.end()) params[name] = it->second;
    }
    // Every other entry is optimizer state of one of those parameters, shaped like it: anything else is
    // refused here, before a tensor is loaded (load_layer_state refused it after copying the parameters).
    for (const auto& [name, t] : saved) {
      if (name.rfind("param/", 0) == 0 || name.rfind("buffer/", 0) == 0) {
        if (name.rfind("param/", 0) == 0 ? !params.count(name.substr(6)) : !buffers.count(name))
          throw UsageError(at + " checkpoint holds '" + name + "', which this model does not have: was it saved "
                           "with another model?");
        continue;
      }
      const std::size_t slash = name.rfind('/');
      const std::string param = name.rfind("optim/", 0) == 0 && slash > 6 ? name.substr(6, slash - 6) : std::string();
      const std::string kind = slash == std::string::npos ? std::string() : name.substr(slash + 1);
      if (param.empty() || !params.count(param) ||
          (kind != "step" && kind != "exp_avg" && kind != "exp_avg_sq" && kind != "momentum_buffer"))
        throw UsageError(at + " checkpoint holds '" + name + "', which this model and optimizer do not have: was it "
                         "saved with another model or optimizer?");
      if (kind != "step") same(name, t, params[param]);
      if (kind == "step")
        for (const char* part : {"exp_avg", "exp_avg_sq"})
          if (!saved.count("optim/" + param + "/" + part))
            throw UsageError(at + " has no tensor 'optim/" + param + "/" + part + "' in the checkpoint");
    }
  }
  for (int layer : rank.local_layers()) rank.load_layer_state(layer, layer_state_of(layer));
  rank.set_step(m.at("step").get<int>());
}

}  // namespace pipetrain
