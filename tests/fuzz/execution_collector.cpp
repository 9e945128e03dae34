// What a kernel sends back for one agent execute, as the gateway turns it into an answer and a notebook cell
// (gateway/src/agent/execution.cpp ExecutionCollector: consume, then notebook_outputs for the cell that the
// store and `GET .../notebook` keep). The kernel is trusted, but the content of its messages carries what
// user code made (display bundles, metadata, counts) and a kernelspec the gateway serves may be any Jupyter
// kernel.
//
// Input: messages separated by 0x1e. Each starts with a kind byte (its value modulo the kinds below: channel
// and msg_type; bit 7 set gives the message a parent header of another request), then its content JSON text,
// then optionally 0x1f and its metadata JSON text.
// Invariants: nothing escapes consume or notebook_outputs; a message of another request is not consumed and
// changes nothing; complete() exactly when an execute_reply and an idle status of this request came;
// notebook_outputs are nbformat 4 outputs (output_type stream, execute_result, display_data or error; a
// stream has name stdout or stderr and string text; no two streams of one name follow each other), their
// stream texts joined are stdout_text() and stderr_text(), a replaced stream appears once with its
// replacement, and every output serialises as valid UTF-8 (as the store writes it).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "cellblock/gateway/agent/execution.hpp"
#include "fuzz_support.hpp"

using cellblock::fuzz::require;
using cellblock::gateway::Channel;
using cellblock::gateway::JupyterMessage;
using cellblock::gateway::agent::ExecutionCollector;
using nlohmann::json;

namespace {

constexpr std::string_view our_msg_id = "5f0c1d2e-3b4a-4c5d-8e6f-7a8b9c0d1e2f";

struct Kind {
    Channel channel;
    const char* msg_type;
};
constexpr Kind kinds[] = {
    {Channel::iopub, "status"},
    {Channel::iopub, "stream"},
    {Channel::iopub, "execute_input"},
    {Channel::iopub, "execute_result"},
    {Channel::iopub, "display_data"},
    {Channel::iopub, "error"},
    {Channel::iopub, "clear_output"},
    {Channel::iopub, "update_display_data"},
    {Channel::shell, "execute_reply"},
    {Channel::shell, "kernel_info_reply"},
    {Channel::control, "interrupt_reply"},
    {Channel::stdin_, "input_request"},
};

JupyterMessage message_of(std::string_view frame) {
    JupyterMessage message;
    const auto kind_byte = static_cast<unsigned char>(frame.empty() ? 0 : frame.front());
    const Kind& kind = kinds[(kind_byte & 0x7f) % std::size(kinds)];
    message.channel = kind.channel;
    message.msg_type = kind.msg_type;
    message.msg_id = "reply-1";
    message.header = json{{"msg_id", message.msg_id}, {"msg_type", message.msg_type}}.dump();
    // Another request's parent still names ours somewhere, so the cheap text filter lets it through.
    message.parent_header = (kind_byte & 0x80) != 0
                                ? json{{"msg_id", "another"}, {"note", our_msg_id}}.dump()
                                : json{{"msg_id", our_msg_id}, {"msg_type", "execute_request"}}.dump();
    const std::string_view body = frame.empty() ? frame : frame.substr(1);
    const auto split = body.find('\x1f');
    message.content = std::string(body.substr(0, split));
    message.metadata = split == std::string_view::npos ? "{}" : std::string(body.substr(split + 1));
    return message;
}

bool of_this_request(std::string_view frame) {
    return frame.empty() || (static_cast<unsigned char>(frame.front()) & 0x80) == 0;
}

bool valid_utf8(const json& value) {
    try {
        (void)value.dump();  // the strict handler throws on invalid UTF-8
        return true;
    } catch (const json::type_error&) {
        return false;
    }
}

// The notebook outputs' stream texts of one name, joined; and how many stream outputs of that name.
std::pair<std::string, int> streams_named(const json& outputs, const char* name) {
    std::string joined;
    int count = 0;
    for (const json& output : outputs)
        if (output["output_type"] == "stream" && output["name"] == name) {
            joined += output["text"].get<std::string>();
            ++count;
        }
    return {joined, count};
}

void check_outputs(const ExecutionCollector& collector, const json& outputs) {
    require(outputs.is_array(), "outputs are a list");
    std::string previous_stream;
    for (const json& output : outputs) {
        require(output.is_object() && output.contains("output_type") && output["output_type"].is_string(),
                "an output has an output_type");
        const std::string type = output["output_type"].get<std::string>();
        require(type == "stream" || type == "execute_result" || type == "display_data" || type == "error",
                "an nbformat 4 output type");
        if (type == "stream") {
            require(output.contains("name") && (output["name"] == "stdout" || output["name"] == "stderr"),
                    "a stream is stdout or stderr");
            require(output.contains("text") && output["text"].is_string(), "a stream's text is a string");
            require(output["name"].get<std::string>() != previous_stream,
                    "adjacent streams of a name merged");
            previous_stream = output["name"].get<std::string>();
        } else {
            previous_stream.clear();
        }
        if (type == "execute_result" || type == "display_data")
            require(output.contains("data") && output["data"].is_object() && output.contains("metadata") &&
                        output["metadata"].is_object(),
                    "a result or display has a mime bundle and metadata objects");
        if (type == "execute_result")
            require(output.contains("execution_count") && (output["execution_count"].is_null() ||
                                                           output["execution_count"].is_number_integer()),
                    "a result's execution_count is a number or null");
        if (type == "error") {
            require(output.contains("ename") && output["ename"].is_string() && output.contains("evalue") &&
                        output["evalue"].is_string(),
                    "an error's ename and evalue are strings");
            require(output.contains("traceback") && output["traceback"].is_array(), "a traceback is a list");
            for (const json& line : output["traceback"])
                require(line.is_string(), "a traceback's lines are strings");
        }
        require(valid_utf8(output), "an output serialises as valid UTF-8");
    }
    (void)collector;
}

void run(std::string_view input) {
    ExecutionCollector collector(std::string(our_msg_id), [](const json& event) {
        require(event.is_object() && event.contains("type"), "an event has a type");
    });
    bool reply_seen = false, idle_seen = false;
    std::size_t at = 0;
    while (at <= input.size()) {
        const std::size_t end = std::min(input.find(cellblock::fuzz::frame_separator, at), input.size());
        const std::string_view frame = input.substr(at, end - at);
        at = end + 1;
        const JupyterMessage message = message_of(frame);
        const std::string stdout_before = collector.stdout_text(), stderr_before = collector.stderr_text();
        const bool consumed = collector.consume(message);
        require(consumed == of_this_request(frame), "only this request's messages are consumed");
        if (!consumed) {
            require(collector.stdout_text() == stdout_before && collector.stderr_text() == stderr_before,
                    "another request's message changes nothing");
            continue;
        }
        if (message.msg_type == "execute_reply")
            reply_seen = true;
        if (message.msg_type == "status") {
            const json content = json::parse(message.content, nullptr, false);
            if (content.is_object() && content.contains("execution_state") &&
                content["execution_state"] == "idle")
                idle_seen = true;
        }
        require(collector.complete() == (reply_seen && idle_seen), "complete after the reply and the idle");
    }

    const json outputs = collector.notebook_outputs(std::nullopt, std::nullopt);
    check_outputs(collector, outputs);
    require(streams_named(outputs, "stdout").first == collector.stdout_text(),
            "stdout joined is stdout_text");
    require(streams_named(outputs, "stderr").first == collector.stderr_text(),
            "stderr joined is stderr_text");

    const json shielded =
        collector.notebook_outputs(std::string("[stdout saved]"), std::string("[stderr saved]"));
    check_outputs(collector, shielded);
    for (const char* name : {"stdout", "stderr"}) {
        const auto [plain_text, plain_count] = streams_named(outputs, name);
        const auto [text, count] = streams_named(shielded, name);
        require(count == (plain_count > 0 ? 1 : 0), "a replaced stream appears once");
        if (count == 1)
            require(text == std::string("[") + name + " saved]", "with its replacement");
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    run(cellblock::fuzz::as_text(data, size));
    return 0;
}
