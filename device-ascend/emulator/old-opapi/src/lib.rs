//! An emulated `libopapi.so` of an older CANN (`libiris_cann_emulator_old_opapi.so`): the
//! ops of the emulated runtime except the transformer ops (`aclnnFlashAttentionVarLenScore`,
//! `aclnnRotaryPositionEmbedding`), whose symbols are really absent. Loaded beside the full
//! emulation's runtime and nnopbase, it shows how iris's Ascend device serves an op library
//! that lacks some ops: those are unsupported, the rest work.

iris_cann_emulator::export_core_ops!();
