#pragma once
// The environment a gateway gives a kernel: which names are allowed, and the document that carries it to a
// kernel launched on another machine (contract/README.md).

#include <map>
#include <stdexcept>
#include <string>
#include <string_view>

namespace cellblock::contract {

using Environment = std::map<std::string, std::string>;

// POSIX's portable name: ^[A-Za-z_][A-Za-z0-9_]*$. Anything else (a `$(...)`, a space, a `=`) is refused
// wherever a name enters, so no name is ever a shell word.
bool valid_environment_name(std::string_view name);

// A value may hold anything but NUL (execve's strings end there).
bool valid_environment_value(std::string_view value);

class InvalidEnvironment : public std::invalid_argument {
  public:
    InvalidEnvironment(const std::string& message, std::string variable)
        : std::invalid_argument(message), variable_(std::move(variable)) {}
    // The offending name, to be named in the error a client sees.
    const std::string& variable() const { return variable_; }

  private:
    std::string variable_;
};

// Throws InvalidEnvironment naming the first bad variable.
void check_environment(const Environment& environment);

// The launch environment document: one line of ASCII JSON, {"version": 1, "environment": {NAME: value}}. One
// line, so that it can sit in a quoted here-document of a job script, which the shell does not evaluate.
std::string encode_environment(const Environment& environment);
// Throws InvalidEnvironment for a document that is not JSON, of another version, or has a bad name or value.
Environment decode_environment(std::string_view document);

}  // namespace cellblock::contract
