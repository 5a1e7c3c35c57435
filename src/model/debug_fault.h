// Faults planted on purpose in the mesh machinery, so that tests can show
// the drift tools find them (lockstep run --debug-mesh-fault KIND).
#pragma once

namespace ls {

// Debug only (--debug-mesh-fault): one piece of the mesh machinery flips
// one bit of one element (the last, but for kFsdpBlock), once a step, so that the drift tools can be
// shown to find it. Each is taken on one rank:
//   kTpChain       the last rank of a tensor-parallel chain, on the chain's output (the first chain of the step)
//   kCpHandoff     context-parallel rank 0, on the first dK/dV rows it hands on
//   kPpActivation  pipeline stage 1, on the first activation it receives
//   kEpRow         expert-parallel rank 1, on the first row another rank sends it
//   kFsdpBlock     shard rank 1, on its first reduce-scattered gradient block (its top mantissa bit:
//                  AdamW's moments absorb a one-ulp gradient error, so the last bit would leave the state alone)
enum class MeshFault { kNone, kTpChain, kCpHandoff, kPpActivation, kEpRow, kFsdpBlock };
struct DebugFault {
  MeshFault planted = MeshFault::kNone;
  bool armed = false;  // re-armed every step
  // True once a step for the planted fault.
  bool take(MeshFault f) {
    if (f != planted || !armed) return false;
    armed = false;
    return true;
  }
};
// Flips bit `bit` of *x's fp32 bits (0: the last mantissa bit; a debug fault).
void flip_bit(float* x, int bit = 0);

}  // namespace ls
