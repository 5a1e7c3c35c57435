// What the messages sent or received in a scope carry ("ep_dispatch"), named
// by the code that sends them, as OpTimer names what its time goes to. A
// communicator that looks for one kind of message (FaultyCommunicator, its
// planted fault) reads it where the message's shape cannot tell: the expert
// group's all-to-alls carry routing counts and leaf ids as well as rows.
// The messages themselves are the same with or without it.
#pragma once

namespace ls {

class MessageLabel {
 public:
  explicit MessageLabel(const char* what) : saved_(current_) { current_ = what; }
  ~MessageLabel() { current_ = saved_; }
  MessageLabel(const MessageLabel&) = delete;
  MessageLabel& operator=(const MessageLabel&) = delete;
  // The innermost label on this thread (a rank's), or nullptr.
  static const char* current() { return current_; }

 private:
  const char* saved_;
  static inline thread_local const char* current_ = nullptr;
};

}  // namespace ls
