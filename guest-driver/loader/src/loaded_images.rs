//! The images a stack walk may unwind through (sections, .pdata), as Windows' list for RtlLookupFunctionEntry: a
//! table of its own, so the mapping (which leaves it before unmapping) and the walk (which reads it) need not meet.

use std::sync::RwLock;

/// A loaded image a stack walk can unwind through: its name, where it is, and its sections (for reading .pdata,
/// .xdata and code by RVA, only inside a section, so a corrupt table cannot send a read into unmapped slack).
pub(crate) struct LoadedImage {
    pub name: String,
    pub base: usize,
    pub size: usize,
    /// (rva, readable length) of each section.
    pub sections: Vec<(u32, u32)>,
    pub pdata: (u32, u32),
}

static IMAGES: RwLock<Vec<LoadedImage>> = RwLock::new(Vec::new());

/// Adds `image`, replacing one registered at the same base.
pub(crate) fn insert(image: LoadedImage) {
    let mut images = IMAGES.write().unwrap_or_else(|e| e.into_inner());
    images.retain(|i| i.base != image.base);
    images.push(image);
}

/// Forgets the image at `base` (it is being unmapped).
pub(crate) fn remove(base: usize) {
    IMAGES.write().unwrap_or_else(|e| e.into_inner()).retain(|i| i.base != base);
}

/// Runs `f` on the image holding `address`, the table read-locked for as long as `f` runs (so the image cannot be
/// removed, and so unmapped, while `f` reads it); None when no image holds it.
pub(crate) fn with_image_at<T>(address: u64, f: impl FnOnce(&LoadedImage) -> T) -> Option<T> {
    let images = IMAGES.read().unwrap_or_else(|e| e.into_inner());
    images.iter().find(|i| i.contains(address)).map(f)
}

impl LoadedImage {
    pub fn contains(&self, address: u64) -> bool {
        address.checked_sub(self.base as u64).is_some_and(|o| o < self.size as u64)
    }

    /// The mapped bytes from `rva` to the end of its section.
    pub fn at_rva(&self, rva: u32) -> Option<&'static [u8]> {
        let (start, len) = self.sections.iter().copied().find(|(s, len)| rva >= *s && rva - *s < *len)?;
        let bytes = (start + len - rva) as usize;
        // SAFETY: inside one section of the mapping, which is readable (every protection the loader gives a section
        // includes read) and stays mapped while in this table (MappedImage removes it before it unmaps).
        Some(unsafe { std::slice::from_raw_parts((self.base + rva as usize) as *const u8, bytes) })
    }
}
