// One decoder layer in one call: the library's own kernels, in the order and with the operands the
// Python pipeline (prism_backend/model/transformer.py ForestTransformer._layer) gives them, so the same
// bits -- without the interpreter between them. Between two kernels the Python pipeline spent ~0.6 ms a
// layer on 2 cores (allocating, checking, building ctypes arguments, with caches the kernels had just
// filled), while the other core waited: ~6% of a forward on (a).
//
//   qkv     RMSNorm(h, input_norm) quantised for qkv (prism_rms_norm_quantize_*), the product with the
//           rotary embedding of the query and key heads in its epilogue, the queries into q (m, q_dim)
//           and the keys and values into rows [keys - m, keys) of kv (keys, 2 kv_dim) (the split output)
//   attn    tree attention over the forest's segments, k and v read in place from kv
//   o       attn quantised, the product + h into h_mid (the residual in the epilogue)
//   mlp     RMSNorm(h_mid, post_norm) quantised for gate_up; gate_up's product, ending in SwiGLU where
//           its 8-bit tile does (else down's quantiser runs SwiGLU); down's quantiser with its online
//           Hadamard where the model has one; down's product + h_mid into h_out
// Each projection runs on its VNNI kernel: 8 bits (prism_vnni8_gemm, a uint8 operand holding q + 128) or
// 13-16 bits (prism_vnni16_gemm, int16). The caller (kernels/cpu/decoder_layer.py) checks that every
// projection of the layer has one of these kernels and the rest of the layer these steps.
#include <stdint.h>

extern "C" {
void prism_vnni16_gemm(const int16_t* x, int m, int kpairs, const int16_t* packed, const int32_t* wmax, int n, int block,
                       const float* x_scale, const float* w_scale, const float* bias, const float* residual, void* out,
                       int threads, const float* cos, const float* sin, int rotary_cols, float* out2, int split);
void prism_vnni8_gemm(const uint8_t* x, int m, int kquads, const int8_t* packed, const int32_t* corr, int n,
                      const float* x_scale, const float* w_scale, const float* bias, const float* residual, void* out,
                      int threads, int swiglu, const float* cos, const float* sin, int rotary_cols, float* out2,
                      int split);
void prism_quantize_rows(const float* x, int m, int k, int bound, int16_t* q, int ldq, float* scale, int wide,
                         int threads);
void prism_quantize_rows_u8(const float* x, int m, int k, int bound, uint8_t* q, int ldq, float* scale, int wide,
                            int threads);
void prism_rms_norm_quantize_i16(const float* x, int m, int h, const float* w, float eps, int bound, int16_t* q,
                                 int ldq, float* scale, int wide, int threads);
void prism_rms_norm_quantize_u8(const float* x, int m, int h, const float* w, float eps, int bound, uint8_t* q,
                                int ldq, float* scale, int wide, int threads);
void prism_swiglu_quantize_i16(const float* gate_up, int m, int i, int block, int bound, int16_t* q, int ldq,
                               float* scale, int wide, int threads);
void prism_swiglu_quantize_u8(const float* gate_up, int m, int i, int block, int bound, uint8_t* q, int ldq,
                              float* scale, int wide, int threads);
void prism_hadamard_quantize_i16(const float* x, int m, int k, int block, int bound, int16_t* q, int ldq,
                                 float* scale, int wide, int threads);
void prism_hadamard_quantize_u8(const float* x, int m, int k, int block, int bound, uint8_t* q, int ldq,
                                float* scale, int wide, int threads);
void prism_tree_attention(const float* q, const float* k, const float* v, const int32_t* key_rows,
                          const int32_t* segments, int count, int hq, int hkv, int n, float* out, int wide,
                          int threads, int integer, long ldq, long ldk, long ldv);
}

namespace {

// One projection's packed weight (exact_gemm.PackedWeight with vnni, or PackedWeight8 without AMX)
struct Projection {
  int bits;              // 8: prism_vnni8_gemm; 16: prism_vnni16_gemm
  int k, groups;         // input columns; kquads (8) or kpairs (16): the operand is 4 or 2 times as wide
  int n, block;          // output columns; vnni16's k-pairs per exact int32 run (exact_gemm.chunk_pairs)
  int x_bound;           // the activations' integer bound
  const void* packed;    // the panels
  const int32_t* aux;    // corr (8) or wmax (16)
  const float* w_scale;  // (n,), in the panels' column order
  const float* bias;     // (n,) or null, likewise
};

// The row pass a quantiser runs in front of a projection (kernels/cpu/prologues.py)
enum Pass { PLAIN = 0, RMS_NORM = 1, SWIGLU = 2, HADAMARD = 3 };

}  // namespace

extern "C" {

// The layer's weights and shapes, the same for every forward (built once, kernels/cpu/decoder_layer.py)
struct PrismLayer {
  Projection qkv, o, gate_up, down;
  const float* input_norm;  // (hidden,)
  const float* post_norm;   // (hidden,)
  float eps;
  int hidden, q_dim, kv_dim, heads, kv_heads, intermediate;
  int swiglu_in_gate_up;    // gate_up's tile ends in SwiGLU; else down's quantiser runs it
  int down_block;           // down's online Hadamard block (a power of two), 0: none
};

// One forward's (or prefill chunk's) operands, the same for every layer
struct PrismForward {
  int m;                              // rows computed
  int keys;                           // rows attention sees: the rows before them (cache, earlier chunks) + m
  const float* cos;                   // (m, 64): the computed rows' rotary table rows
  const float* sin;
  const int32_t* key_rows;            // tree_attention.segment_table's
  const int32_t* segments;
  int count;                          // segments
  int attention_wide, integer;        // tree attention's instance and form
  int quantizer_wide, threads;
  void* operand;                      // scratch: the widest projection operand, (m, width) int16 or uint8
  float* scale;                       // (m,)
  float* q;                           // (m, q_dim)
  float* attn;                        // (m, q_dim)
  float* h_mid;                       // (m, hidden): h + o(attn)
  float* act;                         // (m, intermediate), or (m, 2 intermediate) where down runs SwiGLU
};

}  // extern "C"

namespace {

// The quantisers of one operand type (uint8 holding q + 128, or int16), by the row pass in front
template <typename T>
struct Quantizers {
  void (*plain)(const float* x, int m, int k, int bound, T* q, int ldq, float* scale, int wide, int threads);
  void (*rms_norm)(const float* x, int m, int k, const float* w, float eps, int bound, T* q, int ldq, float* scale,
                   int wide, int threads);
  void (*swiglu)(const float* x, int m, int k, int block, int bound, T* q, int ldq, float* scale, int wide, int threads);
  void (*hadamard)(const float* x, int m, int k, int block, int bound, T* q, int ldq, float* scale, int wide,
                   int threads);
};
const Quantizers<uint8_t> U8{prism_quantize_rows_u8, prism_rms_norm_quantize_u8, prism_swiglu_quantize_u8,
                             prism_hadamard_quantize_u8};
const Quantizers<int16_t> I16{prism_quantize_rows, prism_rms_norm_quantize_i16, prism_swiglu_quantize_i16,
                              prism_hadamard_quantize_i16};

template <typename T>
void quantize_into(const Quantizers<T>& with, int ldq, const Projection& p, const PrismForward& f, const float* x,
                   Pass pass, const float* norm, float eps, int block) {
  T* q = static_cast<T*>(f.operand);
  const int m = f.m, k = p.k, bound = p.x_bound, wide = f.quantizer_wide, threads = f.threads;
  switch (pass) {
    case RMS_NORM: return with.rms_norm(x, m, k, norm, eps, bound, q, ldq, f.scale, wide, threads);
    case SWIGLU: return with.swiglu(x, m, k, block, bound, q, ldq, f.scale, wide, threads);
    case HADAMARD: return with.hadamard(x, m, k, block, bound, q, ldq, f.scale, wide, threads);
    default: return with.plain(x, m, k, bound, q, ldq, f.scale, wide, threads);
  }
}

// x's rows after `pass` quantised for p into the forward's operand and scale (exact_gemm._quantize_rows)
void quantize(const Projection& p, const PrismForward& f, const float* x, Pass pass, const float* norm, float eps,
              int block) {
  if (p.bits == 8)
    quantize_into(U8, 4 * p.groups, p, f, x, pass, norm, eps, block);
  else
    quantize_into(I16, 2 * p.groups, p, f, x, pass, norm, eps, block);
}

// The product of the quantised operand and p, dequantised (+ residual) into out (exact_gemm's matmul)
void product(const Projection& p, const PrismForward& f, const float* residual, float* out, int swiglu = 0,
             const float* cos = nullptr, const float* sin = nullptr, int rotary_cols = 0, float* out2 = nullptr,
             int split = 0) {
  if (p.bits == 8)
    prism_vnni8_gemm(static_cast<const uint8_t*>(f.operand), f.m, p.groups, static_cast<const int8_t*>(p.packed),
                     p.aux, p.n, f.scale, p.w_scale, p.bias, residual, out, f.threads, swiglu, cos, sin, rotary_cols,
                     out2, split);
  else
    prism_vnni16_gemm(static_cast<const int16_t*>(f.operand), f.m, p.groups, static_cast<const int16_t*>(p.packed),
                      p.aux, p.n, p.block, f.scale, p.w_scale, p.bias, residual, out, f.threads, cos, sin,
                      rotary_cols, out2, split);
}

}  // namespace

extern "C" {

// h: (m, hidden) the layer's input rows; kv: (keys, 2 kv_dim), its rows before keys - m already holding
// the earlier rows' keys and values (this call writes the rest); h_out: (m, hidden) the layer's output.
void prism_decoder_layer(const PrismLayer* layer, const PrismForward* forward, const float* h, float* kv,
                         float* h_out) {
  const PrismLayer& L = *layer;
  const PrismForward& f = *forward;
  const long ldkv = 2L * L.kv_dim;
  quantize(L.qkv, f, h, RMS_NORM, L.input_norm, L.eps, 0);
  product(L.qkv, f, nullptr, f.q, 0, f.cos, f.sin, L.q_dim + L.kv_dim, kv + (long)(f.keys - f.m) * ldkv, L.q_dim);
  prism_tree_attention(f.q, kv, kv + L.kv_dim, f.key_rows, f.segments, f.count, L.heads, L.kv_heads, f.keys, f.attn,
                       f.attention_wide, f.threads, f.integer, L.q_dim, ldkv, ldkv);
  quantize(L.o, f, f.attn, PLAIN, nullptr, 0.0f, 0);
  product(L.o, f, h, f.h_mid);
  quantize(L.gate_up, f, f.h_mid, RMS_NORM, L.post_norm, L.eps, 0);
  product(L.gate_up, f, nullptr, f.act, L.swiglu_in_gate_up);
  if (L.swiglu_in_gate_up)
    quantize(L.down, f, f.act, L.down_block ? HADAMARD : PLAIN, nullptr, 0.0f, L.down_block);
  else
    quantize(L.down, f, f.act, SWIGLU, nullptr, 0.0f, L.down_block);
  product(L.down, f, f.h_mid, h_out);
}

}  // extern "C"
