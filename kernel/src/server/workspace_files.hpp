// The kernel's answer to cellblock_file_request (contract/include/cellblock/contract/file_messages.hpp): the
// gateway's agent file API lists, reads, writes and deletes files of the workspace this kernel's worker runs
// in, through the kernel, so the API reaches a kernel on another host as it reaches a local one. Every path
// goes through sandbox::Workspace, whose rules are the API's: relative paths without '.', '..' or empty
// components, resolved beneath the workspace without following any symlink, regular files only, sizes
// capped.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

namespace cellblock::kernel {

// The reply's content to a request's `content`; never throws (a refused or failed request is an error
// reply naming why). `workspace`: none when the kernel has none (the reply says so). The request's
// max_bytes is held to the contract's max_file_bytes.
nlohmann::json answer_file_request(const std::optional<std::filesystem::path>& workspace,
                                   const nlohmann::json& content);

}  // namespace cellblock::kernel
