// The stderr of a supervised mpirun job, passed on line by line to this
// process's stderr, with Open MPI's own banners (the blocks between its
// rules of dashes: "mpirun noticed that process rank 0 ... exited on signal
// 9") labelled "mpirun: " and their rules dropped, so that a reader tells
// them from Lockstep's lines; the supervisor's own line says what happened.
#pragma once

#include <thread>

namespace ls {

class MpirunStderr {
 public:
  MpirunStderr();   // the pipe; throws UserError when none can be made
  ~MpirunStderr();  // waits until every process of the job closed it
  MpirunStderr(const MpirunStderr&) = delete;
  MpirunStderr& operator=(const MpirunStderr&) = delete;

  // The child's end, to become its stderr.
  int child_end() const { return fds_[1]; }
  // Once the child started: closes the child's end here and relays.
  void start();

 private:
  int fds_[2] = {-1, -1};
  std::thread relay_;
};

}  // namespace ls
