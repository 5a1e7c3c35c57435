// The engine's model as blocks (model/blocks.h): each range of blocks held
// to the reference's blocks (reference/blocks.h) bit for bit on given
// inputs; a step run as two ranges of blocks on two models -- activations
// handed forward and gradients back between them, as pipeline stages will
// -- gives the whole step's bits, and each range runs only its own blocks.
#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/error.h"
#include "contract.h"
#include "data/corpus.h"
#include "model/model.h"
#include "reference.h"  // reference/reference.h
#include "runner/runner.h"
#include "runner/scenario.h"
#include "trace/sink.h"

namespace {

ls::Scenario blocks_scenario(const std::string& overrides_json) {
  nlohmann::json j = nlohmann::json::parse(R"({
    "model": {"d_model": 16, "n_layers": 3, "n_heads": 2, "seq_len": 8, "d_ff": 12, "init_std": 0.3},
    "moe": {"experts": 4, "top_k": 2, "aux_loss_weight": 0.05, "z_loss_weight": 0.01, "router_skew": 0.5},
    "train": {"steps": 3, "batch": 4, "warmup_steps": 1, "eval_every": 0, "eval_batches": 1},
    "data": {"synthetic_bytes": 8192}})");
  j.merge_patch(nlohmann::json::parse(overrides_json));
  return ls::scenario_from_json(j, "blocks-test.json", {});
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The block a parameter belongs to.
std::string owner_block(const std::string& param) {
  if (param == "tok_emb" || param == "pos_emb") return "embedding";
  if (param == "final_norm" || param == "lm_head") return "head";
  const size_t dot = param.find('.', 7);  // "layers.L."
  const std::string layer = param.substr(0, dot + 1), rest = param.substr(dot + 1);
  if (rest == "attn_norm" || rest == "wqkv" || rest == "wo") return layer + "attention";
  if (rest == "moe_norm" || rest == "router") return layer + "moe_routing";
  if (rest.rfind("experts.", 0) == 0) return layer + "moe_experts";
  return layer + "moe_combine";  // the shared expert
}

int block_index(const ls::MoeTransformer& m, const std::string& name) {
  const std::vector<std::string> names = m.block_names();
  for (size_t i = 0; i < names.size(); ++i)
    if (names[i] == name) return (int)i;
  FAIL("no block " << name);
  return -1;
}

// Traced tensors by (phase, layer, op, tensor).
using TraceKey = std::tuple<std::string, int, std::string, std::string>;
using TraceRecords = std::map<TraceKey, std::vector<float>>;

struct RecordingSink : ls::TraceSink {
  TraceRecords records;
  void tensor(const char* phase, int layer, const char* op, const char* name, const float* data,
              const std::vector<int64_t>& shape, ls::TraceDtype = ls::TraceDtype::kF32) override {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    records[{phase, layer, op, name}].assign(data, data + n);
  }
};

std::vector<float> given(size_t n, uint64_t seed, float a) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = ls::random_symmetric(seed, ls::Purpose::kTest, i, a);
  return v;
}

int64_t differing(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return -1;
  int64_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += bits_of(a[i]) != bits_of(b[i]);
  return n;
}

// Blocks [first, last) of the engine and of the reference, forward and
// backward on the same given inputs -- tokens, the stream entering
// `first`, the loss sums so far, the gradient of the stream leaving --
// give the same losses, output stream, input-stream gradient, parameter
// gradients and traced tensors, bit for bit.
void check_range_against_reference(const ls::Scenario& s, int first, int last) {
  const ls::ModelConfig& c = s.model;
  ls::MoeTransformer engine(c, s.leaf_samples, s.seed);
  ref::Model<float> reference(ls::reference_config(s), s.seed);
  const std::vector<std::string> names = engine.block_names();
  CAPTURE(names[first]);
  CAPTURE(last);
  const int end = engine.num_blocks();
  std::vector<uint8_t> tokens((size_t)s.batch * (c.seq_len + 1));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (uint8_t)(ls::random_unit(s.seed, ls::Purpose::kTest, 7000 + i) * 256);
  const size_t stream = (size_t)s.batch * c.seq_len * c.d_model;
  // Inputs at the scale of the block's own terms (see blocks_scenario's
  // init_std), so that no rounding of one hides under the other.
  const std::vector<float> stream_in = given(stream, 11, 1.0f), grad_out = given(stream, 12, 0.05f);
  ls::StepLosses carried;
  carried.aux = 0.75f;
  carried.z = 3.5f;
  ref::Losses<float> ref_carried;
  ref_carried.aux = carried.aux;
  ref_carried.z = carried.z;

  RecordingSink engine_trace;
  TraceRecords ref_trace;
  engine.set_trace(&engine_trace);
  reference.trace = [&](const char* phase, int layer, const char* op, const char* name, const float* data,
                        const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    ref_trace[{phase, layer, op, name}].assign(data, data + n);
  };
  std::vector<float> engine_out(stream), ref_out(stream), engine_grad_in(stream), ref_grad_in(stream);
  ls::StageIo io;
  io.stream_in = first > 0 ? stream_in.data() : nullptr;
  io.stream_out = last < end ? engine_out.data() : nullptr;
  io.carried = carried;
  const ls::StepLosses got = engine.forward_range(tokens.data(), s.batch, true, first, last, io);
  engine.backward_range(first, last, last < end ? grad_out.data() : nullptr, first > 0 ? engine_grad_in.data() : nullptr);
  const ref::Losses<float> want = reference.forward_range(tokens.data(), s.batch, true, first, last,
                                                          first > 0 ? stream_in.data() : nullptr,
                                                          last < end ? ref_out.data() : nullptr, ref_carried);
  reference.backward_range(first, last, last < end ? grad_out.data() : nullptr, first > 0 ? ref_grad_in.data() : nullptr);

  CHECK(bits_of(got.ce) == bits_of(want.ce));
  CHECK(bits_of(got.aux) == bits_of(want.aux));
  CHECK(bits_of(got.z) == bits_of(want.z));
  CHECK(bits_of(got.total) == bits_of(want.total));
  if (last < end) CHECK(differing(engine_out, ref_out) == 0);
  if (first > 0) CHECK(differing(engine_grad_in, ref_grad_in) == 0);
  int compared = 0;
  for (const ls::ParamInfo& p : engine.params()) {
    const int owner = block_index(engine, owner_block(p.name));
    if (owner < first || owner >= last) continue;
    CAPTURE(p.name);
    const std::vector<float> mine(engine.grads() + p.offset, engine.grads() + p.offset + p.size);
    CHECK(differing(mine, reference.param(p.name).g) == 0);
    ++compared;
  }
  CHECK(compared > 0);
  CHECK(engine_trace.records.size() == ref_trace.size());
  for (const auto& [key, data] : ref_trace) {
    CAPTURE(std::get<2>(key));
    CAPTURE(std::get<3>(key));
    CAPTURE(std::get<1>(key));
    const auto it = engine_trace.records.find(key);
    REQUIRE(it != engine_trace.records.end());
    CHECK(differing(it->second, data) == 0);
  }
}

// One training step whole, and as stages [0, cut) and [cut, end) on two
// models of the same seed: the same losses and gradients, bit for bit.
void check_two_stages(const ls::Scenario& s, const std::string& cut_block) {
  CAPTURE(cut_block);
  const ls::ModelConfig& c = s.model;
  ls::Corpus corpus = ls::load_corpus(s.data, s.seed, c.seq_len);
  std::vector<uint8_t> tokens((size_t)s.batch * (c.seq_len + 1));
  ls::train_batch(corpus, s.seed, 0, s.batch, c.seq_len, tokens.data());

  ls::MoeTransformer whole(c, s.leaf_samples, s.seed);
  const ls::StepLosses want = whole.forward_backward(tokens.data(), s.batch);

  ls::MoeTransformer first_stage(c, s.leaf_samples, s.seed), second_stage(c, s.leaf_samples, s.seed);
  const int cut = block_index(whole, cut_block), end = whole.num_blocks();
  const size_t stream = (size_t)s.batch * c.seq_len * c.d_model;
  std::vector<float> activations(stream, -1.0f), gradient(stream, -1.0f), grad_in(stream);
  ls::StageIo to_first;
  to_first.stream_out = activations.data();
  const ls::StepLosses carried = first_stage.forward_range(tokens.data(), s.batch, true, 0, cut, to_first);
  ls::StageIo to_second;
  to_second.stream_in = activations.data();
  to_second.carried = carried;
  const ls::StepLosses got = second_stage.forward_range(tokens.data(), s.batch, true, cut, end, to_second);
  second_stage.backward_range(cut, end, nullptr, gradient.data());
  first_stage.backward_range(0, cut, gradient.data(), nullptr);

  CHECK(bits_of(got.ce) == bits_of(want.ce));
  CHECK(bits_of(got.aux) == bits_of(want.aux));
  CHECK(bits_of(got.z) == bits_of(want.z));
  CHECK(bits_of(got.total) == bits_of(want.total));
  CHECK(carried.ce == 0.0f);  // the head is not in the first stage
  int first_params = 0, second_params = 0;
  for (const ls::ParamInfo& p : whole.params()) {
    CAPTURE(p.name);
    const bool in_first = block_index(whole, owner_block(p.name)) < cut;
    (in_first ? first_params : second_params) += 1;
    const float* ran = (in_first ? first_stage : second_stage).grads() + p.offset;
    const float* idle = (in_first ? second_stage : first_stage).grads() + p.offset;
    const float* expected = whole.grads() + p.offset;
    int64_t differing = 0, touched = 0;
    for (int64_t i = 0; i < p.size; ++i) {
      differing += bits_of(ran[i]) != bits_of(expected[i]);
      touched += bits_of(idle[i]) != 0;
    }
    CHECK(differing == 0);
    CHECK(touched == 0);  // the other stage never ran this parameter's block
  }
  CHECK(first_params > 0);
  CHECK(second_params > 0);
}

}  // namespace

TEST_SUITE("blocks") {
  TEST_CASE("the blocks in forward order") {
    const ls::Scenario s = blocks_scenario(R"({"model": {"n_layers": 2}})");
    ls::MoeTransformer m(s.model, s.leaf_samples, s.seed);
    CHECK(m.block_names() == std::vector<std::string>{
                                 "embedding", "layers.0.attention", "layers.0.moe_routing", "layers.0.moe_dispatch",
                                 "layers.0.moe_experts", "layers.0.moe_combine", "layers.1.attention",
                                 "layers.1.moe_routing", "layers.1.moe_dispatch", "layers.1.moe_experts",
                                 "layers.1.moe_combine", "head"});
  }

  TEST_CASE("engine and reference blocks pair one to one by name and order") {
    const ls::Scenario s = blocks_scenario("{}");
    ls::MoeTransformer engine(s.model, s.leaf_samples, s.seed);
    ref::Model<float> reference(ls::reference_config(s), s.seed);
    CHECK(engine.block_names() == reference.block_names());
  }

  TEST_CASE("each range of blocks between stream boundaries matches the reference's on given inputs") {
    for (const char* overrides :
         {"{}", R"({"model": {"shared_expert": true}, "moe": {"capacity_factor": 0.5}, "numerics": {"leaf_samples": 2}})"}) {
      CAPTURE(overrides);
      const ls::Scenario s = blocks_scenario(overrides);
      ls::MoeTransformer m(s.model, s.leaf_samples, s.seed);
      std::vector<int> bounds;  // where a range may begin, then the end
      const std::vector<std::string> names = m.block_names();
      for (int b = 0; b < m.num_blocks(); ++b)
        if (b == 0 || names[b] == "head" || names[b].find(".attention") != std::string::npos ||
            names[b].find(".moe_routing") != std::string::npos)
          bounds.push_back(b);
      bounds.push_back(m.num_blocks());
      REQUIRE(bounds.size() == 2 + 2 * (size_t)s.model.n_layers + 1);
      for (size_t i = 0; i + 1 < bounds.size(); ++i) check_range_against_reference(s, bounds[i], bounds[i + 1]);
    }
  }

  TEST_CASE("a step as two ranges of blocks on two models gives the whole step's bits") {
    const ls::Scenario s = blocks_scenario("{}");
    for (const char* cut : {"layers.0.attention", "layers.1.attention", "layers.1.moe_routing", "layers.2.attention",
                            "head"})
      check_two_stages(s, cut);
  }

  TEST_CASE("two ranges with a shared expert, capacity rounds and leaf_samples 2") {
    const ls::Scenario s = blocks_scenario(
        R"({"model": {"shared_expert": true}, "moe": {"capacity_factor": 0.5, "policy": "rounds"}, "numerics": {"leaf_samples": 2}})");
    for (const char* cut : {"layers.1.moe_routing", "layers.2.attention"}) check_two_stages(s, cut);
  }

  // A bad range is the caller's bug (the pipeline cuts at stream boundaries), not bad input.
  TEST_CASE("a range begins and ends only where just the residual stream crosses") {
    const ls::Scenario s = blocks_scenario("{}");
    ls::MoeTransformer m(s.model, s.leaf_samples, s.seed);
    std::vector<uint8_t> tokens((size_t)s.batch * (s.model.seq_len + 1), 7);
    std::vector<float> stream((size_t)s.batch * s.model.seq_len * s.model.d_model);
    ls::StageIo io;
    io.stream_in = stream.data();
    io.stream_out = stream.data();
    const int dispatch = block_index(m, "layers.0.moe_dispatch");
    CHECK_THROWS_WITH_AS(m.forward_range(tokens.data(), s.batch, true, 0, dispatch, io),
                         doctest::Contains("before block 3 (layers.0.moe_dispatch)"), ls::InternalError);
    CHECK_THROWS_AS(m.forward_range(tokens.data(), s.batch, true, dispatch, m.num_blocks(), io), ls::InternalError);
    CHECK_THROWS_AS(m.forward_range(tokens.data(), s.batch, true, 2, 2, io), ls::InternalError);
    CHECK_THROWS_AS(m.forward_range(tokens.data(), s.batch, true, 0, m.num_blocks() + 1, io), ls::InternalError);
  }
}
