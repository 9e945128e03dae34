#include "cellblock/gateway/common/crypto.hpp"

#include <gtest/gtest.h>

#include <array>
#include <regex>
#include <set>

using namespace cellblock::gateway;

TEST(HmacSigner, MatchesRfc4231TestCase2) {
    // HMAC-SHA256(key="Jefe", "what do ya want for nothing?"), split over parts as Jupyter signs them.
    HmacSigner signer("Jefe");
    const std::array<std::string_view, 4> parts = {"what do ya want ", "for nothing?", "", ""};
    EXPECT_EQ(signer.sign(parts), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(HmacSigner, VerifiesOwnSignatureAndRejectsTampering) {
    HmacSigner signer(random_hex(32));
    const std::array<std::string_view, 4> parts = {"{\"msg_id\":\"1\"}", "{}", "{}", "{\"code\":\"1+1\"}"};
    const std::string signature = signer.sign(parts);
    EXPECT_EQ(signature.size(), 64u);
    EXPECT_TRUE(signer.verify(parts, signature));
    const std::array<std::string_view, 4> tampered = {"{\"msg_id\":\"1\"}", "{}", "{}", "{\"code\":\"1+2\"}"};
    EXPECT_FALSE(signer.verify(tampered, signature));
    EXPECT_FALSE(signer.verify(parts, ""));
    EXPECT_FALSE(HmacSigner("other").verify(parts, signature));
}

TEST(HmacSigner, OnlyTheFourSignedPartsAreSigned) {
    const std::array<std::string_view, 3> three = {"{}", "{}", "{}"};
    EXPECT_THROW(HmacSigner("key").sign(three), std::invalid_argument);
}

TEST(HmacSigner, EmptyKeyMeansUnsigned) {
    HmacSigner signer("");
    const std::array<std::string_view, 4> parts = {"header", "parent", "metadata", "content"};
    EXPECT_EQ(signer.sign(parts), "");
    EXPECT_TRUE(signer.verify(parts, "anything"));
}

TEST(Identifiers, UuidsAreV4AndUnique) {
    const std::regex v4("^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$");
    std::set<std::string> seen;
    for (int i = 0; i < 1000; ++i) {
        std::string id = new_uuid();
        EXPECT_TRUE(std::regex_match(id, v4)) << id;
        seen.insert(id);
    }
    EXPECT_EQ(seen.size(), 1000u);
    EXPECT_EQ(random_hex(32).size(), 64u);
    EXPECT_NE(random_hex(16), random_hex(16));
}

TEST(ConstantTimeEquals, ComparesContentAndLength) {
    EXPECT_TRUE(constant_time_equals("abc", "abc"));
    EXPECT_FALSE(constant_time_equals("abc", "abd"));
    EXPECT_FALSE(constant_time_equals("abc", "abcd"));
    EXPECT_TRUE(constant_time_equals("", ""));
}

TEST(Base64, EncodesWithOpenSsl) {
    EXPECT_EQ(base64_encode("hello"), "aGVsbG8=");
    EXPECT_EQ(base64_encode(""), "");
}
