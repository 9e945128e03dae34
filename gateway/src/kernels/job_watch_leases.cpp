// JobWatchLeases over the store (provisioner.hpp): which gateway sharing a store polls squeue for a Slurm
// job.
#include <utility>

#include "cellblock/gateway/kernels/provisioner.hpp"
#include "cellblock/gateway/store/store_writer.hpp"

namespace cellblock::gateway {
namespace {

std::string lease_name(const WatchedJob& job) {
    // The kernel id first: the store removes a kernel's watch leases' rows with its record (remove_kernel).
    return "slurm-watch:" + job.kernel_id + ":" + job.job_id;
}

class StoreJobWatchLeases final : public JobWatchLeases {
  public:
    StoreJobWatchLeases(StoreWriter& writer, const Logger& logger) : writer_(writer), logger_(logger) {}

    void take(std::vector<WatchedJob> jobs, std::function<void(std::vector<WatchedJob>)> then) override {
        if (!writer_.shared())
            return then(std::move(jobs));
        // One reader call for every job asked about: one round trip each on the reader thread, none on the
        // io thread. Leases it took before a failure, or after the answer came too late, are released.
        writer_.read<std::vector<WatchedJob>>(
            [jobs](SessionStore& store) { return take_each(store, jobs); }, StoreWriter::default_read_limit,
            [this, then = std::move(then)](StoreAnswer<std::vector<WatchedJob>> answer) {
                if (!answer.ok()) {
                    logger_.error("store_read_failed",
                                  {{"what", "slurm watch leases"}, {"error", answer.error}});
                    return then({});
                }
                then(std::move(*answer.value));
            },
            [this](const std::vector<WatchedJob>& taken_late) {
                for (const WatchedJob& job : taken_late)
                    release(job);
            });
    }

    void release(const WatchedJob& job) override {
        if (!writer_.shared())
            return;
        // Behind this gateway's earlier lease calls on the one reader thread: never before the taking.
        writer_.read<bool>(
            [lease = lease_name(job)](SessionStore& store) {
                store.release_lease(lease);
                return true;
            },
            StoreWriter::default_read_limit,
            [this, lease = lease_name(job)](const StoreAnswer<bool>& answer) {
                if (!answer.ok())
                    logger_.error("store_write_failed", {{"lease", lease}, {"error", answer.error}});
            });
    }

  private:
    static std::vector<WatchedJob> take_each(SessionStore& store, const std::vector<WatchedJob>& jobs) {
        std::vector<WatchedJob> taken;
        try {
            for (const WatchedJob& job : jobs)
                if (store.try_lease(lease_name(job)))
                    taken.push_back(job);
        } catch (...) {
            for (const WatchedJob& job : taken)
                store.release_lease(lease_name(job));
            throw;
        }
        return taken;
    }

    StoreWriter& writer_;
    const Logger& logger_;
};

}  // namespace

std::shared_ptr<JobWatchLeases> make_job_watch_leases(StoreWriter& writer, const Logger& logger) {
    return std::make_shared<StoreJobWatchLeases>(writer, logger);
}

}  // namespace cellblock::gateway
