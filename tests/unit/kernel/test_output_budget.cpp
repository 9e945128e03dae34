#include <gtest/gtest.h>

#include <string>

#include "common/utf8_decoder.hpp"
#include "worker/output_budget.hpp"

namespace cellblock::kernel {
namespace {

bool valid_utf8(const std::string& text) {
    Utf8StreamDecoder decoder;
    return decoder.feed(text) == text && decoder.finish().empty();
}

TEST(OutputBudget, OutputWithinTheLimitPassesUnchanged) {
    OutputBudget budget(1000);
    EXPECT_EQ(budget.admit_text(OutputStream::stdout_stream, std::string(400, 'a')), std::string(400, 'a'));
    EXPECT_EQ(budget.take_tail(OutputStream::stdout_stream), "");
    EXPECT_FALSE(budget.truncated());
}

TEST(OutputBudget, HeldTextWithinTheLimitIsPublishedWholeAtTheEnd) {
    OutputBudget budget(1000);
    EXPECT_EQ(budget.admit_text(OutputStream::stdout_stream, std::string(600, 'a')).size(), 500u);
    EXPECT_EQ(budget.take_tail(OutputStream::stdout_stream), std::string(100, 'a'));
    EXPECT_FALSE(budget.truncated());
}

TEST(OutputBudget, KeepsTheHeadAndTheTailWithAMarker) {
    OutputBudget budget(1000);
    std::string published = budget.admit_text(OutputStream::stdout_stream, std::string(10000, 'x'));
    published += budget.admit_text(OutputStream::stdout_stream, "THE END\n");
    EXPECT_EQ(published, std::string(500, 'x'));
    const std::string tail = budget.take_tail(OutputStream::stdout_stream);
    EXPECT_NE(tail.find("[cellblock] Output truncated: 9258 bytes of this stream were left out"),
              std::string::npos)
        << tail;
    EXPECT_TRUE(tail.ends_with(std::string(242, 'x') + "THE END\n")) << tail;
    EXPECT_TRUE(budget.truncated());
}

TEST(OutputBudget, EachStreamKeepsItsOwnTail) {
    OutputBudget budget(1000);
    budget.admit_text(OutputStream::stdout_stream, std::string(5000, 'o'));
    budget.admit_text(OutputStream::stderr_stream, std::string(5000, 'e') + "Traceback: the error\n");
    EXPECT_TRUE(budget.take_tail(OutputStream::stdout_stream).ends_with("ooo"));
    EXPECT_TRUE(budget.take_tail(OutputStream::stderr_stream).ends_with("Traceback: the error\n"));
}

TEST(OutputBudget, CutsOnlyAtCodePointBoundaries) {
    OutputBudget budget(1001);
    std::string text;
    for (int i = 0; i < 2000; ++i) {
        text += "\xe2\x82\xac";  // U+20AC, three bytes
    }
    const std::string head = budget.admit_text(OutputStream::stdout_stream, text);
    const std::string tail = budget.take_tail(OutputStream::stdout_stream);
    EXPECT_TRUE(valid_utf8(head));
    EXPECT_TRUE(valid_utf8(tail));
    EXPECT_LE(head.size(), 501u);
    EXPECT_TRUE(tail.ends_with("\xe2\x82\xac"));
}

TEST(OutputBudget, RichOutputsAreDroppedWholeBeyondTheLimit) {
    OutputBudget budget(1000);
    EXPECT_TRUE(budget.admit_rich(600));
    EXPECT_FALSE(budget.admit_rich(600));
    EXPECT_EQ(budget.dropped_rich(), 1u);
    EXPECT_TRUE(budget.truncated());
}

TEST(OutputBudget, ZeroMeansUnlimited) {
    OutputBudget budget(0);
    EXPECT_EQ(budget.admit_text(OutputStream::stdout_stream, std::string(100000, 'z')).size(), 100000u);
    EXPECT_TRUE(budget.admit_rich(1u << 30));
    EXPECT_FALSE(budget.truncated());
}

TEST(OutputBudget, AClientMayAskForMoreOutputUpToACeiling) {
    EXPECT_EQ(effective_output_limit(std::nullopt, 1000), 1000u);
    EXPECT_EQ(effective_output_limit(32u << 20, 1u << 20), 32u << 20) << "the agent API's disk limit";
    EXPECT_EQ(effective_output_limit(100, 1000), 100u);
    EXPECT_EQ(effective_output_limit(1ull << 40, 1u << 20), 256u << 20) << "bounded";
    EXPECT_EQ(effective_output_limit(0, 1u << 20), 256u << 20) << "no 'unlimited' for the asking";
    EXPECT_EQ(effective_output_limit(5, 0), 0u) << "a kernel without a limit stays without one";
}

}  // namespace
}  // namespace cellblock::kernel
