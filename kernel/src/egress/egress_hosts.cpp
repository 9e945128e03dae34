#include "egress/egress_hosts.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "egress/egress_policy.hpp"

namespace cellblock::kernel::egress {
namespace {

std::vector<std::string_view> fields_of(std::string_view line) {
    std::vector<std::string_view> fields;
    std::size_t at = 0;
    while (at < line.size()) {
        while (at < line.size() && (line[at] == ' ' || line[at] == '\t' || line[at] == '\r')) {
            ++at;
        }
        const auto start = at;
        while (at < line.size() && line[at] != ' ' && line[at] != '\t' && line[at] != '\r') {
            ++at;
        }
        if (at > start) {
            fields.push_back(line.substr(start, at - start));
        }
    }
    return fields;
}

}  // namespace

PinnedHosts PinnedHosts::load(const std::filesystem::path& file) {
    std::ifstream stream(file, std::ios::binary);
    if (!stream) {
        throw HostsFileError(file.string() + ": cannot read the egress hosts file: " + std::strerror(errno));
    }
    std::ostringstream text;
    text << stream.rdbuf();
    if (stream.bad()) {
        throw HostsFileError(file.string() + ": reading the egress hosts file failed");
    }
    return parse(text.str(), file.string());
}

PinnedHosts PinnedHosts::parse(std::string_view text, std::string_view origin) {
    PinnedHosts hosts;
    std::size_t line_number = 0;
    while (!text.empty()) {
        ++line_number;
        const auto end = text.find('\n');
        auto line = text.substr(0, end);
        text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
        const auto where = std::string(origin) + ":" + std::to_string(line_number) + ": ";
        if (line.find('\0') != std::string_view::npos) {
            throw HostsFileError(where + "the line contains a NUL byte");
        }
        if (const auto comment = line.find('#'); comment != std::string_view::npos) {
            line = line.substr(0, comment);
        }
        const auto fields = fields_of(line);
        if (fields.empty()) {
            continue;
        }
        if (fields.size() < 2) {
            throw HostsFileError(where + "expected \"ADDRESS NAME [ALIAS...]\", got only \"" +
                                 std::string(fields[0]) + "\"");
        }
        boost::system::error_code error;
        const auto address = boost::asio::ip::make_address(std::string(fields[0]), error);
        if (error) {
            throw HostsFileError(where + "\"" + std::string(fields[0]) + "\" is not an IPv4 or IPv6 address");
        }
        for (std::size_t i = 1; i < fields.size(); ++i) {
            std::string name;
            try {
                name = validated_host(fields[i]);
            } catch (const PolicyError& problem) {
                throw HostsFileError(where + "\"" + std::string(fields[i]) +
                                     "\" is not a host name: " + problem.what());
            }
            if (is_ip_literal(name)) {
                throw HostsFileError(where + "\"" + std::string(fields[i]) +
                                     "\" is an address where a host name belongs");
            }
            auto& addresses = hosts.pinned_[name];
            if (std::find(addresses.begin(), addresses.end(), address) == addresses.end()) {
                addresses.push_back(address);
            }
        }
    }
    return hosts;
}

const std::vector<boost::asio::ip::address>* PinnedHosts::lookup(std::string_view host) const {
    const auto found = pinned_.find(normalize_host(host));
    return found == pinned_.end() ? nullptr : &found->second;
}

}  // namespace cellblock::kernel::egress
