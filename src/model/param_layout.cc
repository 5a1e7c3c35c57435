#include "model/param_layout.h"

#include <stdexcept>

namespace ls {

namespace {

// What a tensor is, as tensor parallelism sees it (Megatron's column- and
// row-parallel linears): QKV by head columns in each of q, k, v; the output
// projection by head rows; an expert's (or the shared expert's) w1, w3 by
// hidden columns and w2 by hidden rows. Norms, embeddings, router and head
// are replicated.
enum class Style { kReplicated, kHeadColumns, kHeadRows, kHiddenColumns, kHiddenRows };

struct Declared {
  std::string name;
  std::vector<int64_t> shape;
  Style style = Style::kReplicated;
  bool expert = false;  // a routed expert's: dimension 0 indexes the experts
};

std::vector<Declared> declare_tensors(const ModelConfig& c) {
  const int64_t V = c.vocab, D = c.d_model, F = c.d_ff, E = c.experts, T = c.seq_len;
  std::vector<Declared> out = {{"tok_emb", {V, D}}, {"pos_emb", {T, D}}, {"final_norm", {D}}, {"lm_head", {D, V}}};
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    out.push_back({p + "attn_norm", {D}});
    out.push_back({p + "wqkv", {D, 3 * D}, Style::kHeadColumns});
    out.push_back({p + "wo", {D, D}, Style::kHeadRows});
    out.push_back({p + "moe_norm", {D}});
    out.push_back({p + "router", {D, E}});
    out.push_back({p + "experts.w1", {E, D, F}, Style::kHiddenColumns, true});
    out.push_back({p + "experts.w3", {E, D, F}, Style::kHiddenColumns, true});
    out.push_back({p + "experts.w2", {E, F, D}, Style::kHiddenRows, true});
    if (c.shared_expert) {
      out.push_back({p + "shared.w1", {D, F}, Style::kHiddenColumns});
      out.push_back({p + "shared.w3", {D, F}, Style::kHiddenColumns});
      out.push_back({p + "shared.w2", {F, D}, Style::kHiddenRows});
    }
  }
  std::sort(out.begin(), out.end(), [](const Declared& a, const Declared& b) { return a.name < b.name; });
  return out;  // canonical (bytewise) name order
}

// The [outer, mid, inner] view of a style's split of `held` (the tensor, or
// its expert slice of `experts` experts): mid is the dimension split.
TensorSplit feature_view(const ModelConfig& c, Style style, int64_t experts) {
  const int64_t D = c.d_model, F = c.d_ff;
  TensorSplit s;
  switch (style) {
    case Style::kHeadColumns: s.outer = D * 3, s.mid = D, s.inner = 1; break;
    case Style::kHeadRows: s.outer = 1, s.mid = D, s.inner = D; break;
    case Style::kHiddenColumns: s.outer = experts * D, s.mid = F, s.inner = 1; break;
    case Style::kHiddenRows: s.outer = experts, s.mid = F, s.inner = D; break;
    case Style::kReplicated: break;
  }
  return s;
}

int64_t product(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

const TensorSplit* ParamInfo::feature_split() const {
  for (const TensorSplit& s : splits)
    if (s.axis != Axis::kExpert) return &s;
  return nullptr;
}

bool ParamInfo::split_over(Axis a) const {
  return std::any_of(splits.begin(), splits.end(), [a](const TensorSplit& s) { return s.axis == a; });
}

int64_t ParamInfo::global_index(int64_t i) const {
  const TensorSplit* s = feature_split();
  if (!s) return global_offset + i;
  const int64_t held = s->held();
  const int64_t outer = i / (held * s->inner), rest = i % (held * s->inner);
  return global_offset + (outer * s->mid + s->first + rest / s->inner) * s->inner + rest % s->inner;
}

std::vector<ParamInfo> place_params(const ModelConfig& cfg, const MeshConfig& mesh, const MeshConfig::RankCoords& at) {
  const int ep = mesh.ep, tp = mesh.tp, etp = mesh.expert_tp();
  if (ep < 1 || cfg.experts % ep != 0)
    throw std::invalid_argument("engine: expert parallel size must divide the expert count");
  if (tp < 1 || cfg.n_heads % tp != 0 || cfg.d_ff % tp != 0)
    throw std::invalid_argument("engine: tensor parallel size must divide the heads and the hidden width");
  if (etp < 1 || (tp % etp != 0 && etp % tp != 0) || cfg.d_ff % etp != 0)
    throw std::invalid_argument("engine: expert tensor parallel size must divide or be a multiple of mesh.tp, "
                                "and divide the hidden width");
  const int64_t local_experts = cfg.experts / ep;
  std::vector<ParamInfo> infos;
  int64_t off = 0;
  for (const Declared& d : declare_tensors(cfg)) {
    ParamInfo p;
    p.name = d.name;
    p.index = (int)infos.size();
    p.global_shape = p.shape = d.shape;
    p.expert = d.expert;
    if (d.expert && ep > 1) {  // a contiguous range of experts
      const int64_t per_expert = product(d.shape) / cfg.experts;
      const int64_t first = local_experts * mesh.rank_along(Axis::kExpert, at);
      p.splits.push_back({Axis::kExpert, ep, 1, cfg.experts, per_expert, first});
      p.shape[0] = local_experts;
      p.global_offset = first * per_expert;
    }
    // Routed experts split their hidden features over their own axis (attention's when mesh.etp = mesh.tp).
    const Axis axis = d.expert ? mesh.expert_tensor_axis() : Axis::kTensor;
    const int parts = mesh.size(axis);
    if (d.style != Style::kReplicated && parts > 1) {
      TensorSplit s = feature_view(cfg, d.style, local_experts);
      s.axis = axis;
      s.parts = parts;
      s.first = s.held() * mesh.rank_along(axis, at);
      // The held shape: the split dimension (columns: the last; rows: the one before the inner width).
      p.shape[s.inner == 1 ? p.shape.size() - 1 : p.shape.size() - 2] /= parts;
      p.splits.push_back(s);
    }
    p.size = product(p.shape);
    p.offset = off;
    p.decay = d.shape.size() > 1;
    off += p.size;
    infos.push_back(p);
  }
  return infos;
}

int64_t count_weights(const ModelConfig& cfg, const MeshConfig& mesh) {
  int64_t n = 0;
  for (const ParamInfo& p : place_params(cfg, mesh, MeshConfig::RankCoords{})) n += p.size;
  return n;
}

}  // namespace ls
