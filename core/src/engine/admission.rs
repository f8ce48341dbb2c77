//! Backpressure: the engine takes at most so many requests, and at most so many embedding tokens
//! of images, between admission and the request's end (preprocessing, queued, running).
//!
//! Every byte of host memory a request holds (its encoded images, decoded pixels and
//! preprocessed rows) is proportional to its tokens, so the two bounds together bound the host
//! memory of work in flight. A request beyond either bound is refused at once with
//! [`EngineError::Overloaded`] (HTTP 503 with `Retry-After`), before any image is decoded: the
//! tokens are estimated from the image headers, with the same resize rule preprocessing applies.
//!
//! A request is always admitted when nothing else is pending, whatever its size, so that a
//! request larger than the token bound is not refused forever (the encoder budget, not
//! backpressure, decides whether it can ever run).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::budget::SchedulerConfig;
use crate::engine::api::{AdmissionStats, EngineError};
use crate::preprocess::{DecodeLimits, ProcessorConfig, probe, smart_resize};

/// Default bound on pending requests, per running request (`max_num_seqs`): one batch running
/// and one waiting behind it.
pub const DEFAULT_QUEUED_REQUESTS_PER_SEQ: u64 = 2;
/// Default bound on pending embedding tokens, in steps of `max_num_batched_tokens`.
pub const DEFAULT_PENDING_TOKENS_PER_STEP: u64 = 4;

/// The admission bounds as configured (flags, or the config file's `[admission]`); `None` takes
/// the default derived from the scheduler.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionConfig {
    /// Most requests admitted and not yet finished.
    pub max_queued_requests: Option<u64>,
    /// Most embedding tokens of admitted, unfinished requests.
    pub max_pending_tokens: Option<u64>,
}

/// The admission bounds in effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct AdmissionLimits {
    /// Most requests admitted and not yet finished.
    pub max_queued_requests: u64,
    /// Most embedding tokens of admitted, unfinished requests.
    pub max_pending_tokens: u64,
}

impl AdmissionConfig {
    /// The bounds in effect: the configured ones, else `2 x max_num_seqs` requests and
    /// `4 x max_num_batched_tokens` tokens (each at least 1).
    ///
    /// ```
    /// use iris_core::budget::SchedulerConfig;
    /// use iris_core::engine::admission::AdmissionConfig;
    ///
    /// let scheduler = SchedulerConfig { max_num_batched_tokens: 2048, max_num_seqs: 4, ..SchedulerConfig::default() };
    /// let limits = AdmissionConfig::default().limits(&scheduler);
    /// assert_eq!((limits.max_queued_requests, limits.max_pending_tokens), (8, 8192));
    /// let set = AdmissionConfig { max_queued_requests: Some(3), max_pending_tokens: None };
    /// assert_eq!(set.limits(&scheduler).max_queued_requests, 3);
    /// ```
    pub fn limits(&self, scheduler: &SchedulerConfig) -> AdmissionLimits {
        AdmissionLimits {
            max_queued_requests: self
                .max_queued_requests
                .unwrap_or_else(|| {
                    scheduler
                        .max_num_seqs
                        .saturating_mul(DEFAULT_QUEUED_REQUESTS_PER_SEQ)
                })
                .max(1),
            max_pending_tokens: self
                .max_pending_tokens
                .unwrap_or_else(|| {
                    scheduler
                        .max_num_batched_tokens
                        .saturating_mul(DEFAULT_PENDING_TOKENS_PER_STEP)
                })
                .max(1),
        }
    }
}

/// The pending figures, shared by the handle and every [`Permit`].
#[derive(Debug)]
pub(crate) struct Admission {
    limits: AdmissionLimits,
    pending: Mutex<Pending>,
    rejected: AtomicU64,
}

#[derive(Debug, Default)]
struct Pending {
    requests: u64,
    tokens: u64,
    peak_requests: u64,
    peak_tokens: u64,
}

/// One admitted request's hold on the bounds; dropping it (the request ended, failed or its
/// client went away) gives its share back, once no [`PermitHold`] of it is left either.
#[derive(Debug)]
pub struct Permit {
    held: Arc<Held>,
}

/// A share of a request's [`Permit`] that work outliving the request's future keeps: a
/// blocking task (preprocessing, a video's decoding) runs on when its client hangs up, and the
/// request's slot and tokens stay counted until the task, holding this, ends.
#[derive(Debug, Clone)]
pub struct PermitHold {
    _held: Arc<Held>,
}

/// What a permit and its holds share: released when the last of them is dropped.
#[derive(Debug)]
struct Held {
    admission: Arc<Admission>,
    /// Charged tokens; changed only under the admission's lock.
    tokens: AtomicU64,
}

impl Permit {
    /// The tokens charged to this request so far.
    pub(crate) fn charged(&self) -> u64 {
        self.held.tokens.load(Ordering::Relaxed)
    }

    /// A share of this permit for work that may outlive the request's future.
    #[must_use]
    pub fn hold(&self) -> PermitHold {
        PermitHold {
            _held: Arc::clone(&self.held),
        }
    }
}

impl Admission {
    pub(crate) fn new(limits: AdmissionLimits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            pending: Mutex::new(Pending::default()),
            rejected: AtomicU64::new(0),
        })
    }

    /// Takes a request slot, or refuses when the request bound is reached.
    pub(crate) fn admit(self: &Arc<Self>) -> Result<Permit, EngineError> {
        let mut p = self.lock();
        if p.requests >= self.limits.max_queued_requests {
            drop(p);
            return Err(self.refuse());
        }
        p.requests += 1;
        p.peak_requests = p.peak_requests.max(p.requests);
        Ok(Permit {
            held: Arc::new(Held {
                admission: Arc::clone(self),
                tokens: AtomicU64::new(0),
            }),
        })
    }

    /// Charges `tokens` to `permit`, or refuses when they would pass the token bound while
    /// other work is pending.
    pub(crate) fn charge(&self, permit: &mut Permit, tokens: u64) -> Result<(), EngineError> {
        let mut p = self.lock();
        let mine = permit.charged();
        let others = p.tokens - mine;
        let alone = p.requests <= 1 && others == 0;
        if !alone && p.tokens.saturating_add(tokens) > self.limits.max_pending_tokens {
            drop(p);
            return Err(self.refuse());
        }
        p.tokens += tokens;
        p.peak_tokens = p.peak_tokens.max(p.tokens);
        permit.held.tokens.store(mine + tokens, Ordering::Relaxed);
        Ok(())
    }

    pub(crate) fn stats(&self) -> AdmissionStats {
        let p = self.lock();
        AdmissionStats {
            max_queued_requests: self.limits.max_queued_requests,
            max_pending_tokens: self.limits.max_pending_tokens,
            pending_requests: p.requests,
            pending_tokens: p.tokens,
            peak_pending_requests: p.peak_requests,
            peak_pending_tokens: p.peak_tokens,
            rejected_requests: self.rejected.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn limits(&self) -> AdmissionLimits {
        self.limits
    }

    fn refuse(&self) -> EngineError {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        EngineError::Overloaded
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut p = self.admission.lock();
        p.requests = p.requests.saturating_sub(1);
        p.tokens = p.tokens.saturating_sub(*self.tokens.get_mut());
    }
}

/// The embedding tokens an encoded image will produce, from its header alone; 0 when the
/// header cannot be read (preprocessing then refuses the image with the precise error).
///
/// The header's size is the one before the EXIF orientation, and that is enough: a quarter
/// turn swaps width and height, and `smart_resize` rounds and scales each side by the same
/// rule, so the grid is transposed and the token count is the same.
pub(crate) fn estimate_tokens(
    bytes: &[u8],
    limits: &DecodeLimits,
    processor: &ProcessorConfig,
) -> u64 {
    let Ok(info) = probe(bytes, limits) else {
        return 0;
    };
    let factor = processor.factor();
    smart_resize(
        info.size,
        factor,
        processor.min_pixels,
        processor.max_pixels,
    )
    .map_or(0, |size| {
        u64::from(size.width / factor) * u64::from(size.height / factor)
    })
}

#[cfg(test)]
mod tests {
    use image::ImageEncoder;
    use image::codecs::png::PngEncoder;

    use super::*;
    use crate::preprocess::{ImageSize, preprocess};

    fn admission(requests: u64, tokens: u64) -> Arc<Admission> {
        Admission::new(AdmissionLimits {
            max_queued_requests: requests,
            max_pending_tokens: tokens,
        })
    }

    #[test]
    fn a_permits_slot_and_tokens_stay_counted_while_a_hold_of_it_lives() {
        let admission = admission(1, 100);
        let mut permit = admission.admit().unwrap();
        admission.charge(&mut permit, 40).unwrap();
        let hold = permit.hold();
        // The request's future is gone; its blocking work, holding this, is not.
        drop(permit);
        let stats = admission.stats();
        assert_eq!((stats.pending_requests, stats.pending_tokens), (1, 40));
        assert!(matches!(admission.admit(), Err(EngineError::Overloaded)));
        drop(hold);
        let stats = admission.stats();
        assert_eq!((stats.pending_requests, stats.pending_tokens), (0, 0));
        assert!(admission.admit().is_ok());
    }

    /// A 150x40 PNG whose EXIF orientation (6) turns it into 40x150 when decoded.
    fn png_turned_a_quarter() -> Vec<u8> {
        // A big-endian TIFF header and one IFD entry: Orientation (0x0112), SHORT, 1, value 6.
        let exif = [
            b'M', b'M', 0, 42, 0, 0, 0, 8, 0, 1, 0x01, 0x12, 0, 3, 0, 0, 0, 1, 0, 6, 0, 0, 0, 0, 0,
            0,
        ];
        let mut png = Vec::new();
        let mut encoder = PngEncoder::new(&mut png);
        encoder.set_exif_metadata(exif.to_vec()).unwrap();
        let rgb: Vec<u8> = (0u8..251).cycle().take(150 * 40 * 3).collect();
        encoder
            .write_image(&rgb, 150, 40, image::ExtendedColorType::Rgb8)
            .unwrap();
        png
    }

    #[test]
    fn the_estimate_from_the_header_counts_the_tokens_of_the_turned_image() {
        let (png, limits) = (png_turned_a_quarter(), DecodeLimits::default());
        for processor in [ProcessorConfig::qwen2_vl(), ProcessorConfig::qwen3_vl()] {
            let image = preprocess(&png, &processor, &limits).unwrap();
            assert_eq!(
                image.original_size,
                ImageSize::new(40, 150),
                "the decoder applied the orientation"
            );
            assert_eq!(
                estimate_tokens(&png, &limits, &processor),
                u64::from(image.tokens)
            );
        }
    }

    #[test]
    fn requests_beyond_the_bound_are_refused_and_counted_until_a_permit_is_dropped() {
        let a = admission(2, 100);
        let first = a.admit().unwrap();
        let _second = a.admit().unwrap();
        assert_eq!(a.admit().unwrap_err(), EngineError::Overloaded);
        assert_eq!(a.stats().rejected_requests, 1);
        drop(first);
        let _third = a.admit().unwrap();
        let stats = a.stats();
        assert_eq!(
            (stats.pending_requests, stats.peak_pending_requests),
            (2, 2)
        );
    }

    #[test]
    fn tokens_beyond_the_bound_are_refused_unless_the_request_is_alone() {
        let a = admission(4, 100);
        let mut big = a.admit().unwrap();
        a.charge(&mut big, 250)
            .expect("alone: admitted whatever its size");
        let mut next = a.admit().unwrap();
        assert_eq!(a.charge(&mut next, 1).unwrap_err(), EngineError::Overloaded);
        drop(big);
        a.charge(&mut next, 60).unwrap();
        let mut third = a.admit().unwrap();
        a.charge(&mut third, 40).unwrap();
        assert_eq!(
            a.charge(&mut third, 1).unwrap_err(),
            EngineError::Overloaded
        );
        assert_eq!(a.stats().pending_tokens, 100);
        drop((next, third));
        let stats = a.stats();
        assert_eq!((stats.pending_requests, stats.pending_tokens), (0, 0));
        assert_eq!(stats.peak_pending_tokens, 250);
    }
}
