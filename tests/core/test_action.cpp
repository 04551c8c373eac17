// Checks the action IR's text form: every kind prints and parses back to itself, and malformed text is
// rejected with a UsageError that names the text.
#include <gtest/gtest.h>

#include "pipetrain/core/action.h"
#include "pipetrain/core/error.h"

using namespace pipetrain;

TEST(Action, TextFormExamples) {
  EXPECT_EQ(to_string({ActionKind::F, 2, 0}), "2F0");
  EXPECT_EQ(to_string({ActionKind::BW, 0, 5}), "0BW5");
  EXPECT_EQ(to_string({ActionKind::SendAct, 0, 2}), "0SF2");
  EXPECT_EQ(to_string({ActionKind::RecvGrad, 3, 2}), "3RB2");
  EXPECT_EQ(to_string({ActionKind::Step, 1, 0}), "1S0");
  EXPECT_EQ(parse_action(" 12W345 "), (Action{ActionKind::W, 12, 345}));
}

TEST(Action, EveryKindRoundTrips) {
  for (ActionKind k : {ActionKind::F, ActionKind::B, ActionKind::W, ActionKind::BW, ActionKind::SendAct,
                       ActionKind::RecvAct, ActionKind::SendGrad, ActionKind::RecvGrad, ActionKind::Step})
    for (int stage : {0, 1, 15, 1234})
      for (int index : {0, 7, 63, 99999}) {
        const Action a{k, stage, index};
        EXPECT_EQ(parse_action(to_string(a)), a) << to_string(a);
      }
}

TEST(Action, MalformedTextIsRejected) {
  for (const char* bad : {"", "F0", "0F", "0X1", "0BWW1", "-1F0", "0F-1", "0F1x", "a0F1", "0 F1", "0f1",
                          "99999999999F0"}) {
    try {
      parse_action(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("malformed action"), std::string::npos) << e.what();
    }
  }
}

TEST(Action, KindClasses) {
  EXPECT_TRUE(is_compute(ActionKind::BW));
  EXPECT_FALSE(is_compute(ActionKind::Step));
  EXPECT_TRUE(is_comm(ActionKind::RecvAct));
  EXPECT_FALSE(is_comm(ActionKind::W));
}
