// Memory the installed backend's kernels can read. The model's weights,
// gradients, optimizer moments, activations and every buffer it hands to an
// op live in DeviceVectors: the host heap on the engine; CUDA managed memory
// on the CUDA backend (so weights and optimizer state stay resident on the
// GPU between steps, and the host still reaches the few it reads, such as
// the routing choices that plan the MoE rounds). `cuda-emulated` installs
// heap memory that is registered, and its launches refuse any pointer
// argument outside it: the CPU-side proof that no kernel of the CUDA backend
// is handed host memory.
//
// Each block records the function that frees it, so a vector made under one
// backend may be freed under another (thread-local scratch outlives a run).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

namespace ls::ops {

struct MemoryHooks {
  void* (*alloc)(size_t bytes) = nullptr;  // throws std::bad_alloc (or a message) on failure
  void (*free)(void* p) = nullptr;
  // Copies bytes out of this memory into host memory; nullptr: memcpy.
  void (*copy_to_host)(void* dst, const void* src, size_t bytes) = nullptr;
};

// kDevice: what kernels read (DeviceVector). kStaging: host buffers that
// checkpoints stage state into (StagingVector; page-locked on the CUDA
// backend, so copies out of the device run at the copy engine's speed).
enum class MemoryKind { kDevice = 0, kStaging = 1 };

inline std::atomic<const MemoryHooks*>& memory_hooks_slot(MemoryKind kind) {
  static std::atomic<const MemoryHooks*> hooks[2] = {nullptr, nullptr};
  return hooks[(int)kind];
}
// Installed with the op hooks for a run (ops::install, ops/dispatch.h); nullptr: the heap.
inline const MemoryHooks* memory_hooks(MemoryKind kind = MemoryKind::kDevice) {
  return memory_hooks_slot(kind).load(std::memory_order_relaxed);
}

// bytes from device memory (or the host) into host memory.
inline void copy_to_host(void* dst, const void* src, size_t bytes) {
  const MemoryHooks* m = memory_hooks();
  if (m && m->copy_to_host) m->copy_to_host(dst, src, bytes);
  else if (bytes) std::memcpy(dst, src, bytes);
}

namespace device_memory_detail {
constexpr size_t kHeader = 64;  // keeps the data 64-byte aligned; holds the free function
using FreeFn = void (*)(void*);
inline void heap_free(void* p) { ::operator delete(p, std::align_val_t(64)); }
inline void* allocate(size_t bytes, MemoryKind kind) {
  const MemoryHooks* m = memory_hooks(kind);
  void* raw = m ? m->alloc(bytes + kHeader) : ::operator new(bytes + kHeader, std::align_val_t(64));
  if (!raw) throw std::bad_alloc();
  *static_cast<FreeFn*>(raw) = m ? m->free : heap_free;
  return static_cast<char*>(raw) + kHeader;
}
inline void deallocate(void* p) {
  if (!p) return;
  void* raw = static_cast<char*>(p) - kHeader;
  (*static_cast<FreeFn*>(raw))(raw);
}
}  // namespace device_memory_detail

template <class T, MemoryKind Kind>
struct HookAllocator {
  using value_type = T;
  template <class U>
  struct rebind {
    using other = HookAllocator<U, Kind>;
  };
  HookAllocator() = default;
  template <class U>
  HookAllocator(const HookAllocator<U, Kind>&) {}
  T* allocate(size_t n) { return static_cast<T*>(device_memory_detail::allocate(n * sizeof(T), Kind)); }
  void deallocate(T* p, size_t) { device_memory_detail::deallocate(p); }
  template <class U>
  bool operator==(const HookAllocator<U, Kind>&) const { return true; }
  template <class U>
  bool operator!=(const HookAllocator<U, Kind>&) const { return false; }
};

template <class T>
using DeviceVector = std::vector<T, HookAllocator<T, MemoryKind::kDevice>>;
template <class T>
using StagingVector = std::vector<T, HookAllocator<T, MemoryKind::kStaging>>;

}  // namespace ls::ops
