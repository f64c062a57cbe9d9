// The extension module: spirit's CPU kernels (qgemm.cpp: packed products; layer_ops.cpp: the
// per-row pieces of a decoder layer around them), built together by model/qgemm.py.

#include <torch/extension.h>

#include <string>
#include <vector>

at::Tensor qgemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                 const at::Tensor& bias, int64_t bits, const at::Tensor& panels);
at::Tensor prefill_qgemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                         const at::Tensor& bias, int64_t bits);
std::string isa();
bool amx();
void dequantize(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset, at::Tensor& out, int64_t bits);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                      int64_t head_dim, const at::Tensor& q_norm, const at::Tensor& k_norm, double norm_eps,
                      const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                      const at::Tensor& cache_of_row, const at::Tensor& slot_of_row);
at::Tensor rowwise_attention(const at::Tensor& q, const std::vector<at::Tensor>& keys, const std::vector<at::Tensor>& values,
                             const at::Tensor& cache_of_row, const at::Tensor& offsets, const at::Tensor& slots,
                             double scaling, double softcap);
at::Tensor silu_mul(const at::Tensor& gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qgemm", &qgemm, "weight-only int4/int8 x int8-quantized activations, row-invariant");
  m.def("prefill_qgemm", &prefill_qgemm, "bfloat16 tile products for prefill (AMX), not row-invariant");
  m.def("isa", &isa, "instruction set of the dot products");
  m.def("amx", &amx, "whether many-row products take AMX tile products here");
  m.def("dequantize", &dequantize, "the packed weight into a dense bfloat16 matrix");
  m.def("rms_norm", &rms_norm, "RMSNorm per row, float32 sums, rounded once");
  m.def("rope_write", &rope_write, "rotary embedding of q and k (optional per-head norm); writes k and v to the cache");
  m.def("rowwise_attention", &rowwise_attention, "each row attends alone to its own cache slots");
  m.def("silu_mul", &silu_mul, "silu(gate) * up");
}
