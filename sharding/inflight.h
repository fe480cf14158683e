// InflightCollectives: asynchronous collectives waited for in the order they were issued,
// with a cap on how many are in flight at once, so the transient buffers they read and
// write stay within a few buckets or units. The bucketed reductions and gathers of
// no_shard/zero1/zero2 (data_parallel.cpp) and zero3's reduce-scatters (fully_shard.cpp)
// share it.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <utility>

namespace tessera::sharding {

// Job: a movable record of one issued collective with a `handle` member
// (std::shared_ptr<distributed::CommHandle>) and the buffers it uses.
template <typename Job>
class InflightCollectives {
 public:
  // finish(job) runs once job.handle->wait() returned, oldest job first.
  InflightCollectives(size_t maxInflight, std::function<void(Job&)> finish)
      : maxInflight_(maxInflight < 1 ? 1 : maxInflight), finish_(std::move(finish)) {}

  // A new cap (at least 1), for the jobs issued from now on.
  void setMaxInflight(size_t maxInflight) { maxInflight_ = maxInflight < 1 ? 1 : maxInflight; }

  // Waits for and finishes the oldest jobs until another one may be issued. Call it before
  // allocating the next job's buffers, so at most maxInflight jobs' buffers are alive.
  void makeRoom() {
    while (jobs_.size() >= maxInflight_) finishOldest();
  }
  // Adds a job just issued (after makeRoom()).
  void push(Job job) { jobs_.push_back(std::move(job)); }
  // Waits for and finishes every job.
  void drain() {
    while (!jobs_.empty()) finishOldest();
  }
  bool empty() const { return jobs_.empty(); }

  // Waits for every job still in flight without finishing it, ignoring errors: its
  // buffers must outlive the collective; what it computed no longer matters.
  ~InflightCollectives() {
    for (Job& job : jobs_) {
      try {
        job.handle->wait();
      } catch (...) {
      }
    }
  }
  InflightCollectives(const InflightCollectives&) = delete;
  InflightCollectives& operator=(const InflightCollectives&) = delete;

 private:
  void finishOldest() {
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    job.handle->wait();
    finish_(job);
  }

  size_t maxInflight_;
  std::function<void(Job&)> finish_;
  std::deque<Job> jobs_;
};

}  // namespace tessera::sharding
