//! The emulated CANN runtime as one shared library (`libiris_cann_emulator.so`): AscendCL,
//! libnnopbase and every aclnn op iris uses. Tests expose it under the runtime's and the op
//! libraries' file names; see the `iris-cann-emulator` crate for what is emulated.

iris_cann_emulator::export_runtime!();
iris_cann_emulator::export_nnopbase!();
iris_cann_emulator::export_all_ops!();
