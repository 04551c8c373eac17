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
// Atomic and durable: a save writes everything into DIR.partial (marked as ours by a file
// `.pipetrain-partial`, on which the saving run holds an flock), fsyncs every file and the folder, then
// rank 0 writes the manifest there and exchanges the folders in one step (renameat2 RENAME_EXCHANGE;
// where the file system cannot, DIR -> DIR.old, DIR.partial -> DIR), fsyncs the parent and only then
// removes the previous checkpoint, file by file from its manifest. A crash leaves the previous
// checkpoint or the new one whole, never a mix, and never deletes the only complete copy.
//
// A save touches only what it can prove its own; anything else is refused with its path and the fix:
//  - DIR: empty, or a checkpoint holding nothing but manifest.json and the layer files it lists (a
//    user's notes.txt inside it is refused, not deleted);
//  - DIR.partial: marked (a failed save's leftovers: only names a save writes), or the checkpoint that
//    DIR replaced, which DIR's manifest identifies by the size and CRC-32 of its manifest ("replaces");
//    a copy of some checkpoint placed there is not ours;
//  - DIR.old: only the checkpoint that DIR (or a complete DIR.partial, after a stop between the
//    fallback's two renames: the save finishes that swap) replaced. A user's DIR.old is never touched.
// A DIR that stops being ours during the run (a user's notes.txt appears in it) is not replaced: the
// save still writes the whole new checkpoint, keeps it as DIR.step-N (N its step; DIR.step-N-2 ... when
// that name is taken, DIR.partial when none is free) and fails naming that folder and what is in DIR, so
// the run's training is never lost (resume from DIR.step-N).
// A run holds DIR's run lock (CheckpointDirLock: an flock on DIR.pipetrain-lock, released when the
// process ends, however it ends: a killed run leaves the file, which blocks no one) from start-up to its end, so a second run saving to the same DIR is
// refused at start-up, naming the other run's process; each save also holds the marker's lock. "." and "..",
// symbolic links and files are refused. prepare_checkpoint_dir runs these checks (and creates the parent
// folders, probing that DIR.partial can be made) before training, so a bad path is found before the first
// step, not at the first save. A failed save (full disk, no permission) keeps DIR and removes what it
// wrote: each rank its own files, and the leader, after giving them 2 s, what is left of the names a save
// writes (a transport stops a rank whose peer failed: shm's and gloo's watchdogs _Exit it). When the
// leader itself is stopped first, the marked DIR.partial stays, and the next save clears it. A tensor
// holding NaN or infinity is never saved (NonFiniteError: the run diverged).
//
// Loading checks the manifest (JSON nested at most 64 deep; types and ranges of every field; each layer
// file must be the plain name layer-NNNNN.pt inside DIR: no path, no "..", no symlink, a regular file)
// and every layer file's size (before reading it) and CRC-32 before any tensor is touched, so a
// truncated, corrupted or crafted checkpoint is refused with what is wrong, and no read leaves DIR or
// reads more than the manifest says. Tensors must be finite and of the model's type. A read that fails
// because another run replaced DIR meanwhile says so (not "corrupted").
//
// Multi-process runs need DIR on a file system every rank sees (one host, or a shared mount).
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "pipetrain/runtime/executor.h"
#include "pipetrain/runtime/transport.h"

namespace pipetrain {

// Checks a checkpoint folder we will write later (see the file comment) and returns it normalised
// (trailing slashes removed). Creates the parent folders; probes by creating and removing DIR.partial.
// In a process that no launcher started (no RANK or OMPI_COMM_WORLD_RANK in the environment: the ranks
// a launcher starts run it too, while their rank 0 may hold the lock already) it also refuses a DIR
// whose run lock another run holds (check_checkpoint_dir_unlocked).
// Throws UsageError naming `flag` (a command-line flag such as "--save", or by default the words
// "checkpoint folder"), the path and the fix. Call it before training.
std::string prepare_checkpoint_dir(const std::string& dir, const std::string& flag = "checkpoint folder");

// The run-long lock on a checkpoint folder: one process of a run (the one that leads its saves: world
// rank 0) holds it from start-up to the end, so that a second run saving to the same DIR is refused
// before it trains. An exclusive flock on the file DIR.pipetrain-lock beside DIR (created; it holds the
// holder's pid and host for the other run's message, and is removed on release). The kernel releases
// the flock when the process ends, however (SIGKILL too): a stale file never blocks. Needs DIR's parent
// folder on a file system with flock (a shared mount's flock must reach every host that runs a leader).
class CheckpointDirLock {
 public:
  // Takes the lock, or throws UsageError naming `flag`, DIR and the other run (its pid and host).
  explicit CheckpointDirLock(const std::string& dir, const std::string& flag = "checkpoint folder");
  ~CheckpointDirLock();
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// Throws the UsageError CheckpointDirLock would when another process holds DIR's run lock now; takes
// nothing (a shared probe, released at once).
void check_checkpoint_dir_unlocked(const std::string& dir, const std::string& flag = "checkpoint folder");

// Collective: every rank of the pipeline calls it. `run` is stored as the manifest's "run" object (it
// must be valid UTF-8 JSON: store byte strings as arrays of numbers). Refuses (UsageError, on every rank)
// a DIR that is not ours, as prepare_checkpoint_dir does.
void save_checkpoint(PipelineRank& rank, Transport& transport, const std::string& dir, const nlohmann::json& run);

// Reads and checks DIR/manifest.json and every layer file it lists (present, size, CRC-32). Returns
// the manifest; throws UsageError naming the file and what is wrong. Reads, never writes.
nlohmann::json read_checkpoint(const std::string& dir);

// Loads the layers this rank holds and the step from a checkpoint: the manifest is checked, and each
// layer file this rank reads is checked (size, CRC-32) before it is used; the others are not read.
// Throws UsageError when the layer count or a tensor's name or shape does not match the model. Every
// file of this rank, and each entry's name, type and shape (parameters, buffers, optimizer state), is
// checked before any is loaded, so such a refusal leaves this rank as it was; state of another optimizer
// than the rank's (Adam's in an SGD rank) is found only while loading: compare the manifest's run first,
// as pipetrain train does. Ranks load on their own: where one rank refuses and others loaded, treat the
// load as failed on all of them (pipetrain train and Trainer stop the run).
void load_checkpoint(PipelineRank& rank, const std::string& dir);

// Where two run descriptions differ under the given top-level keys, one line each, e.g.
// "model.d_model: 128 in the checkpoint, 256 in this run". Empty when they agree.
std::vector<std::string> run_differences(const nlohmann::json& saved, const nlohmann::json& now,
                                         const std::vector<std::string>& keys);

}  // namespace pipetrain
