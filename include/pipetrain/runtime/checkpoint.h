// Checkpoints: one file per layer plus a manifest. Because the unit is the layer, not the stage, a
// checkpoint saved with one number of stages (or one balance) loads into any other: each rank reads
// the files of the layers it now holds (a re-grouping, as DeepSpeed's per-layer checkpoints allow).
//
//   DIR/manifest.json    {"format": "pipetrain-checkpoint", "version": 1, "step": 120, "layers": 8,
//                         "stages": 2, "balance": [4, 4],
//                         "files": [{"layer": 0, "file": "layer-00000.pt", "bytes": 1234, "crc32": 567}, ...],
//                         "run": {...}}   the caller's description of the run (model, data, optimizer ...)
//   DIR/layer-NNNNN.pt   one layer's tensors by name (PipelineRank::layer_state: parameters, buffers,
//                        optimizer state), in torch.save's format, so Python's torch.load reads it too.
//
// Atomic: a save writes everything into DIR.partial; when every layer file is complete, rank 0 writes
// the manifest there and swaps the folders (DIR -> DIR.old, DIR.partial -> DIR, DIR.old removed).
// A crash leaves the previous checkpoint or the new one whole, never a mix; a stale DIR.partial is
// cleared by the next save. Loading checks the manifest and every layer file's size and CRC-32 before
// any tensor is touched, so a truncated or corrupted checkpoint is refused with what is wrong.
//
// Multi-process runs need DIR on a file system every rank sees (one host, or a shared mount).
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/transport.h"

namespace pipetrain {

// Collective: every rank of the pipeline calls it. `run` is stored as the manifest's "run" object.
void save_checkpoint(PipelineRank& rank, Transport& transport, const std::string& dir, const nlohmann::json& run);

// Reads and checks DIR/manifest.json and every layer file it lists (present, size, CRC-32). Returns
// the manifest; throws UsageError naming the file and what is wrong. Reads, never writes.
nlohmann::json read_checkpoint(const std::string& dir);

// Loads the layers this rank holds and the step from a checkpoint: the manifest is checked, and each
// layer file this rank reads is checked (size, CRC-32) before it is used; the others are not read.
// Throws UsageError when the layer count or a tensor's name or shape does not match the model.
void load_checkpoint(PipelineRank& rank, const std::string& dir);

// Where two run descriptions differ under the given top-level keys, one line each, e.g.
// "model.d_model: 128 in the checkpoint, 256 in this run". Empty when they agree.
std::vector<std::string> run_differences(const nlohmann::json& saved, const nlohmann::json& now,
                                         const std::vector<std::string>& keys);

}  // namespace pipetrain
