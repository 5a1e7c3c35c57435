// The trace of a multi-rank run in the one-rank format (docs/TRACE.md):
// every rank traces its pieces of each tensor (StepContext::trace_tensor
// says which rows and columns it holds); at the end of the step the pieces
// are assembled into the logical tensors and written in the one-rank order.
// A correct mesh gives the one-rank trace's records byte for byte. Beside
// the trace, FILE.ranks says which ranks hold which rows and columns of
// every record, so diff can name the rank of a differing element.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "cluster/communicator.h"
#include "cluster/config.h"
#include "trace/sink.h"

namespace ls {

class MeshTrace {
 public:
  // out: where the assembled records go; ranks_path: the side file ("" for
  // none); tensors: every parameter's name in canonical order (the order of
  // the params and grad records); coords: every world rank's place in the mesh.
  MeshTrace(TraceSink* out, std::string ranks_path, int n_layers, std::vector<std::string> tensors,
            std::vector<MeshConfig::RankCoords> coords);
  ~MeshTrace();

  // What rank r's model traces to (its tensors become pieces of this trace).
  TraceSink* rank_sink(int rank);
  // Under MPI: every process's pieces go to process 0 at flush, which alone writes.
  void set_processes(Communicator* procs) { procs_ = procs; }
  // A piece from rank r (any thread), its values held as `dtype`.
  void add(int rank, const char* phase, int layer, const char* op, const char* name, const float* data,
           const std::vector<int64_t>& shape, const TracePiece& piece, TraceDtype dtype = TraceDtype::kF32);
  // The step's records, assembled and written in the one-rank order; the
  // side file with the first step's. Throws InternalError naming a record
  // whose elements no rank wrote.
  void flush();

 private:
  struct Piece {
    int rank = 0;
    TracePiece where;
    std::vector<float> data;  // packed: row runs, each row's column runs
  };
  struct Record {
    std::string phase, op, name;
    int layer = 0;
    std::vector<int64_t> shape;
    TraceDtype dtype = TraceDtype::kF32;  // every rank's pieces say the same
    int64_t seq = 0;  // params and grad: the tensor's canonical index
    std::vector<Piece> pieces;
  };
  using Key = std::tuple<int, int64_t, int, int64_t>;  // phase, layer order, op order, seq
  Key order_of(const Record& r) const;
  // MPI: this process's records to process 0, whose records become every process's.
  void gather_to_first();
  void write_ranks_file(const std::vector<const Record*>& in_order);

  TraceSink* out_;
  Communicator* procs_ = nullptr;
  std::string ranks_path_;
  int n_layers_;
  std::map<std::string, int64_t> tensor_index_;
  std::vector<MeshConfig::RankCoords> coords_;
  std::vector<std::unique_ptr<TraceSink>> sinks_;
  std::mutex mu_;
  std::map<std::tuple<std::string, int, std::string, std::string>, Record> records_;
  bool ranks_written_ = false;
};

}  // namespace ls
