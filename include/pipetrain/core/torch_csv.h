// PyTorch's schedule CSV (torch.distributed.pipelining: a schedule's _dump_csv and _load_csv), read into
// and written from pipetrain's Schedule. Torch-free; docs/ALGORITHMS.md §1.9 describes the format.
//
// Format. Row r is rank r's actions in order, one per cell; an empty cell is an idle slot. Every line is
// a row, as Python's csv reader has it (an empty line is a rank with nothing to do), and cells may be quoted. A cell is
// <stage><KIND><micro-batch>, e.g. 2F0. PyTorch has used two sets of letters for the backward:
//
//   kind                      current letters   older letters (legacy)   pipetrain
//   forward                   F                 F                        F
//   input gradient            I                 B                        B
//   weight gradient           W                 W                        W
//   full backward (I and W)   B                 BW                       BW
//
// The form with communication adds SEND_F, RECV_F, SEND_B and RECV_B (pipetrain's SF, RF, SB, RB: 0SEND_F1
// is stage 0 sending micro-batch 1's activation, 1RECV_B0 stage 1 receiving micro-batch 0's gradient).
// UNSHARD, RESHARD and REDUCE_GRAD (FSDP and gradient-reduction steps, written without a micro-batch,
// e.g. 0REDUCE_GRAD) are accepted and skipped, with a note. A paired cell such as (0F7;7B3)OVERLAP_F_B
// (DualPipeV's forward of one stage overlapped with a backward of another) reads as the forward marked
// `paired` followed by the backward (action.h); the compact writer (with communication, or without idle
// cells) writes such pairs back as one cell, the lock-step writer as two. Older batched cells
// (0SEND_F1_2RECV_B0, a send and a receive at once) are refused.
//
// Letter detection (TorchLetters::detect): legacy when a cell uses BW, or uses W with no I anywhere
// (a current-letter W must follow an I of its micro-batch); current otherwise. A file with both I and BW
// mixes the two sets and is refused.
//
// The file records no sizes: the stage count is the largest stage number + 1, the micro-batch count the
// largest micro-batch + 1, and each stage belongs to the rank whose row names it (unless given). A
// PyTorch schedule covers one synchronous step; the reader appends one optimizer step per stage at the
// end of its rank's row (PyTorch leaves the step to the caller), which the writer drops again.
//
// Writing. A schedule without transfers is written compute-only, in lock step: empty cells are inserted
// so that every action sits in a later column than each action of another rank it needs data from (what
// PyTorch's PipelineScheduleMulti, which exchanges data between columns, requires). A lowered schedule is
// written with its transfers and no empty cells (what _PipelineScheduleRuntime._load_csv(format=
// "compute_comms") reads). Rows end in "\n". Replicated, asynchronous or multi-step schedules have no
// PyTorch form and are refused.
//
// Errors are UsageError naming the line and cell (1-based) and the accepted form.
#pragma once

#include <string>
#include <vector>

#include "pipetrain/core/schedule.h"

namespace pipetrain {

enum class TorchLetters { detect, current, legacy };
// "detect", "current" or "legacy"; throws UsageError naming the value otherwise.
TorchLetters parse_torch_letters(const std::string& name);
const char* to_string(TorchLetters letters);

struct TorchCsvReadOptions {
  TorchLetters letters = TorchLetters::detect;
  int stages = 0;                // 0: the largest stage number in the file + 1
  std::vector<int> stage_rank;   // empty: each stage on the rank whose row names it
  bool add_steps = true;         // append an optimizer step per stage at the end of its rank's row
  std::string name = "torch";    // Schedule::name of the result
};

struct TorchCsvRead {
  Schedule schedule;
  TorchLetters letters = TorchLetters::current;  // the set the file was read with (never detect)
  bool with_communication = false;               // the file holds SEND/RECV cells
  std::vector<std::string> notes;                // what was skipped or added, for the user
};

// Parses the text; the result is not validated (call validate()).
TorchCsvRead from_torch_csv(const std::string& text, const TorchCsvReadOptions& options = {});
// Reads a file (capped like load_csv_file); errors name the path.
TorchCsvRead load_torch_csv_file(const std::string& path, const TorchCsvReadOptions& options = {});

struct TorchCsvWriteOptions {
  TorchLetters letters = TorchLetters::current;  // detect is refused
  bool idle_cells = true;  // compute-only form: lock-step columns with empty cells (see above)
};

std::string to_torch_csv(const Schedule& schedule, const TorchCsvWriteOptions& options = {});

}  // namespace pipetrain
