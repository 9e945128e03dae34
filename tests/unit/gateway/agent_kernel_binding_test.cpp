#include <gtest/gtest.h>

#include <boost/asio/io_context.hpp>
#include <stdexcept>
#include <zmq.hpp>

#include "cellblock/gateway/agent/kernel_binding.hpp"

// An agent session's kernel binding on its own (kernel_binding.hpp): what it holds, the request in flight and
// its waiters, without a KernelManager. The kernels are never started: only their ids are read.

using namespace cellblock::gateway;
using namespace cellblock::gateway::agent;

namespace {

// A kernel is never launched here: asked to, it throws.
class NoLaunch : public Provisioner {
  public:
    std::string_view name() const override { return "none"; }
    bool reports_connection() const override { return false; }
    std::unique_ptr<KernelInstance> launch(const InstanceLaunch&, Connected) override {
        throw std::runtime_error("no kernel is launched in this test");
    }
};

class KernelBindingTest : public ::testing::Test {
  protected:
    // A kernel object that was never started (no process, no sockets, no workspace).
    std::shared_ptr<Kernel> kernel(const std::string& id) {
        KernelLaunch launch;
        launch.id = id;
        launch.runtime_dir = std::filesystem::temp_directory_path() / "cellblock-kernel-binding-test";
        launch.provisioner = std::make_shared<NoLaunch>();
        return std::make_shared<Kernel>(io_, zmq_context_, logger_, config_, std::move(launch));
    }

    boost::asio::io_context io_;
    zmq::context_t zmq_context_;
    const Logger logger_{LogLevel::error};
    const GatewayConfig config_{};
};

using Answers = std::vector<std::optional<std::string>>;
KernelBinding::Done record_into(Answers& answers) {
    return [&answers](std::optional<std::string> error) { answers.push_back(std::move(error)); };
}

}  // namespace

TEST_F(KernelBindingTest, WaitersWaitForTheOneRequestInFlight) {
    KernelBinding binding(false);
    Answers answers;
    EXPECT_TRUE(binding.wait(record_into(answers)));  // nothing in flight: this caller starts the request
    binding.begin(KernelBinding::Request::starting);
    EXPECT_FALSE(binding.wait(record_into(answers)));  // joins it
    EXPECT_TRUE(binding.requesting(KernelBinding::Request::starting));
    EXPECT_TRUE(answers.empty());

    binding.settle(std::string("no kernel"));
    EXPECT_EQ(answers, (Answers{"no kernel", "no kernel"}));
    EXPECT_TRUE(binding.requesting(KernelBinding::Request::none));
    binding.settle(std::nullopt);  // each waiter is answered once
    EXPECT_EQ(answers.size(), 2U);
}

TEST_F(KernelBindingTest, AWaiterAnsweredStartsTheNextRequest) {
    KernelBinding binding(false);
    bool starts_again = false;
    binding.wait([&](const std::optional<std::string>&) {
        // The request has ended before its waiters are answered: asking again starts another.
        starts_again = binding.wait([](const std::optional<std::string>&) {});
    });
    binding.begin(KernelBinding::Request::readying);
    binding.settle(std::nullopt);
    EXPECT_TRUE(starts_again);
}

TEST_F(KernelBindingTest, TakenWaitersAreHandedBackUnanswered) {
    KernelBinding binding(false);
    Answers answers;
    binding.wait(record_into(answers));
    binding.begin(KernelBinding::Request::readying);
    binding.wait(record_into(answers));
    auto waiters = binding.take_waiters();
    EXPECT_EQ(waiters.size(), 2U);
    EXPECT_TRUE(answers.empty());
    EXPECT_TRUE(binding.requesting(KernelBinding::Request::none));
    binding.settle(std::string("late"));
    EXPECT_TRUE(answers.empty());  // no longer the binding's to answer
}

TEST_F(KernelBindingTest, ANewKernelAfterOneThatServedMeansLostState) {
    KernelBinding fresh(false);
    EXPECT_FALSE(fresh.bind(kernel("k1")));  // the first kernel of a new session replaces nothing
    EXPECT_EQ(fresh.kernel()->id(), "k1");
    EXPECT_EQ(fresh.unbind()->id(), "k1");
    EXPECT_EQ(fresh.kernel(), nullptr);
    EXPECT_TRUE(fresh.bind(kernel("k2")));  // k1's variables are gone

    KernelBinding reloaded(true);  // its history came from the store: a kernel served it before
    EXPECT_TRUE(reloaded.bind(kernel("k3")));

    KernelBinding readopted(true);
    readopted.set_served_before(false);  // the same kernel re-adopted after a gateway restart
    EXPECT_FALSE(readopted.bind(kernel("k4")));
}

TEST_F(KernelBindingTest, AKernelThatLetsGoIsRememberedUntilTheNextRequest) {
    KernelBinding binding(false);
    const auto k1 = kernel("k1");
    binding.bind(k1);
    binding.set_link(nullptr);
    binding.let_go(true);
    EXPECT_EQ(binding.kernel(), nullptr);
    EXPECT_TRUE(std::holds_alternative<KernelBinding::LetGo>(binding.hold()));
    EXPECT_EQ(binding.unbind(), nullptr);  // nothing bound to hand back: the id stays
    EXPECT_EQ(binding.take_let_go(), "k1");
    EXPECT_TRUE(std::holds_alternative<KernelBinding::Unbound>(binding.hold()));
    EXPECT_EQ(binding.take_let_go(), "");  // forgotten once taken

    binding.bind(k1);
    binding.let_go(false);  // a closed session does not come back to it
    EXPECT_TRUE(std::holds_alternative<KernelBinding::Unbound>(binding.hold()));
    binding.let_go(true);  // nothing bound: nothing to remember
    EXPECT_EQ(binding.take_let_go(), "");

    binding.bind(k1);
    EXPECT_EQ(binding.take_let_go(), "");  // a bound kernel is not taken as let go
    EXPECT_EQ(binding.kernel(), k1);
}

TEST_F(KernelBindingTest, OnlyTheExpectedKernelInfoReplyIsKept) {
    KernelBinding binding(false);
    JupyterMessage reply;
    reply.channel = Channel::shell;
    reply.msg_type = "kernel_info_reply";
    reply.parent_header = R"({"msg_id": "m1"})";
    reply.content = R"({"implementation": "ipython"})";
    EXPECT_FALSE(binding.take_kernel_info(reply));  // none expected yet
    binding.expect_kernel_info("m2");
    EXPECT_FALSE(binding.take_kernel_info(reply));
    EXPECT_TRUE(binding.kernel_info().is_null());
    binding.expect_kernel_info("m1");
    EXPECT_TRUE(binding.take_kernel_info(reply));
    EXPECT_EQ(binding.kernel_info().value("implementation", ""), "ipython");
}
