// The kernel's configuration as an operator and the gateway give it (kernel/src/launch/kernel_config.cpp):
// `KernelConfig::load` of the config file, with the CELLBLOCK_* variables the gateway sets per kernel.
//
// Input: the config file's text, then optionally 0x1e and NAME=VALUE lines (the environment).
// Invariants: only ConfigError escapes, with a message; an accepted limit is exactly what the file or the
// variable says (no fraction rounded down, no value wrapped around); every accepted duration is a number of
// seconds from 0 to longest_seconds and memory_mb at most largest_memory_mb (so that the kernel's deadlines
// and the sandbox's byte limit cannot overflow); the tenant is a plain name; the template's environment is
// well formed. UBSan catches an out-of-range conversion.
#include "launch/kernel_config.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "fuzz_support.hpp"

using cellblock::fuzz::require;
using cellblock::kernel::ConfigError;
using cellblock::kernel::KernelConfig;
using nlohmann::json;

namespace {

// The config file lives in memory: load() opens it by path, and /proc/self/fd/N opens the memfd afresh.
class ConfigFile {
  public:
    ConfigFile() : fd_(::memfd_create("kernel-config", MFD_CLOEXEC)) { require(fd_ >= 0, "memfd_create"); }
    ~ConfigFile() { ::close(fd_); }
    ConfigFile(const ConfigFile&) = delete;
    ConfigFile& operator=(const ConfigFile&) = delete;

    std::string write(std::string_view text) const {
        require(::ftruncate(fd_, 0) == 0, "ftruncate");
        require(::pwrite(fd_, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size()), "pwrite");
        return "/proc/self/fd/" + std::to_string(fd_);
    }

  private:
    int fd_;
};

bool within_seconds(double seconds) {
    return std::isfinite(seconds) && seconds >= 0 && seconds <= cellblock::kernel::longest_seconds;
}

bool plain_tenant(const std::string& tenant) {
    if (tenant.size() > cellblock::kernel::longest_tenant_name || tenant == "." || tenant == "..")
        return false;
    for (char c : tenant)
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
              c == '_' || c == '.'))
            return false;
    return true;
}

// The file's value at `key` of `object` as the exact number it wrote, if it wrote one.
template <typename T>
void require_as_written(const json& file, const char* object, const char* key, T accepted, const char* what) {
    if (!file.contains(object) || !file[object].is_object() || !file[object].contains(key))
        return;
    const json& written = file[object][key];
    if constexpr (std::is_integral_v<T>)
        require(written.is_number_unsigned() && written.get<std::uint64_t>() == accepted, what);
    else
        require(written.is_number() && written.get<double>() == accepted, what);
}

template <typename T>
void require_variable_as_written(const std::map<std::string, std::string>& variables, const char* name,
                                 T accepted, const char* what) {
    auto found = variables.find(name);
    if (found == variables.end() || found->second.empty())
        return;
    T written{};
    const auto* last = found->second.data() + found->second.size();
    const auto [end, error] = std::from_chars(found->second.data(), last, written);
    require(error == std::errc{} && end == last && written == accepted, what);
}

void check(std::string_view file_text, const std::map<std::string, std::string>& variables) {
    static const ConfigFile file;
    const std::string path = file.write(file_text);
    KernelConfig config;
    try {
        config = KernelConfig::load(path, [&](const std::string& name) -> std::optional<std::string> {
            auto found = variables.find(name);
            // As process_environment(): an empty variable is unset.
            if (found == variables.end() || found->second.empty())
                return std::nullopt;
            return found->second;
        });
    } catch (const ConfigError& error) {
        require(error.what()[0] != '\0', "a refusal says why");
        return;
    }
    const auto& limits = config.limits;
    require(within_seconds(limits.timeout_s) && within_seconds(limits.interrupt_grace_s),
            "limits in seconds");
    require(within_seconds(config.worker_start_timeout_s) && config.worker_start_timeout_s > 0,
            "a positive start timeout in seconds");
    require(limits.memory_mb <= cellblock::kernel::largest_memory_mb, "memory_mb fits in bytes");
    require(config.python.is_absolute(), "python is an absolute path");
    require(plain_tenant(config.zygote.tenant), "a plain tenant name");
    if (config.zygote.generation_forks)
        require(*config.zygote.generation_forks >= 1 && *config.zygote.generation_forks <= 1000000,
                "generation forks in range");
    if (config.zygote.generation_seconds)
        require(within_seconds(*config.zygote.generation_seconds) && *config.zygote.generation_seconds > 0,
                "generation seconds in range");
    if (config.network_policy)
        require(config.network_policy->is_object(), "a network policy is an object");
    for (const auto& variable : config.zygote.template_environment())
        require(variable.starts_with("CELLBLOCK_ZYGOTE_") && variable.find('=') != std::string::npos &&
                    variable.find('\0') == std::string::npos,
                "the template's environment is NAME=VALUE");

    const json written = json::parse(file_text, nullptr, false);
    require(!written.is_discarded(), "an accepted file is JSON");
    if (!variables.contains("CELLBLOCK_TIMEOUT_S") || variables.at("CELLBLOCK_TIMEOUT_S").empty())
        require_as_written(written, "limits", "timeout_s", limits.timeout_s, "timeout_s as written");
    if (!variables.contains("CELLBLOCK_MEMORY_MB") || variables.at("CELLBLOCK_MEMORY_MB").empty())
        require_as_written(written, "limits", "memory_mb", limits.memory_mb, "memory_mb as written");
    if (!variables.contains("CELLBLOCK_OUTPUT_BYTES") || variables.at("CELLBLOCK_OUTPUT_BYTES").empty())
        require_as_written(written, "limits", "output_bytes", limits.output_bytes, "output_bytes as written");
    if (config.zygote.generation_forks)
        require_as_written(written, "worker", "zygote_generation_forks",
                           static_cast<std::uint64_t>(*config.zygote.generation_forks), "forks as written");
    require_variable_as_written(variables, "CELLBLOCK_TIMEOUT_S", limits.timeout_s, "CELLBLOCK_TIMEOUT_S");
    require_variable_as_written(variables, "CELLBLOCK_INTERRUPT_GRACE_S", limits.interrupt_grace_s,
                                "CELLBLOCK_INTERRUPT_GRACE_S");
    require_variable_as_written(variables, "CELLBLOCK_MEMORY_MB", limits.memory_mb, "CELLBLOCK_MEMORY_MB");
    require_variable_as_written(variables, "CELLBLOCK_OUTPUT_BYTES", limits.output_bytes,
                                "CELLBLOCK_OUTPUT_BYTES");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string_view input = cellblock::fuzz::as_text(data, size);
    const std::size_t split = input.find(cellblock::fuzz::frame_separator);
    const auto variables = split == std::string_view::npos
                               ? std::map<std::string, std::string>()
                               : cellblock::fuzz::environment_lines(input.substr(split + 1));
    check(input.substr(0, split), variables);
    return 0;
}
