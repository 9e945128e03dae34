#include "cellblock/contract/file_messages.hpp"

#include <gtest/gtest.h>

#include "cellblock/contract/base64.hpp"

namespace cellblock::contract {
namespace {

using nlohmann::json;

FileFailure failure_of(const json& content) {
    try {
        decode_file_request(content);
    } catch (const FileMessageError& error) {
        return error.failure();
    }
    ADD_FAILURE() << "accepted: " << content.dump();
    return FileFailure::io;
}

TEST(Base64, RoundTripsEveryByte) {
    std::string bytes;
    for (int value = 0; value < 256; ++value) {
        bytes.push_back(static_cast<char>(value));
    }
    for (std::size_t length : {0, 1, 2, 3, 4, 256}) {
        const std::string part = bytes.substr(0, length);
        EXPECT_EQ(base64_decode(base64_encode(part)), part) << length;
    }
    EXPECT_EQ(base64_encode("foobar"), "Zm9vYmFy");
    EXPECT_EQ(base64_decode("Zm9v\nYmE="), "fooba");
    EXPECT_EQ(base64_decode("Zm9"), std::nullopt);
    EXPECT_EQ(base64_decode("Zm9*"), std::nullopt);
}

TEST(FileMessages, TheWireNamesAreTheDocumentedOnes) {
    EXPECT_EQ(file_request_type, "cellblock_file_request");
    EXPECT_EQ(file_reply_type, "cellblock_file_reply");
    EXPECT_EQ(file_op_name(FileOp::remove), "delete");
    EXPECT_EQ(encode_file_request({FileOp::list, "", "", 10}), json({{"op", "list"}}));
    EXPECT_EQ(encode_file_request({FileOp::remove, "a/b.txt", "", 10}),
              json({{"op", "delete"}, {"path", "a/b.txt"}}));
    EXPECT_EQ(encode_file_request({FileOp::write, "w.bin", "foo", 10}),
              json({{"op", "write"}, {"path", "w.bin"}, {"max_bytes", 10}, {"data", "Zm9v"}}));
}

TEST(FileMessages, ARequestSurvivesTheWire) {
    const std::string bytes("\0\x01\xff binary", 10);
    const FileRequest written =
        decode_file_request(encode_file_request({FileOp::write, "d/w.bin", bytes, 99}));
    EXPECT_EQ(written.op, FileOp::write);
    EXPECT_EQ(written.path, "d/w.bin");
    EXPECT_EQ(written.bytes, bytes);
    EXPECT_EQ(written.max_bytes, 99U);
    const FileRequest read = decode_file_request(encode_file_request({FileOp::read, "r.txt", "", 5}));
    EXPECT_EQ(read.op, FileOp::read);
    EXPECT_EQ(read.path, "r.txt");
    EXPECT_EQ(read.max_bytes, 5U);
    EXPECT_EQ(decode_file_request(encode_file_request({FileOp::remove, "x", "", 0})).op, FileOp::remove);
}

TEST(FileMessages, TheCapIsHeldToTheCeiling) {
    const FileRequest request =
        decode_file_request({{"op", "read"}, {"path", "a"}, {"max_bytes", 1ULL << 62}});
    EXPECT_EQ(request.max_bytes, max_file_bytes);
    EXPECT_EQ(decode_file_request({{"op", "read"}, {"path", "a"}}).max_bytes, max_file_bytes);
    // Data above the ceiling is refused before it is decoded.
    const std::string huge(4 * ((max_file_bytes + 2) / 3) + 4, 'A');
    EXPECT_EQ(failure_of({{"op", "write"}, {"path", "a"}, {"data", huge}}), FileFailure::too_large);
}

TEST(FileMessages, AMalformedRequestIsABadRequest) {
    EXPECT_EQ(failure_of(json::array()), FileFailure::bad_request);
    EXPECT_EQ(failure_of({{"op", "rename"}, {"path", "a"}}), FileFailure::bad_request);
    EXPECT_EQ(failure_of({{"op", 1}}), FileFailure::bad_request);
    EXPECT_EQ(failure_of({{"op", "read"}}), FileFailure::bad_request);
    EXPECT_EQ(failure_of({{"op", "read"}, {"path", "a"}, {"max_bytes", -1}}), FileFailure::bad_request);
    EXPECT_EQ(failure_of({{"op", "write"}, {"path", "a"}}), FileFailure::bad_request);
    EXPECT_EQ(failure_of({{"op", "write"}, {"path", "a"}, {"data", "not base64!"}}),
              FileFailure::bad_request);
}

TEST(FileMessages, RepliesSurviveTheWire) {
    FileReply listed;
    listed.files = {{"a.txt", 3}, {"d/b.bin", 0}};
    const json list_content = encode_file_reply(FileOp::list, listed);
    EXPECT_EQ(list_content["status"], "ok");
    const FileReply list = decode_file_reply(FileOp::list, list_content);
    ASSERT_EQ(list.files.size(), 2U);
    EXPECT_EQ(list.files[1].path, "d/b.bin");
    EXPECT_EQ(list.files[0].size, 3U);
    FileReply read;
    read.bytes = std::string("\0bytes", 6);
    EXPECT_EQ(decode_file_reply(FileOp::read, encode_file_reply(FileOp::read, read)).bytes, read.bytes);
    FileReply written;
    written.path = "w.txt";
    EXPECT_EQ(encode_file_reply(FileOp::write, written), json({{"status", "ok"}, {"path", "w.txt"}}));
    EXPECT_EQ(decode_file_reply(FileOp::remove, encode_file_reply(FileOp::remove, written)).path, "w.txt");
}

TEST(FileMessages, AnErrorReplyNamesItsFailure) {
    FileReply refused;
    refused.failure = FileFailure::not_found;
    refused.message = "no such file: a.txt";
    const json content = encode_file_reply(FileOp::read, refused);
    EXPECT_EQ(content,
              json({{"status", "error"}, {"reason", "not_found"}, {"message", "no such file: a.txt"}}));
    const FileReply decoded = decode_file_reply(FileOp::read, content);
    EXPECT_EQ(decoded.failure, FileFailure::not_found);
    EXPECT_EQ(decoded.message, refused.message);
    // A reason this side does not know is still a failure.
    EXPECT_EQ(
        decode_file_reply(FileOp::read, {{"status", "error"}, {"reason", "quota"}, {"message", "m"}}).failure,
        FileFailure::io);
}

TEST(FileMessages, AnUnreadableReplyIsRefused) {
    EXPECT_THROW(decode_file_reply(FileOp::read, json("ok")), FileMessageError);
    EXPECT_THROW(decode_file_reply(FileOp::read, {{"status", "ok"}}), FileMessageError);
    EXPECT_THROW(decode_file_reply(FileOp::list, {{"status", "ok"}, {"files", {{{"path", "a"}}}}}),
                 FileMessageError);
    EXPECT_THROW(decode_file_reply(FileOp::write, {{"status", "maybe"}, {"path", "a"}}), FileMessageError);
}

}  // namespace
}  // namespace cellblock::contract
