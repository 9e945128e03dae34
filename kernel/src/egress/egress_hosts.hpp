// The operator's pinned names (`--egress-hosts FILE`, hosts(5) format): a listed name resolves only to its
// listed addresses, and reaching those addresses through that name is exempt from the private-address refusal
// (the operator said so). Names not listed go to the host's resolver.
#pragma once

#include <boost/asio/ip/address.hpp>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace cellblock::kernel::egress {

class HostsFileError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

class PinnedHosts {
  public:
    PinnedHosts() = default;  // nothing pinned

    // Reads a hosts(5) file: `ADDRESS NAME [ALIAS...]`, `#` comments, blank lines; a name listed on several
    // lines gets all their addresses, in file order. Throws HostsFileError "FILE:LINE: what is wrong".
    static PinnedHosts load(const std::filesystem::path& file);
    static PinnedHosts parse(std::string_view text, std::string_view origin);

    // The pinned addresses of `host` (normalized), or nullptr when the name is not pinned.
    const std::vector<boost::asio::ip::address>* lookup(std::string_view host) const;
    bool empty() const { return pinned_.empty(); }

  private:
    std::map<std::string, std::vector<boost::asio::ip::address>, std::less<>> pinned_;
};

}  // namespace cellblock::kernel::egress
