#include "cli/failure.h"

#include <stdexcept>

#include "ckpt/lease.h"
#include "common/error.h"
#include "common/stop_signals.h"
#include "store/store.h"

namespace ls {

Failure describe_failure(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (const Interrupted& e) {
    return {128 + e.signal(), std::string("lockstep: ") + e.what(), e.signal()};
  } catch (const LeaseLost& e) {
    return {kExitLeaseLost, std::string("lockstep: error: ") + e.what()};
  } catch (const UserError& e) {
    return {2, std::string("lockstep: error: ") + e.what()};
  } catch (const StoreError& e) {
    return {3, std::string("lockstep: storage error: ") + e.what()};
  } catch (const InternalError& e) {
    return {kExitInternalError, std::string("lockstep: internal error: ") + e.what()};
  } catch (const std::exception& e) {
    return {3, std::string("lockstep: internal error: ") + e.what()};
  }
}

}  // namespace ls
