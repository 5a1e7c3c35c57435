// The stderr of a supervised mpirun job, passed on line by line to this
// process's stderr, with Open MPI's own banners (the blocks between its
// rules of dashes: "mpirun noticed that process rank 0 ... exited on signal
// 9") labelled "mpirun: " and their rules dropped, so that a reader tells
// them from Lockstep's lines; the supervisor's own line says what happened.
//
// The relay is a forked process, not a thread: a supervisor killed outright
// (SIGKILL) must not take the job's stderr with it, or the ranks would die
// of SIGPIPE writing why they stop, before they clean up. It ignores the
// stop signals the supervisor passes on, and ends once every process of the
// job has closed its end.
#pragma once

#include <sys/types.h>

namespace ls {

class MpirunStderr {
 public:
  MpirunStderr();   // the pipe; throws UserError when none can be made
  ~MpirunStderr();  // waits for the relay: every process of the job closed its end
  MpirunStderr(const MpirunStderr&) = delete;
  MpirunStderr& operator=(const MpirunStderr&) = delete;

  // The child's end, to become its stderr.
  int child_end() const { return fds_[1]; }
  // Once the child started: starts the relay and closes both ends here.
  void start();

 private:
  int fds_[2] = {-1, -1};
  pid_t relay_ = -1;
};

}  // namespace ls
