// cellblock-floor-kernel: the least a Jupyter kernel on libzmq with an out-of-process worker must do, and
// nothing more, so that bench_floors.py can measure what this machine charges for it (the kernel CPU target,
// `1+1` and cold-start targets). It is a benchmark instrument, never a kernel to use: one thread (plus
// libzmq's I/O thread), no confinement, no limits, no ordering guarantees beyond its own sequence, and a
// "worker" that answers every request with `2` after keeping its CPU busy for as long as it is told (the time
// IPython takes to run the cell, so that the kernel's output comes in two bursts, as with a real worker).
//
// Per execute_request it does what any such kernel must: check the HMAC-SHA256 signature, parse header and
// content, publish `busy` and `execute_input`, send one frame to the worker and read its answer, publish
// `execute_result`, send the `execute_reply`, publish `idle`; every message signed, its header, parent header
// and content JSON. It links only libzmq, libcrypto and the C++ runtime, so its start is the loader's floor
// too.
//
//     cellblock-floor-kernel CONNECTION_FILE [WORKER_MICROSECONDS]
#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>
#include <zmq.hpp>
#include <zmq_addon.hpp>

namespace {

using nlohmann::json;

constexpr std::string_view delimiter = "<IDS|MSG>";

[[noreturn]] void fail_errno(const char* what) {
    throw std::system_error(errno, std::generic_category(), what);
}

// The answering end of a worker: a child process that reads length-prefixed frames and answers each with "2"
// after `busy` of CPU time (spent, not slept: a real worker occupies a core meanwhile).
class EchoWorker {
  public:
    explicit EchoWorker(std::chrono::microseconds busy) {
        std::array<int, 2> ends{};
        if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends.data()) != 0) {
            fail_errno("socketpair");
        }
        pid_ = ::fork();
        if (pid_ < 0) {
            const int error = errno;
            ::close(ends[0]);
            ::close(ends[1]);
            errno = error;
            fail_errno("fork");
        }
        if (pid_ == 0) {
            ::close(ends[0]);
            serve(ends[1], busy);
        }
        ::close(ends[1]);
        fd_ = ends[0];
    }
    ~EchoWorker() {
        ::close(fd_);  // the worker reads an end of file and exits
        int status = 0;
        ::waitpid(pid_, &status, 0);
    }
    EchoWorker(const EchoWorker&) = delete;
    EchoWorker& operator=(const EchoWorker&) = delete;

    std::string exchange(const std::string& request) {
        write_frame(fd_, request);
        std::string answer;
        if (!read_frame(fd_, answer)) {
            throw std::runtime_error("the echo worker closed its channel");
        }
        return answer;
    }

  private:
    // Never returns into the kernel's code: the child leaves with _exit, also when the kernel has gone.
    [[noreturn]] static void serve(int fd, std::chrono::microseconds busy) noexcept {
        try {
            std::string request;
            while (read_frame(fd, request)) {
                const auto until = std::chrono::steady_clock::now() + busy;
                while (std::chrono::steady_clock::now() < until) {
                }
                write_frame(fd, "2");
            }
        } catch (const std::exception&) {
            ::_exit(1);
        }
        ::_exit(0);
    }
    static void write_frame(int fd, const std::string& payload) {
        std::string frame(4, '\0');
        const auto length = static_cast<std::uint32_t>(payload.size());
        std::memcpy(frame.data(), &length, sizeof length);
        frame += payload;
        std::size_t written = 0;
        while (written < frame.size()) {
            const ssize_t n = ::write(fd, frame.data() + written, frame.size() - written);
            if (n < 0 && errno == EINTR) {
                continue;
            }
            if (n <= 0) {
                fail_errno("write to the echo worker");
            }
            written += static_cast<std::size_t>(n);
        }
    }
    static bool read_exact(int fd, char* into, std::size_t size) {
        std::size_t got = 0;
        while (got < size) {
            const ssize_t n = ::read(fd, into + got, size - got);
            if (n < 0 && errno == EINTR) {
                continue;
            }
            if (n <= 0) {
                return false;
            }
            got += static_cast<std::size_t>(n);
        }
        return true;
    }
    static bool read_frame(int fd, std::string& payload) {
        std::uint32_t length = 0;
        if (!read_exact(fd, reinterpret_cast<char*>(&length), sizeof length)) {
            return false;
        }
        payload.resize(length);
        return read_exact(fd, payload.data(), length);
    }

    pid_t pid_ = -1;
    int fd_ = -1;
};

// HMAC-SHA256 as cellblock's kernel computes it: a keyed OpenSSL MAC context, duplicated for each message.
class Signer {
  public:
    explicit Signer(const std::string& key)
        : mac_(EVP_MAC_fetch(nullptr, "HMAC", nullptr)),
          keyed_(mac_ ? EVP_MAC_CTX_new(mac_.get()) : nullptr) {
        std::string digest = "SHA256";
        std::array<OSSL_PARAM, 2> params{
            OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest.data(), 0),
            OSSL_PARAM_construct_end()};
        if (!keyed_ || EVP_MAC_init(keyed_.get(), reinterpret_cast<const unsigned char*>(key.data()),
                                    key.size(), params.data()) != 1) {
            throw std::runtime_error("OpenSSL could not key an HMAC-SHA256");
        }
    }

    std::string sign(const std::array<std::string_view, 4>& parts) const {
        const std::unique_ptr<EVP_MAC_CTX, MacContextFree> context(EVP_MAC_CTX_dup(keyed_.get()));
        std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
        std::size_t length = 0;
        bool ok = context != nullptr;
        for (const auto part : parts) {
            ok = ok && EVP_MAC_update(context.get(), reinterpret_cast<const unsigned char*>(part.data()),
                                      part.size()) == 1;
        }
        if (!ok || EVP_MAC_final(context.get(), digest.data(), &length, digest.size()) != 1) {
            throw std::runtime_error("HMAC-SHA256 failed");
        }
        static constexpr char hex[] = "0123456789abcdef";
        std::string text(2 * length, '\0');
        for (std::size_t i = 0; i < length; ++i) {
            text[2 * i] = hex[digest[i] >> 4];
            text[2 * i + 1] = hex[digest[i] & 0xf];
        }
        return text;
    }
    bool verify(std::string_view signature, const std::array<std::string_view, 4>& parts) const {
        const std::string expected = sign(parts);
        return signature.size() == expected.size() &&
               CRYPTO_memcmp(signature.data(), expected.data(), expected.size()) == 0;
    }

  private:
    struct MacFree {
        void operator()(EVP_MAC* mac) const noexcept { EVP_MAC_free(mac); }
    };
    struct MacContextFree {
        void operator()(EVP_MAC_CTX* context) const noexcept { EVP_MAC_CTX_free(context); }
    };
    std::unique_ptr<EVP_MAC, MacFree> mac_;
    std::unique_ptr<EVP_MAC_CTX, MacContextFree> keyed_;
};

std::string utc_now() {
    const auto now = std::chrono::system_clock::now();
    const std::time_t seconds = std::chrono::system_clock::to_time_t(now);
    const auto micros =
        std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
    std::tm parts{};
    ::gmtime_r(&seconds, &parts);
    std::array<char, 40> text{};
    const std::size_t length = std::strftime(text.data(), text.size(), "%Y-%m-%dT%H:%M:%S", &parts);
    std::snprintf(text.data() + length, text.size() - length, ".%06lldZ", static_cast<long long>(micros));
    return text.data();
}

struct Request {
    std::vector<zmq::message_t> identities;
    json header;
    json content;
    std::string header_text;  // the parent header, as received
};

class FloorKernel {
  public:
    FloorKernel(const json& connection, std::chrono::microseconds worker_busy)
        : signer_(connection.at("key").get<std::string>()),
          worker_(worker_busy),
          shell_(context_, zmq::socket_type::router),
          control_(context_, zmq::socket_type::router),
          stdin_(context_, zmq::socket_type::router),
          iopub_(context_, zmq::socket_type::pub),
          heartbeat_(context_, zmq::socket_type::rep) {
        const std::string base = connection.at("transport").get<std::string>() + "://" +
                                 connection.at("ip").get<std::string>() + ":";
        for (auto [socket, port] : {std::pair{&shell_, "shell_port"}, std::pair{&control_, "control_port"},
                                    std::pair{&stdin_, "stdin_port"}, std::pair{&iopub_, "iopub_port"},
                                    std::pair{&heartbeat_, "hb_port"}}) {
            socket->set(zmq::sockopt::linger, 0);
            socket->bind(base + std::to_string(connection.at(port).get<int>()));
        }
    }

    void serve() {
        std::array<zmq::pollitem_t, 3> items{{{shell_.handle(), 0, ZMQ_POLLIN, 0},
                                              {control_.handle(), 0, ZMQ_POLLIN, 0},
                                              {heartbeat_.handle(), 0, ZMQ_POLLIN, 0}}};
        while (running_) {
            zmq::poll(items.data(), items.size(), std::chrono::milliseconds(-1));
            if ((items[2].revents & ZMQ_POLLIN) != 0) {
                zmq::message_t ping;
                if (heartbeat_.recv(ping)) {
                    heartbeat_.send(ping, zmq::send_flags::none);
                }
            }
            for (auto [index, socket] : {std::pair{0, &shell_}, std::pair{1, &control_}}) {
                if ((items[static_cast<std::size_t>(index)].revents & ZMQ_POLLIN) != 0) {
                    handle(*socket);
                }
            }
        }
    }

  private:
    void handle(zmq::socket_t& socket) {
        std::vector<zmq::message_t> frames;
        if (!zmq::recv_multipart(socket, std::back_inserter(frames))) {
            return;
        }
        std::size_t start = 0;
        while (start < frames.size() && frames[start].to_string_view() != delimiter) {
            ++start;
        }
        if (start + 5 >= frames.size()) {
            std::cerr << "floor kernel: a message without its delimiter or parts, dropped\n";
            return;
        }
        const std::array<std::string_view, 4> parts{
            frames[start + 2].to_string_view(), frames[start + 3].to_string_view(),
            frames[start + 4].to_string_view(), frames[start + 5].to_string_view()};
        if (!signer_.verify(frames[start + 1].to_string_view(), parts)) {
            std::cerr << "floor kernel: a message with a bad signature, dropped\n";
            return;
        }
        Request request;
        for (std::size_t i = 0; i < start; ++i) {
            request.identities.emplace_back(frames[i].data(), frames[i].size());
        }
        request.header_text = std::string(parts[0]);
        request.header = json::parse(parts[0]);
        request.content = json::parse(parts[3]);
        const std::string type = request.header.at("msg_type").get<std::string>();
        if (type == "execute_request") {
            execute(socket, request);
        } else if (type == "kernel_info_request") {
            publish_status(request, "busy");
            reply(socket, request, "kernel_info_reply", kernel_info());
            publish_status(request, "idle");
        } else if (type == "shutdown_request") {
            reply(socket, request, "shutdown_reply", {{"status", "ok"}, {"restart", false}});
            running_ = false;
        } else {
            std::cerr << "floor kernel: " << type << " is not served\n";
        }
    }

    void execute(zmq::socket_t& socket, const Request& request) {
        const std::string code = request.content.at("code").get<std::string>();
        ++execution_count_;
        publish_status(request, "busy");
        publish(request, "execute_input", {{"code", code}, {"execution_count", execution_count_}});
        const std::string result = worker_.exchange(code);
        publish(request, "execute_result",
                {{"data", {{"text/plain", result}}},
                 {"metadata", json::object()},
                 {"execution_count", execution_count_}});
        reply(socket, request, "execute_reply",
              {{"status", "ok"},
               {"execution_count", execution_count_},
               {"user_expressions", json::object()},
               {"payload", json::array()}});
        publish_status(request, "idle");
    }

    static json kernel_info() {
        return {{"status", "ok"},
                {"protocol_version", "5.3"},
                {"implementation", "cellblock-floor-kernel"},
                {"implementation_version", "0"},
                {"language_info", {{"name", "python"}, {"version", "3"}, {"file_extension", ".py"}}},
                {"banner", "a benchmark instrument"}};
    }

    void publish_status(const Request& request, const char* state) {
        publish(request, "status", {{"execution_state", state}});
    }

    void publish(const Request& request, const char* type, const json& content) {
        std::vector<zmq::message_t> prefix;
        prefix.emplace_back(std::string("kernel.floor.") + type);
        send(iopub_, std::move(prefix), request, type, content);
    }

    void reply(zmq::socket_t& socket, const Request& request, const char* type, const json& content) {
        std::vector<zmq::message_t> prefix;
        for (const auto& identity : request.identities) {
            prefix.emplace_back(identity.data(), identity.size());
        }
        send(socket, std::move(prefix), request, type, content);
    }

    void send(zmq::socket_t& socket, std::vector<zmq::message_t> frames, const Request& request,
              const char* type, const json& content) {
        ++sequence_;
        const json header = {{"msg_id", session_ + "_" + std::to_string(sequence_)},
                             {"session", session_},
                             {"username", "floor"},
                             {"date", utc_now()},
                             {"msg_type", type},
                             {"version", "5.3"}};
        const std::string header_text = header.dump();
        const std::string metadata_text = "{}";
        const std::string content_text = content.dump();
        const std::string signature =
            signer_.sign({header_text, request.header_text, metadata_text, content_text});
        frames.emplace_back(delimiter.data(), delimiter.size());
        frames.emplace_back(signature);
        frames.emplace_back(header_text);
        frames.emplace_back(request.header_text);
        frames.emplace_back(metadata_text);
        frames.emplace_back(content_text);
        if (!zmq::send_multipart(socket, frames)) {
            std::cerr << "floor kernel: a message could not be sent\n";
        }
    }

    Signer signer_;
    EchoWorker worker_;  // forked before libzmq starts its I/O thread
    zmq::context_t context_;
    zmq::socket_t shell_;
    zmq::socket_t control_;
    zmq::socket_t stdin_;
    zmq::socket_t iopub_;
    zmq::socket_t heartbeat_;
    std::string session_ = "floor-" + std::to_string(::getpid());
    std::uint64_t sequence_ = 0;
    int execution_count_ = 0;
    bool running_ = true;
};

}  // namespace

int main(int argc, char** argv) {
    if (argc != 2 && argc != 3) {
        std::cerr << "usage: cellblock-floor-kernel CONNECTION_FILE [WORKER_MICROSECONDS]\n";
        return 2;
    }
    try {
        std::ifstream file(argv[1]);
        if (!file) {
            std::cerr << "cannot read " << argv[1] << "\n";
            return 2;
        }
        const std::chrono::microseconds worker_busy(argc == 3 ? std::stoll(argv[2]) : 0);
        FloorKernel kernel(json::parse(file), worker_busy);
        kernel.serve();
        return 0;
    } catch (const std::exception& error) {
        std::cerr << "floor kernel: " << error.what() << "\n";
        return 1;
    }
}
