// symmalloc's C++ allocator for PyTorch: allocator settings changed at run time
// (torch.cuda.memory._set_allocator_settings, torch._C._accelerator_setAllocatorSettings).
// Included by torch_allocator.cpp only.
//
// Owns: the rules for an allocator configuration string ("k:v,k2:[a:1,b:2]", as
// PYTORCH_CUDA_ALLOC_CONF), the same as python/symmalloc/memory.py's alloc_conf applies at
// install_global(): honoured are per_process_memory_fraction (each device's cap, set at its next
// allocation), the pinned_* keys (PyTorch's pinned host allocator reads them; symmalloc does not
// replace it) and backend, expandable_segments, release_lock_on_cudamalloc,
// throw_on_cudamalloc_oom, graph_capture_record_stream_reuse at PyTorch's default value; any
// other key or value is refused, naming it. And the hook that applies them: torch 2.10 to 2.15
// all route a run-time setting through c10::CachingAllocator::setAllocatorSettings (an inline
// function of c10/core/AllocatorConfig.h): AcceleratorAllocatorConfig::parseArgs (the keys every
// device shares; an unknown key raises there), then the device's parser hook (CUDA's:
// CUDAAllocatorConfig::parseArgs). CUDAAllocator has no virtual for it in any of them. The hook
// installed here checks the string first (a refused key raises c10::Error from the call, before
// CUDA's parser sees it), then calls CUDA's parser, then applies the fraction.
//
// Invariants:
// - Installed once per process, by symm_torch_install only (never by the selftest, which leaves
//   PyTorch's own allocator in charge); nothing here is on the allocation path.
// - What AcceleratorAllocatorConfig::parseArgs set before the hook raised stays set in
//   PyTorch's shared config object (max_split_size_mb, expandable_segments, ...): symmalloc
//   reads none of those, and the caller got the error.
// - torch 2.11+: the hook before this one is read (getConfigParserHook) and called; torch 2.10
//   keeps it private, so the hook here calls what CUDA's registration does
//   (REGISTER_ALLOCATOR_CONFIG_PARSE_HOOK(CUDAAllocatorConfig)).
#pragma once

#include <c10/core/AllocatorConfig.h>
#include <c10/cuda/CUDAAllocatorConfig.h>
#include <c10/util/Exception.h>

#include <cctype>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "torch_compat.h"

namespace symm_torch {
namespace {  // internal linkage, as in the one translation unit that includes this

// An allocator configuration string as (key, value) pairs, split at the commas outside
// brackets (memory.py's _conf_items).
inline std::vector<std::pair<std::string, std::string>> conf_items(const std::string& text) {
  auto trim = [](std::string s) {
    size_t a = s.find_first_not_of(" \t\n");
    size_t b = s.find_last_not_of(" \t\n");
    return a == std::string::npos ? std::string() : s.substr(a, b - a + 1);
  };
  std::vector<std::pair<std::string, std::string>> items;
  int depth = 0;
  std::string cur;
  for (char ch : text + ",") {
    if (ch == '[') ++depth;
    if (ch == ']') --depth;
    if (ch == ',' && depth == 0) {
      if (!trim(cur).empty()) {
        size_t colon = cur.find(':');
        std::string value = colon == std::string::npos ? "" : trim(cur.substr(colon + 1));
        items.emplace_back(trim(cur.substr(0, colon)), value);
      }
      cur.clear();
    } else {
      cur += ch;
    }
  }
  return items;
}

// "" when symmalloc honours every key of `text`, else the error naming each refused key (the
// caller raises it). *fraction: per_process_memory_fraction's value, or -1 when not given.
inline std::string check_settings(const std::string& text, double* fraction) {
  static const std::pair<const char*, const char*> kDefaults[] = {
      {"backend", "native"},
      {"expandable_segments", "false"},
      {"release_lock_on_cudamalloc", "false"},
      {"throw_on_cudamalloc_oom", "false"},
      {"graph_capture_record_stream_reuse", "false"},
  };
  *fraction = -1.0;
  std::string refused;
  auto refuse = [&](const std::string& what) { refused += (refused.empty() ? "" : ", ") + what; };
  for (const auto& [key, value] : conf_items(text)) {
    if (key.rfind("pinned_", 0) == 0) continue;
    const char* default_value = nullptr;
    for (const auto& [k, v] : kDefaults)
      if (key == k) default_value = v;
    if (default_value) {
      std::string b = value;
      for (auto& c : b) c = (char)std::tolower((unsigned char)c);
      if (b == "1") b = "true";
      if (b == "0") b = "false";
      if (b != default_value && value != default_value) refuse(key + ":" + value);
      continue;
    }
    if (key == "per_process_memory_fraction") {
      char* end = nullptr;
      double f = std::strtod(value.c_str(), &end);
      if (value.empty() || *end != '\0' || !(f >= 0.0 && f <= 1.0))
        return "per_process_memory_fraction:" + value + ": expected a fraction in [0, 1]";
      *fraction = f;
      continue;
    }
    refuse(value.empty() ? key : key + ":" + value);
  }
  if (refused.empty()) return "";
  return refused + ": not honoured (symmalloc's heap has no such setting). symmalloc's C++ "
                   "allocator honours per_process_memory_fraction and the pinned_* keys "
                   "(docs/memory.md, \"Global mode's settings\"); leave PyTorch's allocator in "
                   "place for the others";
}

// Puts symmalloc's check in front of the device hook that setAllocatorSettings calls (module
// header); `apply` gets each per_process_memory_fraction set. Once per process.
inline void install_settings_hook(std::function<void(double)> apply) {
  static bool done = false;
  if (done) return;
  done = true;
  using c10::CachingAllocator::AcceleratorAllocatorConfig;
  // PYTORCH_ALLOC_CONF is parsed at the config's creation: before the hook below exists
  // (install_global() checked it already).
  (void)AcceleratorAllocatorConfig::instance();
  (void)c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::instance();
#if SYMM_TORCH_HAS_CONFIG_HOOK_GETTER
  std::function<void(const std::string&)> cuda_parser =
      AcceleratorAllocatorConfig::getConfigParserHook();
#else
  std::function<void(const std::string&)> cuda_parser = [](const std::string& env) {
    c10::cuda::CUDACachingAllocator::CUDAAllocatorConfig::instance().parseArgs(env);
  };
#endif
  auto hook = [cuda_parser, apply = std::move(apply)](const std::string& env) {
    double fraction = -1.0;
    std::string refused = check_settings(env, &fraction);
    TORCH_CHECK(refused.empty(), "symmalloc: _set_allocator_settings(\"", env, "\"): ", refused);
    if (cuda_parser) cuda_parser(env);
    if (fraction >= 0.0) apply(fraction);
  };
#if SYMM_TORCH_HAS_CONFIG_HOOK_GETTER
  AcceleratorAllocatorConfig::getConfigParserHook() = std::move(hook);
#else
  AcceleratorAllocatorConfig::registerDeviceConfigParserHook(std::move(hook), {});
#endif
}

}  // namespace
}  // namespace symm_torch
