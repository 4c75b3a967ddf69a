// Every hetero_comm operator schema, in one place, plus the module init that makes
// `import hetero_comm._C` run the static registrations. Kernels live in csrc/<family>.cpp
// (CPU) and cuda/<family>.cu (CUDA); schemas never do, so a CPU-only build defines every op.
// Each `*_into_` op is the out= form of the op before it (it writes a preallocated, e.g.
// pooled, buffer); Python exposes both as one function with an optional `out=`.
#include <Python.h>
#include <torch/library.h>

TORCH_LIBRARY(hetero_comm, m) {
  m.def("segment_accumulate_(Tensor(a!) residual, Tensor grad, int segment_size) -> Tensor");
  m.def("segment_accumulate_into_(Tensor(a!) residual, Tensor grad, int segment_size, "
        "Tensor(b!) out) -> ()");
  m.def("select_segments(Tensor importance, int k) -> Tensor");
  m.def("select_segments_into_(Tensor importance, Tensor(a!) out) -> ()");
  m.def("pack_segments_(Tensor(a!) residual, Tensor indices, int segment_size) -> Tensor");
  m.def("pack_segments_into_(Tensor(a!) residual, Tensor indices, int segment_size, "
        "Tensor(b!) out) -> ()");
  m.def("pack_quantized_segments_(Tensor(a!) residual, Tensor indices, int segment_size, "
        "Tensor scale, int levels, ScalarType dtype) -> Tensor");
  m.def("pack_quantized_segments_into_(Tensor(a!) residual, Tensor indices, int segment_size, "
        "Tensor scale, int levels, Tensor(b!) out) -> ()");
  m.def("unpack_segments(Tensor packed, Tensor indices, int segment_size, int numel, "
        "float scale=1.0) -> Tensor");
  m.def("unpack_segments_into_(Tensor packed, Tensor indices, int segment_size, float scale, "
        "Tensor(a!) out) -> ()");
  m.def("dct_encode(Tensor x, int block_size, int keep, int? group=None) -> Tensor");
  m.def("dct_encode_into_(Tensor x, int block_size, Tensor(a!) out) -> ()");
  m.def("dct_decode(Tensor coeffs, int block_size, int numel) -> Tensor");
  m.def("dct_decode_into_(Tensor coeffs, int block_size, Tensor(a!) out) -> ()");
  m.def("quantize(Tensor x, Tensor scale, int levels, ScalarType dtype) -> Tensor");
  m.def("quantize_into_(Tensor x, Tensor scale, int levels, Tensor(a!) out) -> ()");
  m.def("dequantize(Tensor q, Tensor scale, int levels) -> Tensor");
  m.def("dequantize_into_(Tensor q, Tensor scale, int levels, Tensor(a!) out) -> ()");
  // The sparse codec: the steps of one flat gradient's exchange, each writing given buffers.
  m.def("sparse_encode_(Tensor(a!) residual, Tensor grad, float weight, Tensor(b!)? velocity, "
        "float momentum, bool nesterov, int segment_size, int block_size, "
        "Tensor(c!)? coefficients, Tensor(d!) importance) -> ()");
  m.def("sparse_pack_(Tensor(a!) residual, Tensor(b!)? coefficients, Tensor(c!)? velocity, "
        "Tensor importance, int segment_size, int block_size, float scale_factor, int levels, "
        "Tensor(d!) indices, Tensor(e!)? scale, Tensor(f!) wire) -> bool");
  m.def("sparse_unpack_(Tensor wire, Tensor indices, Tensor? scale, int levels, "
        "int segment_size, int block_size, bool sign, Tensor(a!)? coefficients, "
        "Tensor(b!) grad) -> ()");
  // The strict-checks switch (csrc/strict_checks.cpp); returns the previous setting.
  // A count sketch of a gradient and its squared norm, added into the given sketch.
  m.def("gradient_sketch_(Tensor grad, int salt, Tensor(a!) sketch) -> ()");
  m.def("_set_strict_checks(bool enabled) -> bool");
  // Diagnostics: how many distinct threads at::parallel_for used (proves OpenMP is on).
  m.def("_parallel_threads_used(int work_items) -> int");
}

extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
