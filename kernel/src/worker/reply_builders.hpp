// Reply contents built by hand: xeus 2.4.1's create_error_reply swaps ename and evalue, and the kernel
// needs a few replies of its own (kernel_info, fallbacks when no worker is available).
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace cellblock::kernel {

// {"status":"error","ename","evalue","traceback"}; a non-array traceback becomes ["ename: evalue"].
nlohmann::json make_error_reply(const std::string& ename, const std::string& evalue,
                                const nlohmann::json& traceback = nullptr);
// {"status":"ok","payload":[...],"user_expressions":{...}}
nlohmann::json make_execute_ok_reply(nlohmann::json payload, nlohmann::json user_expressions);
// The traceback as strings (the worker sends a JSON array; anything else is rendered).
std::vector<std::string> traceback_lines(const nlohmann::json& traceback);

struct KernelIdentity {
    std::string implementation_version;  // cellblock's version
    std::string python_version;          // "3.11.2"
};
nlohmann::json make_kernel_info_reply(const KernelIdentity& identity);

// When the worker cannot answer (not started, died): empty but well-formed replies.
nlohmann::json make_empty_complete_reply(int cursor_pos);
nlohmann::json make_not_found_inspect_reply();
nlohmann::json make_unknown_is_complete_reply();

}  // namespace cellblock::kernel
