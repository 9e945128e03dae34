#include "worker/reply_builders.hpp"

namespace cellblock::kernel {

nlohmann::json make_error_reply(const std::string& ename, const std::string& evalue,
                                const nlohmann::json& traceback) {
    nlohmann::json lines = traceback.is_array() ? traceback : nlohmann::json::array({ename + ": " + evalue});
    return {{"status", "error"}, {"ename", ename}, {"evalue", evalue}, {"traceback", std::move(lines)}};
}

nlohmann::json make_execute_ok_reply(nlohmann::json payload, nlohmann::json user_expressions) {
    return {{"status", "ok"},
            {"payload", payload.is_array() ? std::move(payload) : nlohmann::json::array()},
            {"user_expressions",
             user_expressions.is_object() ? std::move(user_expressions) : nlohmann::json::object()}};
}

std::vector<std::string> traceback_lines(const nlohmann::json& traceback) {
    std::vector<std::string> lines;
    if (!traceback.is_array()) {
        return lines;
    }
    for (const auto& line : traceback) {
        lines.push_back(line.is_string() ? line.get<std::string>() : line.dump());
    }
    return lines;
}

nlohmann::json make_kernel_info_reply(const KernelIdentity& identity) {
    const std::string python_major_minor =
        identity.python_version.substr(0, identity.python_version.rfind('.'));
    return {
        {"status", "ok"},
        {"protocol_version", "5.3"},
        {"implementation", "cellblock"},
        {"implementation_version", identity.implementation_version},
        {"language_info",
         {{"name", "python"},
          {"version", identity.python_version},
          {"mimetype", "text/x-python"},
          {"file_extension", ".py"},
          {"pygments_lexer", "ipython3"},
          {"codemirror_mode", {{"name", "ipython"}, {"version", 3}}},
          {"nbconvert_exporter", "python"}}},
        {"banner", "cellblock " + identity.implementation_version + " - Python " + identity.python_version +
                       " with IPython, running in a confined worker (no network, private filesystem)\n"},
        {"debugger", false},
        {"help_links",
         nlohmann::json::array(
             {{{"text", "Python Reference"}, {"url", "https://docs.python.org/" + python_major_minor}},
              {{"text", "IPython Reference"}, {"url", "https://ipython.org/documentation.html"}},
              {{"text", "NumPy Reference"}, {"url", "https://docs.scipy.org/doc/numpy/reference/"}},
              {{"text", "pandas Reference"}, {"url", "https://pandas.pydata.org/pandas-docs/stable/"}},
              {{"text", "Matplotlib Reference"}, {"url", "https://matplotlib.org/contents.html"}}})}};
}

nlohmann::json make_empty_complete_reply(int cursor_pos) {
    return {{"status", "ok"},
            {"matches", nlohmann::json::array()},
            {"cursor_start", cursor_pos},
            {"cursor_end", cursor_pos},
            {"metadata", nlohmann::json::object()}};
}

nlohmann::json make_not_found_inspect_reply() {
    return {{"status", "ok"},
            {"found", false},
            {"data", nlohmann::json::object()},
            {"metadata", nlohmann::json::object()}};
}

nlohmann::json make_unknown_is_complete_reply() {
    return {{"status", "unknown"}};
}

}  // namespace cellblock::kernel
