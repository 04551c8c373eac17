// Checks the CSV form of whole schedules: generated schedules round-trip exactly, hand-written CSV
// without a header is understood, and malformed CSV is rejected with the line and cell named.
#include <gtest/gtest.h>

#include "pipetrain/core/error.h"
#include "pipetrain/core/generators.h"
#include "pipetrain/core/lower.h"
#include "pipetrain/core/schedule.h"

using namespace pipetrain;

TEST(ScheduleCsv, GeneratedSchedulesRoundTrip) {
  GeneratorOptions o;
  o.ranks = 3;
  o.microbatches = 6;
  o.steps = 2;
  for (const std::string& name : schedule_names()) {
    GeneratorOptions g = o;
    if (name == "interleaved") g.virtual_stages = 2;
    const Schedule s = generate(name, g);
    EXPECT_EQ(from_csv(to_csv(s)), s) << name;
    const Schedule lowered = insert_communication(s);
    EXPECT_EQ(from_csv(to_csv(lowered)), lowered) << name << " lowered";
  }
}

TEST(ScheduleCsv, HandWrittenWithoutHeader) {
  const Schedule s = from_csv("# two ranks, GPipe\n0F0,0F1,0BW1,0BW0\n\n1F0, 1F1 ,1BW1,1BW0,\n");
  EXPECT_EQ(s.ranks, 2);
  EXPECT_EQ(s.stages, 2);
  EXPECT_EQ(s.microbatches, 2);
  EXPECT_EQ(s.microbatches_per_step, 2);
  EXPECT_TRUE(s.synchronous);
  EXPECT_EQ(s.stage_rank, (std::vector<int>{0, 1}));
  EXPECT_EQ(rank_line(s, 1), "1F0 1F1 1BW1 1BW0");
}

TEST(ScheduleCsv, InterleavedOwnersAreInferred) {
  const Schedule s = from_csv("0F0,2F0,2BW0,0BW0\n1F0,3F0,3BW0,1BW0\n");
  EXPECT_EQ(s.stage_rank, (std::vector<int>{0, 1, 0, 1}));
}

TEST(ScheduleCsv, MalformedCellNamesLineAndCell) {
  try {
    from_csv("0F0,0BW0\n1F0,1QQ0\n");
    FAIL() << "accepted a bad cell";
  } catch (const UsageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("line 2, cell 2"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1QQ0"), std::string::npos) << msg;
  }
}

TEST(ScheduleCsv, BadFilesAreRejected) {
  EXPECT_THROW(from_csv(""), UsageError);
  EXPECT_THROW(from_csv("# only a comment\n"), UsageError);
  EXPECT_THROW(from_csv("# pipetrain schedule ranks=3\n0F0,0BW0\n"), UsageError);
  EXPECT_THROW(from_csv("# pipetrain schedule stages=x\n0F0,0BW0\n"), UsageError);
  EXPECT_THROW(from_csv("# pipetrain schedule stage_rank=0:5\n0F0,0BW0\n1F0,1BW0\n"), UsageError);
  EXPECT_THROW(load_csv_file("/nonexistent/schedule.csv"), UsageError);
}

// A paired slot (dualpipev's (0F7;7BW3)) survives the CSV, also lowered, where transfers sit between the
// pair's halves: == ignores pairing, so the cells are compared.
TEST(ScheduleCsv, PairedSlotsRoundTrip) {
  const Schedule s = dualpipev(4, 10);
  for (const Schedule& t : {s, insert_communication(s)}) {
    const std::string csv = to_csv(t);
    const Schedule back = from_csv(csv);
    ASSERT_EQ(back, t);
    int pairs = 0;
    for (int r = 0; r < t.ranks; ++r) {
      const auto& a = t.actions[static_cast<std::size_t>(r)];
      const auto& b = back.actions[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].paired, b[i].paired) << "rank " << r << " action " << i;
        pairs += a[i].paired;
      }
    }
    EXPECT_GT(pairs, 0);
    EXPECT_NE(csv.find("(0F"), std::string::npos) << csv;
  }
  EXPECT_EQ(rank_line(from_csv("(0F0;0BW0)\n"), 0), "(0F0;0BW0)");
  EXPECT_NE(to_csv(insert_communication(s)).find(";,"), std::string::npos);  // a pair split by its transfers
  Schedule dangling = from_csv("0F0,0BW0\n");  // a pair left open at the row's end (the validator refuses it)
  dangling.actions[0][1].paired = true;
  EXPECT_EQ(to_csv(dangling).substr(to_csv(dangling).find('\n') + 1), "0F0,0BW0\n");
  EXPECT_THROW(from_csv("(0F1;,0SF1\n"), UsageError);         // never closed
  EXPECT_THROW(from_csv("(0F1;,0SF1,0BW0,1BW2)\n"), UsageError);  // closed by an unmarked compute action
}
