#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "server/inbound_verifier.hpp"

namespace cellblock::kernel {
namespace {

// Frames of a shell message as a ROUTER receives them: identity, delimiter, signature, 4 JSON parts.
std::vector<std::string> message(const MessageSigner& signer, const std::string& msg_id,
                                 const std::string& msg_type = "execute_request") {
    const std::string header =
        R"({"msg_id":")" + msg_id + R"(","msg_type":")" + msg_type +
        R"(","session":"s","username":"u","version":"5.3","date":"2026-01-01T00:00:00Z"})";
    const std::string parent = "{}", metadata = "{}", content = R"({"code":"1+1"})";
    return {"client-id", "<IDS|MSG>", signer.sign({header, parent, metadata, content}), header, parent,
            metadata,    content};
}

std::vector<std::string_view> views(const std::vector<std::string>& frames) {
    return {frames.begin(), frames.end()};
}

TEST(MessageSigner, MatchesPythonHmacSha256) {
    MessageSigner signer("hmac-sha256", "key");
    // hmac.new(b"key", b"abcd", hashlib.sha256).hexdigest()
    EXPECT_EQ(signer.sign({"a", "b", "c", "d"}),
              "2a31ec0ee8d878c9eece9fb0df79b3b90b2256240163aa5ee50d176d3d1121f8");
}

TEST(MessageSigner, VerifiesOnlyTheExactSignature) {
    MessageSigner signer("hmac-sha256", "secret");
    const SignedParts parts = {"h", "p", "m", "c"};
    const std::string good = signer.sign(parts);
    EXPECT_TRUE(signer.verify(good, parts));
    EXPECT_FALSE(signer.verify(good + "junk", parts)) << "valid signature with trailing junk must be refused";
    EXPECT_FALSE(signer.verify(good.substr(0, 63), parts));
    EXPECT_FALSE(signer.verify("", parts));
    std::string flipped = good;
    flipped[10] = flipped[10] == 'a' ? 'b' : 'a';
    EXPECT_FALSE(signer.verify(flipped, parts));
    EXPECT_FALSE(signer.verify(good, {"h", "p", "m", "other content"}));
}

TEST(MessageSigner, WrongKeyIsRefused) {
    MessageSigner client("hmac-sha256", "client key");
    MessageSigner kernel("hmac-sha256", "kernel key");
    const SignedParts parts = {"h", "p", "m", "c"};
    EXPECT_FALSE(kernel.verify(client.sign(parts), parts));
}

TEST(MessageSigner, EmptyKeyMeansUnsigned) {
    MessageSigner signer("hmac-sha256", "");
    EXPECT_FALSE(signer.enabled());
    EXPECT_EQ(signer.sign({"h", "p", "m", "c"}), "");
    EXPECT_TRUE(signer.verify("", {"h", "p", "m", "c"}));
}

TEST(MessageSigner, UnknownSchemeIsAnError) {
    EXPECT_THROW(MessageSigner("hmac-nosuchdigest", "k"), std::invalid_argument);
    EXPECT_THROW(MessageSigner("rot13", "k"), std::invalid_argument);
}

TEST(InboundVerifier, AcceptsValidAndRefusesReplay) {
    MessageSigner signer("hmac-sha256", "secret");
    InboundVerifier verifier(signer, 100);
    const auto frames = message(signer, "id-1");
    const auto first = verifier.check(views(frames));
    ASSERT_EQ(first.kind, InboundVerdict::Kind::accepted);
    EXPECT_EQ(first.msg_type, "execute_request");
    EXPECT_EQ(first.delimiter, 1u);
    EXPECT_EQ(verifier.check(views(frames)).kind, InboundVerdict::Kind::replayed);
    EXPECT_EQ(verifier.check(views(message(signer, "id-2"))).kind, InboundVerdict::Kind::accepted);
}

TEST(InboundVerifier, ReplayMemoryIsBounded) {
    MessageSigner signer("hmac-sha256", "secret");
    InboundVerifier verifier(signer, 2);
    const auto oldest = message(signer, "a");
    EXPECT_EQ(verifier.check(views(oldest)).kind, InboundVerdict::Kind::accepted);
    EXPECT_EQ(verifier.check(views(message(signer, "b"))).kind, InboundVerdict::Kind::accepted);
    EXPECT_EQ(verifier.check(views(message(signer, "c"))).kind, InboundVerdict::Kind::accepted);
    // "a" fell out of the window of 2.
    EXPECT_EQ(verifier.check(views(oldest)).kind, InboundVerdict::Kind::accepted);
}

TEST(InboundVerifier, RefusesBadSignatureJunkAndWrongKey) {
    MessageSigner signer("hmac-sha256", "secret");
    MessageSigner attacker("hmac-sha256", "guess");
    InboundVerifier verifier(signer, 100);
    auto junk = message(signer, "j");
    junk[2] += "00";
    EXPECT_EQ(verifier.check(views(junk)).kind, InboundVerdict::Kind::bad_signature);
    EXPECT_EQ(verifier.check(views(message(attacker, "w"))).kind, InboundVerdict::Kind::bad_signature);
    // A refused message does not poison the replay memory: the genuine one still gets through.
    EXPECT_EQ(verifier.check(views(message(signer, "j"))).kind, InboundVerdict::Kind::accepted);
}

TEST(InboundVerifier, RefusesMalformedMessages) {
    MessageSigner signer("hmac-sha256", "secret");
    InboundVerifier verifier(signer, 100);
    auto frames = message(signer, "m");
    auto no_delimiter = frames;
    no_delimiter[1] = "<IDS|MSX>";
    EXPECT_EQ(verifier.check(views(no_delimiter)).kind, InboundVerdict::Kind::malformed);
    auto too_short = frames;
    too_short.pop_back();
    EXPECT_EQ(verifier.check(views(too_short)).kind, InboundVerdict::Kind::malformed);
    EXPECT_EQ(verifier.check({}).kind, InboundVerdict::Kind::malformed);
}

TEST(InboundVerifier, RefusesSignedButUnparsableHeader) {
    MessageSigner signer("hmac-sha256", "secret");
    InboundVerifier verifier(signer, 100);
    const std::string header = "not json";
    std::vector<std::string> frames = {
        "id", "<IDS|MSG>", signer.sign({header, "{}", "{}", "{}"}), header, "{}", "{}", "{}"};
    EXPECT_EQ(verifier.check(views(frames)).kind, InboundVerdict::Kind::bad_header);
}

TEST(InboundVerifier, UnsignedConnectionAcceptsUnsignedMessages) {
    MessageSigner signer("hmac-sha256", "");
    InboundVerifier verifier(signer, 100);
    const auto frames = message(signer, "u");
    EXPECT_EQ(frames[2], "");
    EXPECT_EQ(verifier.check(views(frames)).kind, InboundVerdict::Kind::accepted);
    EXPECT_EQ(verifier.check(views(frames)).kind, InboundVerdict::Kind::accepted);
}

}  // namespace
}  // namespace cellblock::kernel
