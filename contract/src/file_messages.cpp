#include "cellblock/contract/file_messages.hpp"

#include <algorithm>
#include <array>
#include <utility>

#include "cellblock/contract/base64.hpp"

namespace cellblock::contract {

namespace {

using nlohmann::json;

constexpr std::array<std::pair<FileOp, std::string_view>, 4> op_names = {{
    {FileOp::list, "list"},
    {FileOp::read, "read"},
    {FileOp::write, "write"},
    {FileOp::remove, "delete"},
}};

constexpr std::array<std::pair<FileFailure, std::string_view>, 7> failure_names = {{
    {FileFailure::bad_request, "bad_request"},
    {FileFailure::bad_path, "bad_path"},
    {FileFailure::not_found, "not_found"},
    {FileFailure::not_regular, "not_regular"},
    {FileFailure::too_large, "too_large"},
    {FileFailure::io, "io"},
    {FileFailure::no_workspace, "no_workspace"},
}};

// Which message a helper reads, for its error's text.
using Message = std::string_view;

[[noreturn]] void malformed(Message message, const std::string& what) {
    throw FileMessageError(FileFailure::bad_request, std::string(message) + ": " + what);
}

// The length of the base64 text of `bytes` bytes.
constexpr std::uint64_t encoded_size(std::uint64_t bytes) {
    return 4 * ((bytes + 2) / 3);
}

std::string string_member(Message message, const json& content, const char* key) {
    const auto found = content.find(key);
    if (found == content.end() || !found->is_string()) {
        malformed(message, std::string("\"") + key + "\" must be a string");
    }
    return found->get<std::string>();
}

std::string decoded(Message message, const std::string& text) {
    auto bytes = base64_decode(text);
    if (!bytes) {
        malformed(message, "\"data\" is not valid base64");
    }
    return std::move(*bytes);
}

}  // namespace

std::string_view file_op_name(FileOp op) {
    for (const auto& [known, name] : op_names) {
        if (known == op) {
            return name;
        }
    }
    return "list";
}

std::string_view file_failure_name(FileFailure failure) {
    for (const auto& [known, name] : failure_names) {
        if (known == failure) {
            return name;
        }
    }
    return "io";
}

json encode_file_request(const FileRequest& request) {
    json content = {{"op", file_op_name(request.op)}};
    if (request.op != FileOp::list) {
        content["path"] = request.path;
    }
    if (request.op == FileOp::read || request.op == FileOp::write) {
        content["max_bytes"] = request.max_bytes;
    }
    if (request.op == FileOp::write) {
        content["data"] = base64_encode(request.bytes);
    }
    return content;
}

FileRequest decode_file_request(const json& content) {
    if (!content.is_object()) {
        malformed(file_request_type, "the content must be an object");
    }
    FileRequest request;
    const std::string op = string_member(file_request_type, content, "op");
    const auto known = std::find_if(op_names.begin(), op_names.end(),
                                    [&op](const auto& entry) { return entry.second == op; });
    if (known == op_names.end()) {
        malformed(file_request_type, "\"op\" must be list, read, write or delete, not \"" + op + "\"");
    }
    request.op = known->first;
    if (request.op == FileOp::list) {
        return request;
    }
    request.path = string_member(file_request_type, content, "path");
    if (request.op == FileOp::remove) {
        return request;
    }
    if (const auto cap = content.find("max_bytes"); cap != content.end()) {
        if (!cap->is_number_unsigned()) {
            malformed(file_request_type, "\"max_bytes\" must be a non-negative integer");
        }
        request.max_bytes = std::min(cap->get<std::uint64_t>(), max_file_bytes);
    }
    if (request.op == FileOp::write) {
        const std::string data = string_member(file_request_type, content, "data");
        if (data.size() > encoded_size(max_file_bytes)) {
            throw FileMessageError(FileFailure::too_large,
                                   "the file is larger than " + std::to_string(max_file_bytes) + " bytes");
        }
        request.bytes = decoded(file_request_type, data);
    }
    return request;
}

json encode_file_reply(FileOp op, const FileReply& reply) {
    if (reply.failure) {
        return {
            {"status", "error"}, {"reason", file_failure_name(*reply.failure)}, {"message", reply.message}};
    }
    json content = {{"status", "ok"}};
    switch (op) {
        case FileOp::list: {
            json files = json::array();
            for (const FileEntry& entry : reply.files) {
                files.push_back({{"path", entry.path}, {"size", entry.size}});
            }
            content["files"] = std::move(files);
            break;
        }
        case FileOp::read:
            content["data"] = base64_encode(reply.bytes);
            break;
        case FileOp::write:
        case FileOp::remove:
            content["path"] = reply.path;
            break;
    }
    return content;
}

FileReply decode_file_reply(FileOp op, const json& content) {
    if (!content.is_object()) {
        malformed(file_reply_type, "the content must be an object");
    }
    FileReply reply;
    const std::string status = string_member(file_reply_type, content, "status");
    if (status == "error") {
        const std::string reason = string_member(file_reply_type, content, "reason");
        const auto known = std::find_if(failure_names.begin(), failure_names.end(),
                                        [&reason](const auto& entry) { return entry.second == reason; });
        // A reason of a newer kernel: the request failed, for a cause this side cannot name.
        reply.failure = known != failure_names.end() ? known->first : FileFailure::io;
        reply.message = string_member(file_reply_type, content, "message");
        return reply;
    }
    if (status != "ok") {
        malformed(file_reply_type, "\"status\" must be ok or error, not \"" + status + "\"");
    }
    switch (op) {
        case FileOp::list: {
            const auto files = content.find("files");
            if (files == content.end() || !files->is_array()) {
                malformed(file_reply_type, "\"files\" must be an array");
            }
            for (const json& entry : *files) {
                if (!entry.is_object() || !entry.contains("size") || !entry["size"].is_number_unsigned()) {
                    malformed(file_reply_type, "each file must be {\"path\": string, \"size\": integer}");
                }
                reply.files.push_back(
                    {string_member(file_reply_type, entry, "path"), entry["size"].get<std::uint64_t>()});
            }
            break;
        }
        case FileOp::read:
            reply.bytes = decoded(file_reply_type, string_member(file_reply_type, content, "data"));
            break;
        case FileOp::write:
        case FileOp::remove:
            reply.path = string_member(file_reply_type, content, "path");
            break;
    }
    return reply;
}

}  // namespace cellblock::contract
