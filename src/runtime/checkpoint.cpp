#include "pipetrain/runtime/checkpoint.h"

#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>
#include <zlib.h>

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "pipetrain/core/error.h"

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
  if (dir.empty()) throw UsageError(flag + " needs a folder name, e.g. " + flag + " ckpt");
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  const std::string name = fs::path(d).filename().string();
  if (d == "/" || name == "." || name == "..")
    throw UsageError(flag + " " + dir + " names an existing folder that holds other things (the current, parent or "
                     "root folder); a checkpoint needs a folder of its own: name a new one, e.g. " + flag + " ckpt");
  return d;
}

// True when `dir` holds a pipetrain checkpoint manifest (its format field says so).
bool holds_manifest(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_regular_file(dir / "manifest.json", ec)) return false;
  try {
    const std::vector<char> bytes = read_regular_file(dir / "manifest.json", kMaxManifestBytes, std::nullopt);
    const nlohmann::json m = nlohmann::json::parse(bytes.begin(), bytes.end());
    return m.is_object() && m.value("format", std::string()) == kFormat;
  } catch (const std::exception&) {
    return false;
  }
}
bool is_empty_dir(const fs::path& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && fs::is_empty(dir, ec) && !ec;
}
// A DIR.partial we may delete: one a save of ours made (its marker), or a whole previous checkpoint
// that an exchange put there and a crash kept us from removing.
// Or one that holds nothing but the names a save writes (what a failed save's ranks left behind).
bool is_our_partial(const fs::path& p) {
  std::error_code ec;
  if (fs::exists(p / kPartialMarker, ec) || holds_manifest(p)) return true;
  for (const auto& e : fs::directory_iterator(p, ec)) {
    const std::string name = e.path().filename().string();
    const auto ends_with = [&](const std::string& tail) {
      return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    const bool ours = name == "manifest.json" || name == "manifest.json.tmp" ||
                      (name.rfind("layer-", 0) == 0 && (ends_with(".pt") || ends_with(".pt.tmp")));
    if (!ours || !e.is_regular_file(ec)) return false;
  }
  return !ec;
}

// After a failed save: this rank's own files go, and whichever rank finishes last removes the folder
// (rmdir succeeds only once it is empty; the others' files may still be being written). Only the
// leader removes the marker it made, so the folder cannot empty (and vanish) while the leader has yet
// to write: a rank that failed first used to remove it, and the leader then failed to create its file
// with "No such file or directory" instead of reporting the first rank's error. Each rank removes its
// own files before its rmdir, so the last rmdir comes after every removal and succeeds.
void remove_partial_share(const fs::path& partial, const std::vector<fs::path>& written, bool leader) {
  std::error_code ec;
  for (const auto& f : written) fs::remove(f, ec);
  if (leader) {
    fs::remove(partial / "manifest.json", ec);
    fs::remove(partial / kPartialMarker, ec);
  }
  ::rmdir(partial.c_str());
}

enum class Recover { No, Yes };
// The checks that keep a save from touching what is not ours (file comment). With Recover::Yes it also
// puts back a DIR.old left by a crash between the fallback path's two renames.
void check_save_target(const fs::path& final_dir, const fs::path& partial, const fs::path& old,
                       const std::string& flag, Recover recover) {
  std::error_code ec;
  const std::string d = final_dir.string();
  if (fs::exists(final_dir, ec) && !fs::is_directory(final_dir, ec))
    throw UsageError(flag + " " + d + " is a file, not a folder: name a folder (it is created)");
  if (fs::is_symlink(final_dir, ec))
    throw UsageError(flag + " " + d + " is a symbolic link: name the real folder (a save replaces the folder, which "
                     "would replace the link)");
  if (fs::exists(old, ec) && !(fs::is_directory(old, ec) && (holds_manifest(old) || is_empty_dir(old))))
    throw UsageError(flag + " " + d + ": " + old.string() + " exists and is not a pipetrain checkpoint; a save uses "
                     "that name for the previous checkpoint: move it away or save elsewhere");
  if (fs::exists(partial, ec) && !(fs::is_directory(partial, ec) && is_our_partial(partial)))
    throw UsageError(flag + " " + d + ": " + partial.string() + " exists and was not made by pipetrain; a save "
                     "writes there first: move it away or save elsewhere");
  if (fs::is_directory(final_dir, ec) && !holds_manifest(final_dir) && !is_empty_dir(final_dir))
    throw UsageError(flag + " " + d + " is a folder that is not a pipetrain checkpoint (no pipetrain manifest.json) "
                     "and is not empty; a save replaces the whole folder: name a new or empty folder, or an "
                     "existing checkpoint");
  if (recover == Recover::Yes && !fs::exists(final_dir, ec) && fs::is_directory(old, ec) && holds_manifest(old)) {
    fs::rename(old, final_dir);  // the previous save stopped between its renames: DIR.old is the checkpoint
    fsync_dir(final_dir.parent_path());
  }
}

// Puts the complete DIR.partial in DIR's place, and only then removes the previous checkpoint.
void swap_in(const fs::path& partial, const fs::path& final_dir, const fs::path& old) {
  const fs::path parent = final_dir.parent_path();
  std::error_code ec;
  if (!fs::exists(final_dir, ec)) {
    fs::rename(partial, final_dir);
    fsync_dir(parent);
    return;
  }
  if (::renameat2(AT_FDCWD, partial.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_dir(parent);
    fs::remove_all(partial, ec);  // now the previous checkpoint; if it stays, the next save clears it
    return;
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
    throw std::runtime_error("cannot put the new checkpoint in place of " + final_dir.string() + ": " +
                             errno_text(errno));
  // A file system without RENAME_EXCHANGE: two renames; a crash between them leaves DIR.old, which the
  // next save (or the loader's message) puts back.
  fs::remove_all(old);  // an empty or stale one (check_save_target allowed only those)
  fs::rename(final_dir, old);
  fs::rename(partial, final_dir);
  fsync_dir(parent);
  fs::remove_all(old, ec);  // if it stays, the next save clears it
}

std::string kind_of(const nlohmann::json& j) { return j.is_null() ? "absent" : j.dump(); }

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
    std::string as = kind_of(a), bs = kind_of(b);
    if (as.size() > 60) as = as.substr(0, 57) + "...";
    if (bs.size() > 60) bs = bs.substr(0, 57) + "...";
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

std::string prepare_checkpoint_dir(const std::string& dir_text, const std::string& flag) {
  const std::string dir = normalised_dir(dir_text, flag);
  const fs::path final_dir(dir), partial(dir + ".partial"), old(dir + ".old");
  check_save_target(final_dir, partial, old, flag, Recover::No);
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
  if (::mkdir(probe.c_str(), 0755) != 0)
    throw UsageError(flag + " " + dir_text + ": cannot create folders in " + parent.string() + " (" +
                     errno_text(errno) + "): pick a writable place");
  ::rmdir(probe.c_str());
  return dir;
}

void save_checkpoint(PipelineRank& rank, Transport& transport, const std::string& dir_text, const nlohmann::json& run) {
  const bool leader = transport.rank() == 0;
  std::string dir;
  // Rank 0 prepares the folder; the others wait for it (and learn of its failure through the abort).
  if (leader) {
    bool made_partial = false;
    try {
      dir = normalised_dir(dir_text, "--save");
      try {
        (void)run.dump();  // JSON text holds only UTF-8: found here, before anything is written
      } catch (const nlohmann::json::exception& e) {
        throw UsageError(std::string("the run description cannot be stored in the checkpoint manifest (") + e.what() +
                         "): store byte strings as arrays of numbers");
      }
      const fs::path final_dir(dir), partial(dir + ".partial"), old(dir + ".old");
      check_save_target(final_dir, partial, old, "--save", Recover::Yes);
      fs::remove_all(partial);  // a stale one of ours (check_save_target refused any other)
      made_partial = true;
      fs::create_directories(partial);
      write_durable(partial / kPartialMarker, "", 0);
    } catch (const std::exception& e) {
      transport.abort(std::string("cannot prepare the checkpoint folder: ") + e.what());
      if (made_partial) remove_partial_share(dir + ".partial", {}, true);
      throw;
    }
  } else {
    dir = normalised_dir(dir_text, "--save");  // the same pure function: every rank agrees
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
        for (const auto& [name, t] : rank.layer_state(layer)) dict.insert(name, t);
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
        m["run"] = run;
        const std::string text = m.dump(2) + "\n";
        write_durable(partial / "manifest.json", text.data(), text.size());
        fs::remove(partial / kPartialMarker);
        fsync_dir(partial);
        swap_in(partial, final_dir, old);
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
    if (u > static_cast<uint64_t>(hi)) throw bad(v.dump());
    return static_cast<int64_t>(u);
  }
  if (!v.is_number_integer()) throw bad(v.dump());
  const auto i = v.get<int64_t>();
  if (i < lo || i > hi) throw bad(v.dump());
  return i;
}

// The manifest, with its format, version, every field's type and range, and the layer file names
// checked (not the layer files themselves).
nlohmann::json read_manifest(const std::string& dir) {
  const fs::path d(dir), manifest_path = d / "manifest.json";
  if (!fs::is_directory(d)) {
    if (fs::is_directory(dir + ".old"))
      throw UsageError("checkpoint " + dir + " is missing but " + dir + ".old exists: a save was interrupted while "
                       "swapping folders; " + dir + ".old holds the previous checkpoint (rename it to " + dir + ")");
    throw UsageError("checkpoint folder " + dir + " does not exist: pass the folder given to --save");
  }
  if (!fs::exists(fs::symlink_status(manifest_path)))
    throw UsageError("checkpoint " + dir + " has no manifest.json: it is not a pipetrain checkpoint, or its save "
                     "did not finish");
  const std::string where = manifest_path.string();
  nlohmann::json m;
  try {
    const std::vector<char> bytes = read_regular_file(manifest_path, kMaxManifestBytes, std::nullopt);
    m = nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::exception& e) {
    throw UsageError("checkpoint manifest " + where + " is not valid JSON (" + e.what() +
                     "): the checkpoint is corrupted; use another one");
  }
  if (!m.is_object() || m.value("format", nlohmann::json()) != kFormat)
    throw UsageError(where + " is not a pipetrain checkpoint manifest (format is not '" + std::string(kFormat) + "')");
  if (m.value("version", nlohmann::json()) != kVersion)
    throw UsageError(where + " has version " + m.value("version", nlohmann::json()).dump() +
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
      throw UsageError("checkpoint manifest " + where + ": balance " + b.dump() + " is not a list of positive layer "
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
      throw UsageError("checkpoint manifest " + entry + " is for layer " + f.at("layer").dump() + ", not " +
                       std::to_string(i) + ": the checkpoint is corrupted");
    // The file must be this layer's own name inside the folder: no path, no "..", nothing outside.
    if (!f.contains("file") || !f.at("file").is_string() || f.at("file").get<std::string>() != layer_file(static_cast<int>(i)))
      throw UsageError("checkpoint manifest " + entry + " names the file " + (f.contains("file") ? f.at("file").dump() : "(none)") +
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

nlohmann::json read_checkpoint(const std::string& dir) {
  const nlohmann::json m = read_manifest(dir);
  for (const auto& f : m.at("files")) read_layer_file(dir, f);
  return m;
}

// Each rank reads, checks and loads only the layers it holds (the CLI checks the whole checkpoint once
// before ranks start, with read_checkpoint).
void load_checkpoint(PipelineRank& rank, const std::string& dir) {
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
      const std::vector<char> bytes = read_layer_file(dir, entry);
      std::lock_guard<std::mutex> lk(pickle_mutex());
      v = torch::pickle_load(bytes);
    } catch (const c10::Error& e) {
      throw UsageError("checkpoint file " + path.string() + " cannot be read: " + e.what_without_backtrace());
    }
    if (!v.isGenericDict()) throw UsageError("checkpoint file " + path.string() + " does not hold a tensor dictionary");
    std::vector<std::pair<std::string, torch::Tensor>> state;
    for (const auto& item : v.toGenericDict()) state.emplace_back(item.key().toStringRef(), item.value().toTensor());
    return state;
  };
  for (int layer : rank.local_layers()) {
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
    rank.load_layer_state(layer, state);
  }
  rank.set_step(m.at("step").get<int>());
}

}  // namespace pipetrain
