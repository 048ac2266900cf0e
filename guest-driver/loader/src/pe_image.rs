//! A driver image read and checked before anything is mapped: the sections with the protection Windows gives them,
//! the DIR64 relocations and the imports, each refused with the reason Windows' loader would have (parsing by
//! `object`; the checks are the loader's own, since no crate says which images a kernel loads).

use object::pe;
use object::read::pe::{ImageNtHeaders, Import, PeFile64};
use object::LittleEndian as LE;

use crate::load_error::LoadError;

/// The modules a kernel driver may import from: the kernel and the HAL (Windows refuses anything else, ntdll.dll
/// included, for a driver).
pub const KERNEL_MODULES: [&str; 2] = ["ntoskrnl.exe", "hal.dll"];

/// What the mapped pages of a section may do. Never writable and executable: Windows maps driver sections W^X
/// (HVCI refuses such an image outright), so the loader refuses one too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protection {
    /// Code: IMAGE_SCN_MEM_EXECUTE.
    ReadExecute,
    /// Read-only data (.rdata, .pdata, .reloc).
    ReadOnly,
    /// Data (.data, .bss).
    ReadWrite,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    pub name: String,
    pub rva: u32,
    pub virtual_size: u32,
    /// The bytes copied from the file: `min(SizeOfRawData, VirtualSize)` from `file_offset`; the rest is zero.
    pub file_offset: u32,
    pub file_size: u32,
    pub protection: Protection,
}

/// One import address table slot: the routine the driver calls through it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportSlot {
    pub module: String,
    pub name: String,
    pub iat_rva: u32,
}

/// A checked image, ready to map.
#[derive(Debug, Clone)]
pub struct PeImage {
    pub image_base: u64,
    pub size_of_image: u32,
    pub size_of_headers: u32,
    pub entry_rva: u32,
    pub sections: Vec<Section>,
    /// RVAs of the IMAGE_REL_BASED_DIR64 fix-ups (8 bytes each, inside the image).
    pub relocations: Vec<u32>,
    pub imports: Vec<ImportSlot>,
    /// The exception directory (.pdata: RUNTIME_FUNCTION entries), RVA and size, when the image has one: what an
    /// x64 stack walk through the image unwinds with (`driver_stack`).
    pub exception_directory: Option<(u32, u32)>,
}

/// Page size the protections are applied with; section RVAs must be page-aligned for that (they are in every image
/// a linker makes with the default /ALIGN of 4 KiB, vhca.sys included).
pub const PAGE: u32 = 4096;

impl PeImage {
    pub fn parse(bytes: &[u8]) -> Result<PeImage, LoadError> {
        let file = PeFile64::parse(bytes).map_err(|e| classify_parse_error(bytes, e))?;
        let nt = file.nt_headers();
        let machine = nt.file_header().machine.get(LE);
        if machine != pe::IMAGE_FILE_MACHINE_AMD64 {
            return Err(LoadError::WrongMachine(machine));
        }
        let optional = nt.optional_header();
        let size_of_image = optional.size_of_image.get(LE);
        let size_of_headers = optional.size_of_headers.get(LE);
        if size_of_headers as usize > bytes.len() || size_of_headers > size_of_image {
            return Err(LoadError::Truncated {
                what: "headers".into(),
                needed: size_of_headers as u64,
                len: bytes.len(),
            });
        }
        let sections = sections(&file, bytes.len(), size_of_image, size_of_headers)?;
        let entry_rva = optional.address_of_entry_point.get(LE);
        if !sections.iter().any(|s| s.protection == Protection::ReadExecute && contains(s, entry_rva)) {
            return Err(LoadError::EntryOutsideCode(entry_rva));
        }
        let relocations = relocations(&file, bytes, size_of_image)?;
        let imports = imports(&file, size_of_image)?;
        let exception_directory = file
            .data_directory(pe::IMAGE_DIRECTORY_ENTRY_EXCEPTION)
            .map(|d| (d.virtual_address.get(LE), d.size.get(LE)))
            .filter(|(rva, size)| *size > 0 && rva.checked_add(*size).is_some_and(|end| end <= size_of_image));
        Ok(PeImage {
            image_base: optional.image_base.get(LE),
            size_of_image,
            size_of_headers,
            entry_rva,
            sections,
            relocations,
            imports,
            exception_directory,
        })
    }
}

fn contains(s: &Section, rva: u32) -> bool {
    rva >= s.rva && rva - s.rva < s.virtual_size
}

/// `object` reports a short file as a generic read error; a file shorter than its own headers is "truncated".
fn classify_parse_error(bytes: &[u8], e: object::Error) -> LoadError {
    // The DOS header (64 bytes), then the NT headers at e_lfanew: the PE signature, the file header (20 bytes)
    // and the PE32+ optional header (240 bytes including its 16 data directories).
    let lfanew = bytes.get(0x3C..0x40).map(|b| u32::from_le_bytes(b.try_into().unwrap()) as u64);
    let needed = lfanew.map_or(64, |o| o + 4 + 20 + 240);
    if bytes.starts_with(b"MZ") && (bytes.len() as u64) < needed {
        LoadError::Truncated { what: "headers".into(), needed, len: bytes.len() }
    } else if bytes.len() >= 0x40 && bytes.starts_with(b"MZ") && machine_at(bytes).is_some_and(|m| m != 0x8664) {
        LoadError::WrongMachine(machine_at(bytes).unwrap_or(0))
    } else {
        LoadError::NotAnImage(e.to_string())
    }
}

/// The file header's Machine field, read without `object` (which refuses a PE32 image before saying its machine).
fn machine_at(bytes: &[u8]) -> Option<u16> {
    let lfanew = u32::from_le_bytes(bytes.get(0x3C..0x40)?.try_into().ok()?) as usize;
    let m = bytes.get(lfanew.checked_add(4)?..lfanew.checked_add(6)?)?;
    Some(u16::from_le_bytes([m[0], m[1]]))
}

fn sections(
    file: &PeFile64<'_>,
    file_len: usize,
    size_of_image: u32,
    size_of_headers: u32,
) -> Result<Vec<Section>, LoadError> {
    let mut out: Vec<Section> = Vec::new();
    for header in file.section_table().iter() {
        let name = String::from_utf8_lossy(header.raw_name()).trim_end_matches('\0').to_string();
        let rva = header.virtual_address.get(LE);
        let virtual_size = header.virtual_size.get(LE);
        let raw_size = header.size_of_raw_data.get(LE);
        let file_offset = header.pointer_to_raw_data.get(LE);
        let characteristics = header.characteristics.get(LE);
        if rva % PAGE != 0 || rva < size_of_headers {
            return Err(LoadError::SectionMisplaced { section: name, rva });
        }
        let end = rva.checked_add(virtual_size).filter(|end| *end <= size_of_image);
        if end.is_none() {
            return Err(LoadError::SectionOutsideImage { section: name, rva, size: virtual_size, size_of_image });
        }
        let file_size = raw_size.min(virtual_size);
        if file_offset as u64 + file_size as u64 > file_len as u64 {
            return Err(LoadError::Truncated {
                what: format!("section {name}"),
                needed: file_offset as u64 + file_size as u64,
                len: file_len,
            });
        }
        let execute = characteristics & pe::IMAGE_SCN_MEM_EXECUTE != 0;
        let write = characteristics & pe::IMAGE_SCN_MEM_WRITE != 0;
        let protection = match (execute, write) {
            (true, true) => return Err(LoadError::WritableAndExecutable(name)),
            (true, false) => Protection::ReadExecute,
            (false, true) => Protection::ReadWrite,
            (false, false) => Protection::ReadOnly,
        };
        let section = Section { name, rva, virtual_size, file_offset, file_size, protection };
        // Whole pages: two sections sharing a page could not each have their own protection.
        let pages = |s: &Section| (s.rva, s.rva + s.virtual_size.div_ceil(PAGE) * PAGE);
        if let Some(other) = out.iter().find(|o| {
            let (a0, a1) = pages(o);
            let (b0, b1) = pages(&section);
            a0 < b1 && b0 < a1
        }) {
            return Err(LoadError::SectionOverlap { first: other.name.clone(), second: section.name });
        }
        out.push(section);
    }
    Ok(out)
}

fn relocations(file: &PeFile64<'_>, bytes: &[u8], size_of_image: u32) -> Result<Vec<u32>, LoadError> {
    let mut out = Vec::new();
    let Some(mut blocks) =
        file.data_directories().relocation_blocks(bytes, &file.section_table()).map_err(bad("relocations"))?
    else {
        return Ok(out);
    };
    while let Some(block) = blocks.next().map_err(bad("relocations"))? {
        for reloc in block {
            match reloc.typ {
                pe::IMAGE_REL_BASED_ABSOLUTE => {}
                pe::IMAGE_REL_BASED_DIR64 => {
                    if reloc.virtual_address.checked_add(8).is_none_or(|end| end > size_of_image) {
                        return Err(LoadError::RelocationOutsideImage { rva: reloc.virtual_address, size_of_image });
                    }
                    out.push(reloc.virtual_address);
                }
                other => return Err(LoadError::UnsupportedRelocation { rva: reloc.virtual_address, kind: other }),
            }
        }
    }
    Ok(out)
}

fn imports(file: &PeFile64<'_>, size_of_image: u32) -> Result<Vec<ImportSlot>, LoadError> {
    let mut out = Vec::new();
    let Some(table) = file.import_table().map_err(bad("imports"))? else {
        return Ok(out);
    };
    let mut descriptors = table.descriptors().map_err(bad("imports"))?;
    while let Some(d) = descriptors.next().map_err(bad("imports"))? {
        let module = String::from_utf8_lossy(table.name(d.name.get(LE)).map_err(bad("imports"))?).into_owned();
        if !KERNEL_MODULES.iter().any(|m| m.eq_ignore_ascii_case(&module)) {
            return Err(LoadError::ForeignModule(module));
        }
        let first_thunk = d.first_thunk.get(LE);
        // The lookup table names the routines; without one (a bound image) the IAT itself does.
        let lookup = match d.original_first_thunk.get(LE) {
            0 => first_thunk,
            rva => rva,
        };
        let mut thunks = table.thunks(lookup).map_err(bad("imports"))?;
        let mut index = 0u32;
        while let Some(thunk) = thunks.next::<pe::ImageNtHeaders64>().map_err(bad("imports"))? {
            let iat_rva = first_thunk + index * 8;
            if iat_rva.checked_add(8).is_none_or(|end| end > size_of_image) {
                return Err(LoadError::Malformed { what: "imports", why: format!("IAT slot at {iat_rva:#x}") });
            }
            let name = match table.import::<pe::ImageNtHeaders64>(thunk).map_err(bad("imports"))? {
                Import::Name(_, name) => String::from_utf8_lossy(name).into_owned(),
                Import::Ordinal(ordinal) => {
                    return Err(LoadError::MissingImport { module, name: format!("#{ordinal} (by ordinal)") })
                }
            };
            out.push(ImportSlot { module: module.clone(), name, iat_rva });
            index += 1;
        }
    }
    Ok(out)
}

fn bad(what: &'static str) -> impl Fn(object::Error) -> LoadError {
    move |e| LoadError::Malformed { what, why: e.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_that_is_not_an_image_says_so() {
        assert!(matches!(PeImage::parse(b"hello"), Err(LoadError::NotAnImage(_))));
        assert!(matches!(PeImage::parse(b"MZ\0\0"), Err(LoadError::Truncated { .. })));
    }
}
