//! The image in memory: one anonymous mapping of SizeOfImage, headers and sections copied in, DIR64 relocations
//! applied for the address it landed at, every import slot bound, then each section given Windows' protection
//! (headers R, code RX, read-only data R, data RW). The mapping lives as long as the driver may run.

use std::io;

use crate::load_error::LoadError;
use crate::pe_image::{PeImage, Protection, PAGE};

/// Resolves one import to the address of the routine that implements it (an `extern "win64"` thunk).
pub trait ImportResolver {
    fn resolve(&self, module: &str, name: &str) -> Option<usize>;
}

/// A mapped, relocated, bound and protected image.
#[derive(Debug)]
pub struct MappedImage {
    base: *mut u8,
    size: usize,
    pub image: PeImage,
}

// SAFETY: the mapping is plain memory owned by this value; the driver's threads share it as Windows' do.
unsafe impl Send for MappedImage {}
// SAFETY: as above; nothing here mutates the mapping after `map` returns.
unsafe impl Sync for MappedImage {}

impl MappedImage {
    /// Maps `image` (parsed from `bytes`) and binds its imports through `resolver`. An import the resolver lacks
    /// refuses the load naming it, before any driver code could run.
    pub fn map(image: PeImage, bytes: &[u8], resolver: &dyn ImportResolver) -> Result<MappedImage, LoadError> {
        // Every import first: a refusal must not leave a half-bound image behind.
        let mut bound = Vec::with_capacity(image.imports.len());
        for slot in &image.imports {
            match resolver.resolve(&slot.module, &slot.name) {
                Some(address) => bound.push((slot.iat_rva, address as u64)),
                None => return Err(LoadError::MissingImport { module: slot.module.clone(), name: slot.name.clone() }),
            }
        }
        let size = (image.size_of_image as usize).div_ceil(PAGE as usize) * PAGE as usize;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(LoadError::Map(io::Error::last_os_error()));
        }
        let mapped = MappedImage { base: base as *mut u8, size, image };
        // SAFETY: the mapping is `size` bytes, RW, ours alone until `map` returns; every range written below was
        // checked against SizeOfImage (and the file length) by `PeImage::parse`.
        unsafe {
            let image = &mapped.image;
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), mapped.base, image.size_of_headers as usize);
            for s in &image.sections {
                let from = &bytes[s.file_offset as usize..][..s.file_size as usize];
                std::ptr::copy_nonoverlapping(from.as_ptr(), mapped.base.add(s.rva as usize), from.len());
            }
            let delta = (mapped.base as u64).wrapping_sub(image.image_base);
            for &rva in &image.relocations {
                let at = mapped.base.add(rva as usize) as *mut u64;
                at.write_unaligned(at.read_unaligned().wrapping_add(delta));
            }
            for (iat_rva, address) in bound {
                (mapped.base.add(iat_rva as usize) as *mut u64).write_unaligned(address);
            }
        }
        mapped.protect()?;
        Ok(mapped)
    }

    /// Headers read-only, each section as Windows maps it; the slack between sections stays inaccessible.
    fn protect(&self) -> Result<(), LoadError> {
        let protect = |offset: usize, len: usize, prot: libc::c_int| {
            let len = len.div_ceil(PAGE as usize) * PAGE as usize;
            // SAFETY: a page-aligned range inside our own mapping (section RVAs are page-aligned and end within
            // SizeOfImage, rounded up to the mapping's size).
            match unsafe { libc::mprotect(self.base.add(offset) as *mut libc::c_void, len, prot) } {
                0 => Ok(()),
                _ => Err(LoadError::Map(io::Error::last_os_error())),
            }
        };
        protect(0, self.size, libc::PROT_NONE)?;
        protect(0, self.image.size_of_headers as usize, libc::PROT_READ)?;
        for s in &self.image.sections {
            let prot = match s.protection {
                Protection::ReadExecute => libc::PROT_READ | libc::PROT_EXEC,
                Protection::ReadOnly => libc::PROT_READ,
                Protection::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
            };
            protect(s.rva as usize, s.virtual_size.max(1) as usize, prot)?;
        }
        Ok(())
    }

    pub fn base(&self) -> usize {
        self.base as usize
    }

    /// Discards the image's INIT sections, as Windows does once DriverEntry has returned (`#pragma
    /// alloc_text(INIT, DriverEntry)` puts the routines only initialisation runs there): their pages become
    /// inaccessible, so a later touch, or a call into one, faults. The model assumes Windows does not hand the
    /// freed pages to anyone before the touch, so it is 0x50 PAGE_FAULT_IN_NONPAGED_AREA (driver_fault.rs) with
    /// the address, not a read of someone else's data. Returns how many sections went.
    pub fn discard_init_sections(&self) -> usize {
        let init: Vec<_> = self.image.sections.iter().filter(|s| s.name == "INIT").collect();
        for s in &init {
            let len = (s.virtual_size.max(1) as usize).div_ceil(PAGE as usize) * PAGE as usize;
            // SAFETY: a page-aligned section of our own mapping (section RVAs are page-aligned and end within
            // SizeOfImage); nothing of the loader's runs from or reads an INIT section after DriverEntry.
            unsafe { libc::mprotect(self.base.add(s.rva as usize) as *mut libc::c_void, len, libc::PROT_NONE) };
        }
        init.len()
    }

    /// The image's pageable sections, named PAGE... (what `#pragma alloc_text(PAGE, ...)` and `data_seg("PAGE...")`
    /// put code and data in; Windows pages those sections, and Force IRQL checking trims them): each as (process
    /// address, bytes, the protection it has while resident).
    pub fn pageable_sections(&self) -> Vec<(usize, usize, libc::c_int)> {
        self.image
            .sections
            .iter()
            .filter(|s| s.name.starts_with("PAGE"))
            .map(|s| {
                let prot = match s.protection {
                    Protection::ReadExecute => libc::PROT_READ | libc::PROT_EXEC,
                    Protection::ReadOnly => libc::PROT_READ,
                    Protection::ReadWrite => libc::PROT_READ | libc::PROT_WRITE,
                };
                (self.base as usize + s.rva as usize, s.virtual_size.max(1) as usize, prot)
            })
            .collect()
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// The address of `rva` in the mapping.
    pub fn at(&self, rva: u32) -> usize {
        self.base as usize + rva as usize
    }

    /// The RVA of `address` when it lies in the image.
    pub fn rva_of(&self, address: usize) -> Option<u32> {
        address.checked_sub(self.base as usize).filter(|o| *o < self.size).map(|o| o as u32)
    }

    /// The section holding `rva`.
    pub fn section_of(&self, rva: u32) -> Option<&crate::pe_image::Section> {
        self.image.sections.iter().find(|s| rva >= s.rva && rva - s.rva < s.virtual_size.div_ceil(PAGE) * PAGE)
    }
}

impl Drop for MappedImage {
    fn drop(&mut self) {
        // Stack walks read the mapping through the loaded-image table: out of it first, then unmapped.
        crate::loaded_images::remove(self.base as usize);
        // SAFETY: our own mapping, unmapped once; no driver code runs once the image is dropped.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.size) };
    }
}
