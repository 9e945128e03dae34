// One connection through the egress proxy (egress_proxy.hpp), from its request head to the end of its relay,
// on the proxy's thread. Its steps live in one file each: the request and its refusals
// (egress_session.cpp), the approval it may wait for (egress_approvals.cpp), resolving and connecting to the
// server (egress_upstream.cpp), and the CONNECT tunnel or plain HTTP exchange it relays (egress_relay.cpp).
#pragma once

#include <array>
#include <boost/beast/core/flat_buffer.hpp>

#include "egress/egress_proxy_impl.hpp"
#include "egress/egress_request.hpp"

namespace cellblock::kernel::egress {

enum class Phase { head, deciding, connecting, client_hello, relay, refusing, closed };

class Session : public std::enable_shared_from_this<Session> {
  public:
    Session(EgressProxy::Impl& proxy, tcp::socket client);
    ~Session();
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;

    void start();
    void refuse_busy();

  private:
    struct Pipe {
        tcp::socket* from;
        tcp::socket* to;
        std::vector<char>* buffer;
        std::uint64_t* counter;
        std::optional<std::uint64_t>* remaining;  // plain HTTP's upload: the body's length
        bool done = false;
    };

    // The request (egress_session.cpp).
    void on_head(error_code error);

    // Approval (egress_approvals.cpp).
    void ask();
    void on_decision(Decision decision, const std::string& decided_by);

    // Resolve and connect (egress_upstream.cpp).
    void resolve();
    std::optional<std::string> refusal_reason(const asio::ip::address& address) const;
    void on_resolved(error_code error, const tcp::resolver::results_type& results);
    void refuse_address(const asio::ip::address& address, const std::string& reason);
    void connect(std::vector<tcp::endpoint> endpoints);
    void on_connected(error_code error);

    // The CONNECT tunnel and its ClientHello, plain HTTP, the relay (egress_relay.cpp).
    void establish_tunnel();
    void check_client_hello();
    void refuse_tunnel(const std::string& why);
    void forward_request();
    std::string host_header_value() const;
    void send_buffered_body();
    void allocate_relay_buffers();
    void start_relay(bool tunnel);
    void read_response_head();
    void send_response_head();
    void send_buffered_response();
    void pump(Pipe& pipe);
    void pipe_finished(Pipe& pipe, bool end_of_stream);

    // Refusals, timeouts, end (egress_session.cpp).
    static std::string reason_phrase(http::status status, const std::string& message);
    void refuse(http::status status, const std::string& message, bool policy_allowed = false);
    void drain();
    void fail(error_code error);
    void close();
    void arm(std::chrono::milliseconds limit, std::string reason);
    void on_deadline(error_code error, std::uint64_t generation);

    EgressProxy::Impl& proxy_;
    tcp::socket client_;
    tcp::socket upstream_;
    tcp::resolver resolver_;
    asio::steady_timer deadline_;
    std::string deadline_reason_;
    std::chrono::milliseconds deadline_limit_{0};
    std::uint64_t deadline_generation_ = 0;
    std::optional<std::string> timed_out_;
    Clock::time_point last_activity_ = Clock::now();
    Clock::time_point started_ = Clock::now();
    Phase phase_ = Phase::head;

    beast::flat_buffer head_buffer_{max_request_head_bytes + relay_buffer_bytes};
    std::optional<http::request_parser<http::empty_body>> parser_;
    bool connect_method_ = false;
    std::string origin_form_;
    std::uint64_t body_remaining_ = 0;
    std::optional<http::request<http::empty_body>> outgoing_head_;
    std::optional<http::request_serializer<http::empty_body>> serializer_;
    beast::flat_buffer response_buffer_{max_response_head_bytes + relay_buffer_bytes};
    std::optional<http::response_parser<http::empty_body>> response_parser_;
    std::optional<http::response<http::empty_body>> outgoing_response_;
    std::optional<http::response_serializer<http::empty_body>> response_serializer_;
    std::vector<tcp::endpoint> endpoints_;
    std::string hello_;

    bool tunnel_ = false;
    std::vector<char> up_buffer_;           // empty until allocate_relay_buffers()
    std::vector<char> down_buffer_;         // likewise
    std::array<char, 256> drain_buffer_{};  // what a refused client still sends is read here and dropped
    std::optional<std::uint64_t> upload_limit_;
    std::optional<std::uint64_t> no_limit_;
    Pipe up_{};
    Pipe down_{};

    ConnectionRecord record_;
};

}  // namespace cellblock::kernel::egress
