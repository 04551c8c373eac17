#include "pipetrain/runtime/checkpoint.h"

#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include <fmt/format.h>

#include "pipetrain/core/error.h"
#include "pipetrain/core/timeline.h"

namespace pipetrain {
namespace fs = std::filesystem;

namespace {

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

std::vector<char> read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("cannot read checkpoint file " + path.string());
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes_atomic(const fs::path& path, const std::vector<char>& bytes) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) throw std::runtime_error("cannot write " + tmp.string() + " (disk full or no permission?)");
  }
  fs::rename(tmp, path);
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

void save_checkpoint(PipelineRank& rank, Transport& transport, const std::string& dir, const nlohmann::json& run) {
  if (dir.empty()) throw UsageError("the checkpoint folder name is empty: pass --save DIR");
  const fs::path final_dir(dir), partial(dir + ".partial"), old(dir + ".old");
  const bool leader = transport.rank() == 0;
  // Rank 0 prepares the folder; the others wait for it (and learn of its failure through the abort).
  if (leader) {
    try {
      if (fs::exists(final_dir) && !fs::is_directory(final_dir))
        throw UsageError("--save " + dir + " is a file, not a folder: name a folder (it is created)");
      fs::remove_all(partial);
      fs::create_directories(partial);
    } catch (const std::exception& e) {
      const std::string msg = std::string("cannot prepare the checkpoint folder: ") + e.what();
      transport.abort(msg);
      throw;
    }
  }
  transport.barrier();
  int layers = 0;
  for (int n : rank.balance()) layers += n;
  // (bytes, crc) per layer, filled by the rank that owns it (a replicated stage's first replica: its
  // replicas hold the same weights) and summed over ranks.
  torch::Tensor info = torch::zeros({layers, 2}, torch::kDouble);
  try {
    for (int layer : rank.owned_layers()) {
      c10::impl::GenericDict dict(c10::StringType::get(), c10::TensorType::get());
      for (const auto& [name, t] : rank.layer_state(layer)) dict.insert(name, t);
      const std::vector<char> bytes = torch::pickle_save(dict);
      write_bytes_atomic(partial / layer_file(layer), bytes);
      info[layer][0] = static_cast<double>(bytes.size());
      info[layer][1] = static_cast<double>(crc_of(bytes));
    }
  } catch (const std::exception& e) {
    transport.abort("rank " + std::to_string(transport.rank()) + ": saving the checkpoint failed: " + e.what());
    throw;
  }
  transport.all_reduce_sum(info);
  if (leader) {
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
    write_file_atomic((partial / "manifest.json").string(), m.dump(2) + "\n");
    fs::remove_all(old);
    if (fs::exists(final_dir)) fs::rename(final_dir, old);
    fs::rename(partial, final_dir);
    fs::remove_all(old);
  }
  transport.barrier();
}

namespace {

// The manifest, with its format, version and structure checked (not the layer files).
nlohmann::json read_manifest(const std::string& dir) {
  const fs::path d(dir), manifest_path = d / "manifest.json";
  if (!fs::is_directory(d)) {
    if (fs::is_directory(dir + ".old"))
      throw UsageError("checkpoint " + dir + " is missing but " + dir + ".old exists: a save was interrupted while "
                       "swapping folders; " + dir + ".old holds the previous checkpoint (rename it to " + dir + ")");
    throw UsageError("checkpoint folder " + dir + " does not exist: pass the folder given to --save");
  }
  if (!fs::exists(manifest_path))
    throw UsageError("checkpoint " + dir + " has no manifest.json: it is not a pipetrain checkpoint, or its save "
                     "did not finish");
  nlohmann::json m;
  try {
    const std::vector<char> bytes = read_bytes(manifest_path);
    m = nlohmann::json::parse(bytes.begin(), bytes.end());
  } catch (const nlohmann::json::exception& e) {
    throw UsageError("checkpoint manifest " + manifest_path.string() + " is not valid JSON (" + e.what() +
                     "): the checkpoint is corrupted; use another one");
  }
  if (!m.is_object() || m.value("format", std::string()) != kFormat)
    throw UsageError(manifest_path.string() + " is not a pipetrain checkpoint manifest (format is not '" +
                     std::string(kFormat) + "')");
  if (m.value("version", 0) != kVersion)
    throw UsageError(manifest_path.string() + " has version " + m.value("version", nlohmann::json()).dump() +
                     "; this pipetrain reads version " + std::to_string(kVersion));
  try {
    const int layers = m.at("layers").get<int>();
    const auto& files = m.at("files");
    if (!files.is_array() || static_cast<int>(files.size()) != layers)
      throw UsageError("checkpoint manifest " + manifest_path.string() + " lists " + std::to_string(files.size()) +
                       " layer files for " + std::to_string(layers) + " layers: the checkpoint is corrupted");
    m.at("step").get<int>();
    for (const auto& f : files) {
      f.at("file").get<std::string>();
      f.at("bytes").get<int64_t>();
      f.at("crc32").get<uint32_t>();
    }
  } catch (const nlohmann::json::exception& e) {
    throw UsageError("checkpoint manifest " + manifest_path.string() + " lacks a field or has a wrong type (" +
                     e.what() + "): the checkpoint is corrupted");
  }
  return m;
}

// The bytes of layer file `f` (a manifest entry), checked against its recorded size and CRC-32.
std::vector<char> read_layer_file(const std::string& dir, const nlohmann::json& f) {
  const fs::path path = fs::path(dir) / f.at("file").get<std::string>();
  if (!fs::exists(path))
    throw UsageError("checkpoint file " + path.string() + " is missing: the checkpoint is incomplete; use another one");
  const std::vector<char> bytes = read_bytes(path);
  const auto want_bytes = f.at("bytes").get<int64_t>();
  if (static_cast<int64_t>(bytes.size()) != want_bytes)
    throw UsageError("checkpoint file " + path.string() + " has " + std::to_string(bytes.size()) +
                     " bytes but the manifest says " + std::to_string(want_bytes) +
                     ": it is truncated or was changed; use another checkpoint");
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
  for (int layer : rank.local_layers()) {
    const nlohmann::json& entry = m.at("files").at(static_cast<std::size_t>(layer));
    const fs::path path = fs::path(dir) / entry.at("file").get<std::string>();
    c10::IValue v;
    try {
      v = torch::pickle_load(read_layer_file(dir, entry));
    } catch (const c10::Error& e) {
      throw UsageError("checkpoint file " + path.string() + " cannot be read: " + e.what_without_backtrace());
    }
    if (!v.isGenericDict()) throw UsageError("checkpoint file " + path.string() + " does not hold a tensor dictionary");
    std::vector<std::pair<std::string, torch::Tensor>> state;
    for (const auto& item : v.toGenericDict()) state.emplace_back(item.key().toStringRef(), item.value().toTensor());
    rank.load_layer_state(layer, state);
  }
  rank.set_step(m.at("step").get<int>());
}

}  // namespace pipetrain
