#include "cellblock/contract/html_text.hpp"

#include <gtest/gtest.h>

namespace cellblock::contract {
namespace {

TEST(HtmlText, MarkupAndQuotesBecomeCharacterReferences) {
    EXPECT_EQ(html_escaped("<img src=x onerror='alert(1)'> & \"q\""),
              "&lt;img src=x onerror=&#39;alert(1)&#39;&gt; &amp; &quot;q&quot;");
}

TEST(HtmlText, OtherTextIsUnchanged) {
    EXPECT_EQ(html_escaped("example.com:443 CONNECT ü"), "example.com:443 CONNECT ü");
    EXPECT_EQ(html_escaped(""), "");
}

}  // namespace
}  // namespace cellblock::contract
