#include "server/workspace_files.hpp"

#include <string>

#include "cellblock/contract/file_messages.hpp"
#include "cellblock/sandbox/sandbox.hpp"
#include "common/logging.hpp"

namespace cellblock::kernel {

namespace {

using contract::FileFailure;
using contract::FileOp;
using contract::FileReply;
using contract::FileRequest;

FileFailure failure_of(const sandbox::WorkspaceError& error) {
    using Kind = sandbox::WorkspaceError::Kind;
    switch (error.kind()) {
        case Kind::not_found:
            return FileFailure::not_found;
        case Kind::too_large:
            return FileFailure::too_large;
        case Kind::not_regular:
            return FileFailure::not_regular;
        case Kind::bad_path:
            return FileFailure::bad_path;
        case Kind::io:
            break;
    }
    return FileFailure::io;
}

FileReply refusal(FileFailure failure, std::string message) {
    FileReply reply;
    reply.failure = failure;
    reply.message = std::move(message);
    return reply;
}

FileReply perform(const std::filesystem::path& root, FileRequest& request) {
    const sandbox::Workspace workspace(root);
    FileReply reply;
    switch (request.op) {
        case FileOp::list:
            for (auto& entry : workspace.list()) {
                if (!entry.is_directory) {
                    reply.files.push_back({std::move(entry.path), entry.size});
                }
            }
            break;
        case FileOp::read:
            reply.bytes = workspace.read_file(request.path, request.max_bytes);
            break;
        case FileOp::write:
            workspace.write_file(request.path, request.bytes, request.max_bytes);
            reply.path = request.path;
            break;
        case FileOp::remove:
            workspace.remove_file(request.path);
            reply.path = request.path;
            break;
    }
    return reply;
}

}  // namespace

nlohmann::json answer_file_request(const std::optional<std::filesystem::path>& workspace,
                                   const nlohmann::json& content) {
    FileOp op = FileOp::list;
    FileReply reply;
    std::string path;
    try {
        FileRequest request = contract::decode_file_request(content);
        op = request.op;
        path = request.path;
        reply = workspace ? perform(*workspace, request)
                          : refusal(FileFailure::no_workspace, "this kernel has no workspace");
    } catch (const contract::FileMessageError& error) {
        reply = refusal(error.failure(), error.what());
    } catch (const sandbox::WorkspaceError& error) {
        reply = refusal(failure_of(error), error.what());
    } catch (const std::exception& error) {
        reply = refusal(FileFailure::io, error.what());
    }
    log_event(LogLevel::info, "file_request",
              {{"op", contract::file_op_name(op)},
               {"path", path},
               {"status", reply.failure ? contract::file_failure_name(*reply.failure) : "ok"}});
    try {
        return contract::encode_file_reply(op, reply);
    } catch (const std::exception& error) {  // a file base64 cannot hold (above the ceiling: never read)
        return contract::encode_file_reply(op, refusal(FileFailure::too_large, error.what()));
    }
}

}  // namespace cellblock::kernel
