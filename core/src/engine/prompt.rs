//! A request's prompt as the scheduler sees it, and the consumer side that turns delivered step
//! chunks back into per-image results.
//!
//! iris has no tokenizer: a request's prompt is its images' placeholders, each framed the way
//! Qwen-VL frames an image, `<|vision_start|> <|image_pad|> x tokens <|vision_end|>`. The two
//! frame tokens are text positions (the language model embeds them; the mask marks them
//! `false`), the pads are the item's embedding positions.

use std::sync::Arc;

use crate::engine::api::{EngineError, HostTensor, ImageResult};
use crate::preprocess::PreprocessedImage;
use crate::scheduler::{MmItem, NewRequest};

/// Text positions around each image: one before (`<|vision_start|>`), one after
/// (`<|vision_end|>`).
pub const FRAME_TOKENS: u64 = 2;

/// Where each image's embeddings sit in the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptLayout {
    /// Prompt length in positions.
    pub prompt_len: u64,
    /// Per image: first embedding position and number of positions.
    pub items: Vec<(u64, u64)>,
}

impl PromptLayout {
    /// The layout of images with these token counts, in order.
    pub fn new(tokens: impl IntoIterator<Item = u64>) -> PromptLayout {
        let mut items = Vec::new();
        let mut at = 0;
        for n in tokens {
            items.push((at + 1, n));
            at += n + FRAME_TOKENS;
        }
        PromptLayout {
            prompt_len: at,
            items,
        }
    }

    /// The scheduler request of these images (hashes from preprocessing).
    pub fn request(&self, images: &[Arc<PreprocessedImage>]) -> NewRequest {
        let items = images
            .iter()
            .zip(&self.items)
            .map(|(image, &(offset, length))| MmItem {
                modality: image.modality,
                ..MmItem::new(image.hash.as_str(), offset, length)
            })
            .collect();
        NewRequest::new(self.prompt_len, items)
    }

    /// The image whose embedding positions contain `position`, and the row within its output.
    pub fn item_at(&self, position: u64) -> Option<(usize, u64)> {
        // Items are few per request; a linear scan beats a search in practice.
        self.items
            .iter()
            .enumerate()
            .find(|(_, (offset, length))| position >= *offset && position < offset + length)
            .map(|(index, (offset, _))| (index, position - offset))
    }

    /// Whether each position of `[start, start + len)` is an embedding position.
    pub fn mask(&self, start: u64, len: u64) -> Vec<bool> {
        (start..start + len)
            .map(|p| self.item_at(p).is_some())
            .collect()
    }
}

/// One step's part of a request, sent by the engine core to the request's consumer.
#[derive(Debug)]
pub struct Chunk {
    /// First prompt position covered.
    pub start: u64,
    /// Per position: whether it holds an image embedding (`true`) or a text position (`false`).
    pub mask: Vec<bool>,
    /// The step's input embeddings of these positions, `mask.len() x hidden`, when the request
    /// asked for embeddings (text rows are zeros).
    pub embeddings: Option<Vec<f32>>,
    /// The same rows of each deepstack level (Qwen3-VL), when asked for.
    pub deepstack: Vec<Vec<f32>>,
}

/// What the engine core sends a request's consumer.
#[derive(Debug)]
pub enum Event {
    /// Positions of one step.
    Chunk(Chunk),
    /// Every position was delivered. Per image: whether this request ran the encoder for it.
    Finished {
        /// Per image, whether its output was computed for this request (a cache miss).
        encoded: Vec<bool>,
    },
    /// The request failed and was released.
    Failed(EngineError),
}

/// Collects a request's chunks into per-image results.
#[derive(Debug)]
pub struct Assembly {
    layout: PromptLayout,
    images: Vec<Arc<PreprocessedImage>>,
    hidden: usize,
    want_embeddings: bool,
    next: u64,
    /// Per image: main embeddings then each deepstack level, rows appended as delivered.
    rows: Vec<Vec<Vec<f32>>>,
}

impl Assembly {
    /// An empty assembly for these images.
    pub fn new(
        layout: PromptLayout,
        images: Vec<Arc<PreprocessedImage>>,
        hidden: usize,
        deepstack_levels: usize,
        want_embeddings: bool,
    ) -> Assembly {
        let parts = if want_embeddings {
            1 + deepstack_levels
        } else {
            0
        };
        let rows = images.iter().map(|_| vec![Vec::new(); parts]).collect();
        Assembly {
            layout,
            images,
            hidden,
            want_embeddings,
            next: 0,
            rows,
        }
    }

    /// Positions delivered so far.
    pub fn delivered(&self) -> u64 {
        self.next
    }

    /// Takes one chunk; chunks must arrive in position order.
    ///
    /// # Errors
    /// [`EngineError::Internal`] when the chunk does not continue the previous one or its shapes
    /// disagree with the layout.
    pub fn push(&mut self, chunk: Chunk) -> Result<(), EngineError> {
        let len = chunk.mask.len() as u64;
        if chunk.start != self.next || chunk.start + len > self.layout.prompt_len {
            return Err(EngineError::Internal(format!(
                "chunk of positions {}..{} does not follow position {} of a {}-position prompt",
                chunk.start,
                chunk.start + len,
                self.next,
                self.layout.prompt_len
            )));
        }
        if chunk.mask != self.layout.mask(chunk.start, len) {
            return Err(EngineError::Internal(format!(
                "chunk mask at position {} disagrees with the prompt layout",
                chunk.start
            )));
        }
        if self.want_embeddings {
            let parts = std::iter::once(chunk.embeddings.as_deref())
                .chain(chunk.deepstack.iter().map(|d| Some(d.as_slice())));
            let expected = self.rows.first().map_or(0, Vec::len);
            if 1 + chunk.deepstack.len() != expected {
                return Err(EngineError::Internal(format!(
                    "chunk has {} deepstack levels, the model {}",
                    chunk.deepstack.len(),
                    expected.saturating_sub(1)
                )));
            }
            for (part, data) in parts.enumerate() {
                let Some(data) = data else {
                    return Err(EngineError::Internal(
                        "chunk without the embeddings the request asked for".to_owned(),
                    ));
                };
                if data.len() != chunk.mask.len() * self.hidden {
                    return Err(EngineError::Internal(format!(
                        "chunk of {} positions carries {} values, expected {} per position",
                        chunk.mask.len(),
                        data.len(),
                        self.hidden
                    )));
                }
                for (i, row) in data.chunks_exact(self.hidden).enumerate() {
                    if let Some((image, _)) = self.layout.item_at(chunk.start + i as u64) {
                        self.rows[image][part].extend_from_slice(row);
                    }
                }
            }
        }
        self.next += len;
        Ok(())
    }

    /// The per-image results once every position was delivered.
    ///
    /// # Errors
    /// [`EngineError::Internal`] when positions are missing.
    pub fn finish(self, encoded: &[bool]) -> Result<Vec<ImageResult>, EngineError> {
        if self.next != self.layout.prompt_len || encoded.len() != self.images.len() {
            return Err(EngineError::Internal(format!(
                "request finished after {} of {} positions",
                self.next, self.layout.prompt_len
            )));
        }
        let hidden = self.hidden as u64;
        let results = self
            .images
            .iter()
            .zip(self.rows)
            .zip(encoded)
            .zip(&self.layout.items)
            .map(|(((image, parts), &encoded), &(_, tokens))| {
                let mut tensors = parts
                    .into_iter()
                    .map(|data| -> HostTensor { (data, [tokens, hidden]) });
                let embeddings = tensors.next();
                ImageResult {
                    mm_hash: image.hash.clone(),
                    grid_thw: image.grid_thw,
                    num_tokens: tokens,
                    cached: !encoded,
                    embeddings,
                    deepstack: tensors.collect(),
                }
            })
            .collect();
        Ok(results)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::preprocess::ImageSize;

    fn image(hash: &str, tokens: u32) -> Arc<PreprocessedImage> {
        Arc::new(PreprocessedImage {
            pixel_values: Vec::new(),
            grid_thw: [1, 2, 2 * tokens],
            original_size: ImageSize::new(1, 1),
            resized_size: ImageSize::new(1, 1),
            tokens,
            hash: hash.to_owned(),
            modality: crate::budget::Modality::Image,
        })
    }

    #[test]
    fn layout_frames_each_image() {
        let layout = PromptLayout::new([3, 2]);
        assert_eq!(layout.prompt_len, 9);
        assert_eq!(layout.items, vec![(1, 3), (6, 2)]);
        assert_eq!(
            layout.mask(0, 9),
            [false, true, true, true, false, false, true, true, false]
        );
        assert_eq!(layout.item_at(7), Some((1, 1)));
        assert_eq!(layout.item_at(4), None);
        let request = layout.request(&[image("a", 3), image("b", 2)]);
        assert_eq!(request.prompt_len, 9);
        assert_eq!(request.items[1].offset, 6);
        assert_eq!(&*request.items[1].hash, "b");
    }

    #[test]
    fn assembly_rebuilds_images_from_chunks_in_any_split() {
        let layout = PromptLayout::new([2, 1]);
        let images = vec![image("a", 2), image("b", 1)];
        // Row value = position, so the result shows which positions landed where.
        let rows = |start: u64, len: u64| -> Vec<f32> {
            (start..start + len)
                .flat_map(|p| [p as f32, -(p as f32)])
                .collect()
        };
        for split in 1..layout.prompt_len {
            let mut a = Assembly::new(layout.clone(), images.clone(), 2, 0, true);
            for (start, len) in [(0, split), (split, layout.prompt_len - split)] {
                a.push(Chunk {
                    start,
                    mask: layout.mask(start, len),
                    embeddings: Some(rows(start, len)),
                    deepstack: Vec::new(),
                })
                .unwrap();
            }
            let results = a.finish(&[true, false]).unwrap();
            assert_eq!(
                results[0].embeddings,
                Some((vec![1.0, -1.0, 2.0, -2.0], [2, 2]))
            );
            assert_eq!(results[1].embeddings, Some((vec![5.0, -5.0], [1, 2])));
            assert!(!results[0].cached && results[1].cached);
        }
    }

    #[test]
    fn assembly_refuses_gaps_and_bad_shapes() {
        let layout = PromptLayout::new([2]);
        let mut a = Assembly::new(layout.clone(), vec![image("a", 2)], 2, 0, true);
        let gap = Chunk {
            start: 1,
            mask: layout.mask(1, 1),
            embeddings: Some(vec![0.0; 2]),
            deepstack: Vec::new(),
        };
        assert!(matches!(a.push(gap), Err(EngineError::Internal(_))));
        let short = Chunk {
            start: 0,
            mask: layout.mask(0, 2),
            embeddings: Some(vec![0.0; 3]),
            deepstack: Vec::new(),
        };
        assert!(matches!(a.push(short), Err(EngineError::Internal(_))));
        let unfinished = Assembly::new(layout, vec![image("a", 2)], 2, 0, false);
        assert!(unfinished.finish(&[true]).is_err());
    }
}
