// Data sets for training runs. A Dataset hands out mini-batches by step number, deterministically
// from its seed, so every rank (and a resumed run) sees the same batch for the same step; only the
// ranks holding the first and last stages use it.
//
// What is here:
//   synthetic tokens / classes  generated on the fly, endless, no held-out split;
//   Fashion-MNIST               the real 60,000 + 10,000 28x28 images from IDX files (Debian's
//                               dataset-fashion-mnist), read with our own IDX parser;
//   text                        a character-level language-model corpus from any string, e.g. the King
//                               James Bible (load_kjv, Debian's bible-kjv) or a file (read_text_file).
//
// Threads: the data sets made here may be used from several threads at once (their caches are locked).
// Errors: a missing or malformed file, a bad argument or an unknown character throws UsageError naming the
// value and the fix.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>

namespace pipetrain {
struct TrainData;  // runtime/trainer.h
}

namespace pipetrain::zoo {

struct Batch {
  torch::Tensor input;   // stage 0's input
  torch::Tensor target;  // the loss function's target
  torch::Tensor mask;    // variable-length samples (make_text_lines): bool [B, T], true on real tokens
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::string name() const = 0;
  // The training mini-batch of `step` (batch_size samples). A pure function of (seed, step,
  // batch_size): a resumed run that starts at step k gets the same batches as an uninterrupted one.
  // Finite data sets walk a permutation of the training split per epoch (seeded by seed and epoch).
  virtual Batch batch(int64_t step, int64_t batch_size) = 0;
  // Samples in the training split per epoch (0: generated, endless).
  virtual int64_t train_size() const { return 0; }
  // Samples in the held-out split (0: none), and samples [begin, begin + count) of it, in file order.
  virtual int64_t eval_size() const { return 0; }
  virtual Batch eval_batch(int64_t begin, int64_t count) {
    (void)begin;
    (void)count;
    return {};
  }
  // Text data only: the character vocabulary (token id k is vocabulary()[k]); empty otherwise.
  virtual std::string vocabulary() const { return {}; }
};

// The data set as the library's Trainer reads it (runtime/trainer.h); `d` must outlive the result.
TrainData train_data(Dataset& d);

// Token sequences from a fixed random "grammar": each next token follows the previous one by a random
// but fixed transition table 90% of the time, else is uniform. Targets are the inputs shifted by one.
// Learnable, so the loss falls from ln(vocab) towards the table's entropy.
std::unique_ptr<Dataset> make_synthetic_tokens(int64_t vocab, int64_t seq_len, uint64_t seed);

// Gaussian feature vectors labelled by a fixed random linear teacher (argmax of x W).
std::unique_ptr<Dataset> make_synthetic_classes(int64_t features, int64_t classes, uint64_t seed);

// --- Fashion-MNIST -------------------------------------------------------------------------------

// Where Debian's dataset-fashion-mnist installs the four gzipped IDX files.
inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
// Pixel statistics of the Fashion-MNIST training images (pixels scaled to [0, 1]).
inline constexpr double kFashionMnistMean = 0.2860;
inline constexpr double kFashionMnistStd = 0.3530;

// An IDX file of unsigned bytes (the MNIST format): a big-endian header, magic 0x00000800 + number of
// dimensions (0x00000803 for images N x rows x cols, 0x00000801 for labels N), then the dimensions as
// big-endian uint32, then the bytes in row-major order. `path` may be plain or gzip-compressed (zlib reads
// both). The file must hold exactly the bytes its header promises: a short file or trailing bytes throw.
// read_idx_images returns uint8 [N, rows, cols]; read_idx_labels returns uint8 [N].
torch::Tensor read_idx_images(const std::string& path);
torch::Tensor read_idx_labels(const std::string& path);

// Fashion-MNIST from `dir`, which holds train-images-idx3-ubyte, train-labels-idx1-ubyte,
// t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte, each plain or with a .gz suffix (plain wins when both
// exist). The training split is the 60,000 train files, the held-out split the 10,000 t10k files (the
// published split; other counts are accepted if images and labels agree and both splits share an image
// size). Labels must lie in 0..9.
//
// Samples: input float [B, 1, rows, cols] = (pixel / 255 - kFashionMnistMean) / kFashionMnistStd,
// target int64 [B] (the class). The pixels stay uint8 in memory (47 MB) and are normalised per batch.
//
// batch(step, B): sample j (0 <= j < B) of step k is global position p = k * B + j of an endless stream
// that walks the training split once per epoch: epoch e = p / N, index = perm_e[p % N], where perm_e is a
// permutation of 0..N-1 drawn by torch::randperm from a CPU generator seeded by a hash of (seed, e). A batch
// may therefore straddle two epochs; when B divides N, steps [e N/B, (e+1) N/B) cover every training sample
// exactly once. Permutations are cached (the last few epochs), so a batch costs one gather.
// eval_batch(begin, count) returns held-out samples [begin, begin + count) in file order.
std::unique_ptr<Dataset> make_fashion_mnist(const std::string& dir = kFashionMnistDir, uint64_t seed = 0);

// --- Character-level text ------------------------------------------------------------------------

// Character-level language-model data from `text` (bytes; any byte may occur).
//   vocabulary()  the sorted distinct bytes of the whole text; token id k is vocabulary()[k].
//   split         the last floor(eval_fraction * L) characters (L = text length) are held out; the rest is
//                 the training part. No window crosses the boundary, so the splits share no sample.
//   batch(k, B)   B windows of seq_len + 1 tokens at offsets drawn uniformly from the training part by a
//                 generator seeded by a hash of (seed, k): input = window[0, T), target = window[1, T + 1),
//                 both int64 [B, T]. A pure function of (seed, k, B).
//   train_size()  floor(training characters / seq_len): the windows one "epoch" takes to predict about
//                 as many characters as the training part holds (windows are random, so this is a
//                 measure of work, not a guarantee that every character is seen).
//   eval_size()   floor((held-out characters - 1) / seq_len) windows whose inputs tile the held-out
//                 part: window i has input held-out[i T, i T + T) and target held-out[i T + 1, i T + T + 1);
//                 eval_batch(begin, count) returns windows [begin, begin + count) in order.
// Throws UsageError if seq_len < 1, eval_fraction is outside [0, 1), or a split is too short for one
// window (the training part needs seq_len + 1 characters, a non-empty held-out part as many).
std::unique_ptr<Dataset> make_text(const std::string& text, const std::string& name, int64_t seq_len, uint64_t seed,
                                   double eval_fraction = 0.1);

// Character-level samples of differing length: each line of `text` (a KJV verse, with its '\n') is one
// sample, a line longer than seq_len + 1 characters is cut into pieces of at most that many, and lines
// of fewer than 2 characters are dropped. A sample of L characters has input w[0, L-1) and target
// w[1, L), padded to seq_len: input with token 0, target with -1 (ignored by zoo::cross_entropy), and
// mask true on the L-1 real positions. The last floor(eval_fraction * lines) samples are held out.
//   batch(k, B)   B samples drawn uniformly from the training ones (seeded by (seed, k)).
//   train_size()  training samples; eval_size() held-out samples, eval_batch in order.
// A model for it trims each micro-batch to its longest sample (zoo GptConfig::variable_length), so the
// pipeline runs with PipelineOptions::variable_shapes. Throws UsageError as make_text does.
std::unique_ptr<Dataset> make_text_lines(const std::string& text, const std::string& name, int64_t seq_len,
                                         uint64_t seed, double eval_fraction = 0.1);

// Token ids (int64 [s.size()]) of `s` under `vocabulary`; throws UsageError naming the first character
// that is not in the vocabulary and its position.
torch::Tensor encode_text(const std::string& vocabulary, const std::string& s);
// The characters of integer token ids (any shape, read in row-major order); throws UsageError on an id
// outside [0, vocabulary.size()).
std::string decode_text(const std::string& vocabulary, const torch::Tensor& ids);

// The King James Bible as prose: runs `program -f Gen1:1-Rev22:21` (Debian's bible-kjv, about 0.1 s) and
// strips the verse reference that opens each line ("Ge1:1 In the beginning..." -> "In the beginning...").
// One verse per line, each ending in '\n'; about 4.1 million characters, 63 distinct. Throws UsageError if
// the program is missing or fails ("install the Debian package bible-kjv ... or pass --text FILE").
std::string load_kjv(const std::string& program = "bible");

// The bytes of a text file; throws UsageError naming the path if it cannot be read, is empty or is
// larger than kMaxTextBytes (every rank holds the text and its token ids).
constexpr std::uintmax_t kMaxTextBytes = std::uintmax_t{512} << 20;
std::string read_text_file(const std::string& path);

}  // namespace pipetrain::zoo
