//! aclnn data types the emulation computes with, and element loads and stores.
//!
//! Conversions follow the hardware's: floats round to nearest even, integers keep their low
//! bits. Element offsets come from descriptors whose storage lies in one mapping of a 64-bit
//! host, so they fit in `isize`.

// Narrowing and sign-changing casts here are the element conversions themselves.
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_possible_wrap
)]

use half::{bf16, f16};

/// An `aclDataType` the emulation knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// `ACL_FLOAT` (0).
    F32,
    /// `ACL_FLOAT16` (1).
    F16,
    /// `ACL_INT8` (2).
    I8,
    /// `ACL_INT32` (3).
    I32,
    /// `ACL_UINT8` (4).
    U8,
    /// `ACL_INT16` (6).
    I16,
    /// `ACL_INT64` (9).
    I64,
    /// `ACL_DOUBLE` (11).
    F64,
    /// `ACL_BOOL` (12).
    Bool,
    /// `ACL_BF16` (27).
    Bf16,
}

impl Dtype {
    /// The dtype of an `aclDataType` code.
    pub fn from_code(code: i32) -> Option<Dtype> {
        Some(match code {
            0 => Dtype::F32,
            1 => Dtype::F16,
            2 => Dtype::I8,
            3 => Dtype::I32,
            4 => Dtype::U8,
            6 => Dtype::I16,
            9 => Dtype::I64,
            11 => Dtype::F64,
            12 => Dtype::Bool,
            27 => Dtype::Bf16,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::I8 | Dtype::U8 | Dtype::Bool => 1,
            Dtype::F16 | Dtype::Bf16 | Dtype::I16 => 2,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::I64 | Dtype::F64 => 8,
        }
    }

    /// A floating-point dtype.
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::F32 | Dtype::F16 | Dtype::Bf16 | Dtype::F64)
    }

    /// Rounds an f32 to this dtype and back (what storing and loading does).
    pub fn round(self, value: f32) -> f32 {
        match self {
            Dtype::F16 => f16::from_f32(value).to_f32(),
            Dtype::Bf16 => bf16::from_f32(value).to_f32(),
            _ => value,
        }
    }

    /// Loads element `at` (in elements) from `base` as f32.
    ///
    /// # Safety
    /// `base + at · size` is readable and aligned for the dtype's bytes (read unaligned).
    pub unsafe fn load(self, base: *const u8, at: i64) -> f32 {
        let p = base.wrapping_offset(at as isize * self.size() as isize);
        // SAFETY: caller's contract; unaligned reads.
        unsafe {
            match self {
                Dtype::F32 => p.cast::<f32>().read_unaligned(),
                Dtype::F16 => f16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
                Dtype::Bf16 => bf16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
                Dtype::F64 => p.cast::<f64>().read_unaligned() as f32,
                _ => self.load_int(base, at) as f32,
            }
        }
    }

    /// Stores an f32 (rounded to nearest even, saturating for integers) at element `at`.
    ///
    /// # Safety
    /// `base + at · size` is writable.
    pub unsafe fn store(self, base: *mut u8, at: i64, value: f32) {
        let p = base.wrapping_offset(at as isize * self.size() as isize);
        // SAFETY: caller's contract; unaligned writes.
        unsafe {
            match self {
                Dtype::F32 => p.cast::<f32>().write_unaligned(value),
                Dtype::F16 => p
                    .cast::<u16>()
                    .write_unaligned(f16::from_f32(value).to_bits()),
                Dtype::Bf16 => p
                    .cast::<u16>()
                    .write_unaligned(bf16::from_f32(value).to_bits()),
                Dtype::F64 => p.cast::<f64>().write_unaligned(f64::from(value)),
                _ => self.store_int(base, at, value.round_ties_even() as i64),
            }
        }
    }

    /// Loads element `at` as an integer.
    ///
    /// # Safety
    /// As for [`Dtype::load`].
    pub unsafe fn load_int(self, base: *const u8, at: i64) -> i64 {
        let p = base.wrapping_offset(at as isize * self.size() as isize);
        // SAFETY: caller's contract; unaligned reads.
        unsafe {
            match self {
                Dtype::I8 => i64::from(p.cast::<i8>().read_unaligned()),
                Dtype::U8 | Dtype::Bool => i64::from(p.read_unaligned()),
                Dtype::I16 => i64::from(p.cast::<i16>().read_unaligned()),
                Dtype::I32 => i64::from(p.cast::<i32>().read_unaligned()),
                Dtype::I64 => p.cast::<i64>().read_unaligned(),
                _ => self.load(base, at) as i64,
            }
        }
    }

    /// Stores the low bits of an integer at element `at`.
    ///
    /// # Safety
    /// As for [`Dtype::store`].
    pub unsafe fn store_int(self, base: *mut u8, at: i64, value: i64) {
        let p = base.wrapping_offset(at as isize * self.size() as isize);
        // SAFETY: caller's contract; integers keep their low bits, as a bit pattern fill does.
        unsafe {
            match self {
                Dtype::I8 => p.cast::<i8>().write_unaligned(value as i8),
                Dtype::U8 | Dtype::Bool => p.write_unaligned(value as u8),
                Dtype::I16 => p.cast::<i16>().write_unaligned(value as i16),
                Dtype::I32 => p.cast::<i32>().write_unaligned(value as i32),
                Dtype::I64 => p.cast::<i64>().write_unaligned(value),
                _ => self.store(base, at, value as f32),
            }
        }
    }

    /// Reads a host scalar of this dtype: `(as f64, as integer bits)`.
    ///
    /// # Safety
    /// `p` points at a readable value of this dtype.
    pub unsafe fn load_scalar(self, p: *const u8) -> (f64, i64) {
        // SAFETY: caller's contract.
        unsafe {
            match self {
                Dtype::F64 => {
                    let v = p.cast::<f64>().read_unaligned();
                    (v, v as i64)
                }
                Dtype::F32 | Dtype::F16 | Dtype::Bf16 => {
                    let v = f64::from(self.load(p, 0));
                    (v, v as i64)
                }
                _ => {
                    let v = self.load_int(p, 0);
                    (v as f64, v)
                }
            }
        }
    }
}
