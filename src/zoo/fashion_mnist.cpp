// Fashion-MNIST (zoo/data.h): our own IDX parser over zlib, and the epoch-permuted training stream.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <limits>
#include <mutex>
#include <utility>

#include "pipetrain/core/error.h"
#include "seeded.h"
#include "pipetrain/zoo/data.h"

namespace pipetrain::zoo {
namespace {

constexpr uint32_t kImagesMagic = 0x00000803;  // unsigned bytes, 3 dimensions
constexpr uint32_t kLabelsMagic = 0x00000801;  // unsigned bytes, 1 dimension
constexpr int64_t kClasses = 10;
const char* const kInstallFix =
    "install the Debian package dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or pass "
    "--data-dir DIR holding train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
    "t10k-labels-idx1-ubyte (each plain or .gz)";


std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// A file read through zlib: gzread passes plain files through unchanged, so one path serves both.
class GzReader {
 public:
  explicit GzReader(const std::string& path) : path_(path), file_(open(path)) {
    if (!file_)
      throw UsageError("cannot open " + path + ": " + std::strerror(errno ? errno : ENOMEM) +
                       ": pass a readable IDX file");
    gzbuffer(file_, 1 << 20);
  }
  ~GzReader() { gzclose(file_); }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;

  // Reads up to n bytes; returns how many were read (fewer only at the end of the file).
  std::size_t read(void* dst, std::size_t n) {
    std::size_t done = 0;
    while (done < n) {
      const unsigned chunk = static_cast<unsigned>(std::min<std::size_t>(n - done, 1u << 30));
      const int got = gzread(file_, static_cast<char*>(dst) + done, chunk);
      if (got < 0) {
        int code = 0;
        const char* msg = gzerror(file_, &code);
        throw UsageError(path_ + " is corrupt (zlib: " + (msg ? msg : "error") +
                         "): replace the file with an intact copy");
      }
      if (got == 0) break;
      done += static_cast<std::size_t>(got);
    }
    return done;
  }

  void read_exactly(void* dst, std::size_t n, std::size_t offset, const std::string& promise) {
    const std::size_t got = read(dst, n);
    if (got != n)
      throw UsageError(path_ + " ends after " + std::to_string(offset + got) + " bytes, but " + promise + " needs " +
                       std::to_string(offset + n) + ": the file is truncated; replace it");
  }

 private:
  // gzopen leaves errno at 0 when it fails for want of memory, so a stale errno must not survive into it.
  static gzFile open(const std::string& path) {
    errno = 0;
    return gzopen(path.c_str(), "rb");
  }

  std::string path_;
  gzFile file_;
};

uint32_t big_endian(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// Parses an IDX file of unsigned bytes with `dims` dimensions; returns uint8 with those dimensions.
torch::Tensor read_idx(const std::string& path, uint32_t magic, const char* what) {
  GzReader in(path);
  unsigned char header[4 * 4];
  const std::size_t dims = magic & 0xff;
  const std::size_t header_bytes = 4 * (1 + dims);
  const std::size_t got = in.read(header, header_bytes);
  if (got >= 4 && big_endian(header) != magic)
    throw UsageError(path + ": magic number " + hex32(big_endian(header)) + " is not " + hex32(magic) + " (" + what +
                     "): pass an IDX file of " + what);
  if (got != header_bytes)
    throw UsageError(path + " ends after " + std::to_string(got) + " bytes, inside its " +
                     std::to_string(header_bytes) + "-byte IDX header: the file is truncated; replace it");
  std::vector<int64_t> shape;
  uint64_t total = 1;
  std::string shape_text;
  for (std::size_t d = 0; d < dims; ++d) {
    const uint32_t n = big_endian(header + 4 * (d + 1));
    if (n == 0)
      throw UsageError(path + ": dimension " + std::to_string(d) + " of the IDX header is 0: pass a non-empty " + what +
                       " file");
    shape.push_back(n);
    total *= n;  // at most three 32-bit factors; the bound below rejects anything near overflow
    shape_text += (d ? " x " : "") + std::to_string(n);
    if (total > (uint64_t{1} << 36))
      throw UsageError(path + ": IDX header promises " + shape_text +
                       "... bytes (over 64 GiB): the header is "
                       "corrupt; replace the file");
  }
  torch::Tensor out = torch::empty(shape, torch::kUInt8);
  const std::string promise = "its header (" + shape_text + ")";
  in.read_exactly(out.data_ptr<uint8_t>(), static_cast<std::size_t>(total), header_bytes, promise);
  unsigned char extra;
  if (in.read(&extra, 1) != 0)
    throw UsageError(path + " holds more than the " + std::to_string(header_bytes + total) + " bytes " + promise +
                     " declares: the file is corrupt or not " + what + "; replace it");
  return out;
}

// The path of `base` in `dir`: plain if present, else with .gz.
std::string find_idx(const std::string& dir, const std::string& base) {
  for (const std::string& candidate : {dir + "/" + base, dir + "/" + base + ".gz"}) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(candidate, ec)) return candidate;
  }
  throw UsageError("Fashion-MNIST file " + dir + "/" + base + "(.gz) not found: " + kInstallFix);
}

struct Split {
  torch::Tensor images;  // uint8 [N, rows, cols]
  torch::Tensor labels;  // uint8 [N]
};

Split load_split(const std::string& dir, const std::string& prefix) {
  const std::string images_path = find_idx(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = find_idx(dir, prefix + "-labels-idx1-ubyte");
  Split s;
  try {
    s.images = read_idx_images(images_path);
    s.labels = read_idx_labels(labels_path);
  } catch (const UsageError& e) {
    throw UsageError(std::string(e.what()) + " (Fashion-MNIST: " + kInstallFix + ")");
  }
  if (s.images.size(0) != s.labels.size(0))
    throw UsageError(images_path + " holds " + std::to_string(s.images.size(0)) + " images but " + labels_path +
                     " holds " + std::to_string(s.labels.size(0)) + " labels: the files do not belong together; " +
                     kInstallFix);
  const int64_t max_label = s.labels.max().item<int64_t>();
  if (max_label >= kClasses) {
    const int64_t at = (s.labels >= kClasses).nonzero().flatten()[0].item<int64_t>();
    throw UsageError(labels_path + ": label " + std::to_string(s.labels[at].item<int64_t>()) + " at index " +
                     std::to_string(at) + " is outside 0.." + std::to_string(kClasses - 1) +
                     ": the file is not Fashion-MNIST labels; " + kInstallFix);
  }
  return s;
}

class FashionMnist : public Dataset {
 public:
  FashionMnist(Split train, Split test, uint64_t seed)
      : train_(std::move(train)), test_(std::move(test)), seed_(seed), n_(train_.images.size(0)) {}

  std::string name() const override { return "fashion-mnist"; }
  int64_t train_size() const override { return n_; }
  int64_t eval_size() const override { return test_.images.size(0); }

  Batch batch(int64_t step, int64_t batch_size) override {
    if (step < 0) throw UsageError("batch step " + std::to_string(step) + " must be >= 0");
    if (batch_size < 1) throw UsageError("batch size " + std::to_string(batch_size) + " must be >= 1");
    if (step > std::numeric_limits<int64_t>::max() / batch_size - 1)
      throw UsageError("batch step " + std::to_string(step) + " x batch size " + std::to_string(batch_size) +
                       " overflows the sample counter: use fewer steps");
    // Global positions [p, p + batch_size) of the endless epoch stream, one run per epoch touched.
    torch::Tensor index = torch::empty({batch_size}, torch::kLong);
    int64_t p = step * batch_size, j = 0;
    while (j < batch_size) {
      const int64_t epoch = p / n_, offset = p % n_, len = std::min(n_ - offset, batch_size - j);
      index.slice(0, j, j + len).copy_(permutation(epoch).slice(0, offset, offset + len));
      j += len;
      p += len;
    }
    return samples(train_, index);
  }

  Batch eval_batch(int64_t begin, int64_t count) override {
    const int64_t m = eval_size();
    if (begin < 0 || count < 0 || begin > m - count)
      throw UsageError("held-out samples [" + std::to_string(begin) + ", " + std::to_string(begin + count) +
                       ") are outside the " + std::to_string(m) + " Fashion-MNIST test images: use a range in [0, " +
                       std::to_string(m) + ")");
    return {normalise(test_.images.slice(0, begin, begin + count)),
            test_.labels.slice(0, begin, begin + count).to(torch::kLong)};
  }

 private:
  static torch::Tensor normalise(const torch::Tensor& pixels) {
    return pixels.unsqueeze(1).to(torch::kFloat).mul_(1.0 / 255.0).sub_(kFashionMnistMean).div_(kFashionMnistStd);
  }
  static Batch samples(const Split& s, const torch::Tensor& index) {
    return {normalise(s.images.index_select(0, index)), s.labels.index_select(0, index).to(torch::kLong)};
  }

  // The permutation of epoch `e`. A run walks epochs in order (and a step touches at most a few), so a
  // short most-recently-used list is enough to draw each permutation once.
  torch::Tensor permutation(int64_t e) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      if (it->first == e) {
        auto hit = *it;
        cache_.erase(it);
        cache_.push_front(hit);
        return hit.second;
      }
    }
    at::Generator g = seeded_generator(seed_, static_cast<uint64_t>(e));
    torch::Tensor perm = torch::randperm(n_, g, torch::kLong);
    cache_.emplace_front(e, perm);
    if (cache_.size() > 4) cache_.pop_back();
    return perm;
  }

  Split train_, test_;
  uint64_t seed_;
  int64_t n_;
  std::mutex mutex_;
  std::deque<std::pair<int64_t, torch::Tensor>> cache_;  // (epoch, permutation), most recent first
};

}  // namespace

torch::Tensor read_idx_images(const std::string& path) {
  return read_idx(path, kImagesMagic, "unsigned-byte images, 3 dimensions");
}

torch::Tensor read_idx_labels(const std::string& path) {
  return read_idx(path, kLabelsMagic, "unsigned-byte labels, 1 dimension");
}

std::unique_ptr<Dataset> make_fashion_mnist(const std::string& dir, uint64_t seed) {
  Split train = load_split(dir, "train");
  Split test = load_split(dir, "t10k");
  if (train.images.sizes().slice(1).vec() != test.images.sizes().slice(1).vec())
    throw UsageError("Fashion-MNIST in " + dir + ": training images are " + std::to_string(train.images.size(1)) + "x" +
                     std::to_string(train.images.size(2)) + " but test images " + std::to_string(test.images.size(1)) +
                     "x" + std::to_string(test.images.size(2)) + "; " + kInstallFix);
  return std::make_unique<FashionMnist>(std::move(train), std::move(test), seed);
}

}  // namespace pipetrain::zoo
