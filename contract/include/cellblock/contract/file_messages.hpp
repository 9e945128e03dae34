#pragma once
// The workspace file requests: the gateway's agent file API (list, read, write, delete) asks the kernel that
// owns the workspace on its control channel, so the API reaches a kernel on another host (a Slurm job) as it
// reaches a local one. The kernel answers them with sandbox::Workspace
// (kernel/src/server/workspace_files.cpp).
//
// cellblock_file_request content: {"op": "list" | "read" | "write" | "delete", "path": string (not for list),
// "data": base64 (write only), "max_bytes": integer (the sender's cap for read and write)}.
// cellblock_file_reply content: {"status": "ok", "files": [{"path", "size"}]} (list), {"status": "ok",
// "data": base64} (read), {"status": "ok", "path"} (write, delete); or {"status": "error", "reason",
// "message"} with a reason of file_failure_name().

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace cellblock::contract {

inline constexpr std::string_view file_request_type = "cellblock_file_request";
inline constexpr std::string_view file_reply_type = "cellblock_file_reply";

// The largest file read or written through a file request, whoever asks: the gateway's default cap and the
// ceiling the kernel holds a request's max_bytes to.
inline constexpr std::uint64_t max_file_bytes = std::uint64_t{512} << 20;

enum class FileOp { list, read, write, remove };
// "list", "read", "write", "delete".
std::string_view file_op_name(FileOp op);

// Why a file request failed; the reply's reason is its name.
enum class FileFailure {
    bad_request,   // the request is not one of the above
    bad_path,      // the path leaves the workspace, is empty, absolute, or goes through a symlink
    not_found,     // no such file
    not_regular,   // a directory or another non-regular file
    too_large,     // above the cap
    io,            // the file system failed
    no_workspace,  // the kernel has no workspace
};
// "bad_request", "bad_path", "not_found", "not_regular", "too_large", "io", "no_workspace".
std::string_view file_failure_name(FileFailure failure);

// A message that is not what this header describes; `failure()` is what a reply to it says.
class FileMessageError : public std::runtime_error {
  public:
    FileMessageError(FileFailure failure, const std::string& message)
        : std::runtime_error(message), failure_(failure) {}
    FileFailure failure() const noexcept { return failure_; }

  private:
    FileFailure failure_;
};

struct FileRequest {
    FileOp op = FileOp::list;
    std::string path;                          // workspace-relative; empty for list
    std::string bytes;                         // write: the file's content
    std::uint64_t max_bytes = max_file_bytes;  // read, write: larger files are refused (too_large)
};

// The request's content. Throws std::length_error for bytes base64 cannot hold.
nlohmann::json encode_file_request(const FileRequest& request);
// Throws FileMessageError (bad_request; too_large for data above max_file_bytes, refused before it is
// decoded). max_bytes is held to max_file_bytes.
FileRequest decode_file_request(const nlohmann::json& content);

struct FileEntry {
    std::string path;  // workspace-relative, '/'-separated
    std::uint64_t size = 0;
};

struct FileReply {
    std::optional<FileFailure> failure;  // set: an error reply
    std::string message;                 // an error reply's explanation
    std::vector<FileEntry> files;        // list
    std::string bytes;                   // read
    std::string path;                    // write, delete
};

// The reply's content to a request of `op`.
nlohmann::json encode_file_reply(FileOp op, const FileReply& reply);
// The reply to a request of `op`; throws FileMessageError (bad_request) for content that is not one.
FileReply decode_file_reply(FileOp op, const nlohmann::json& content);

}  // namespace cellblock::contract
