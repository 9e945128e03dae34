#pragma once
// Text placed in HTML that Jupyter frontends and the gateway's pages render: the kernel's approval displays
// and the gateway's sign-in page both quote what a client or the worker chose (a host, a method, a path).

#include <string>
#include <string_view>

namespace cellblock::contract {

// `text` with & < > " ' as character references: safe in element content and in quoted attributes.
std::string html_escaped(std::string_view text);

}  // namespace cellblock::contract
