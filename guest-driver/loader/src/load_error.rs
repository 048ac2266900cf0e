//! Why a driver image was refused: each reason its own variant, worded so the guest's log line names the cause
//! (the section, the RVA, the import) as Windows' loader would refuse the image.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum LoadError {
    #[error("cannot read the driver image {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("not a PE32+ image: {0}")]
    NotAnImage(String),
    #[error("truncated image: its {what} needs {needed} bytes, the file has {len}")]
    Truncated { what: String, needed: u64, len: usize },
    #[error("wrong machine {0:#06x}: a driver for this kernel is AMD64 (0x8664)")]
    WrongMachine(u16),
    #[error("section {section} at RVA {rva:#x} is not page-aligned after the headers")]
    SectionMisplaced { section: String, rva: u32 },
    #[error("section {section} ({rva:#x}+{size:#x}) lies outside SizeOfImage {size_of_image:#x}")]
    SectionOutsideImage { section: String, rva: u32, size: u32, size_of_image: u32 },
    #[error("section {second} overlaps section {first}")]
    SectionOverlap { first: String, second: String },
    #[error("section {0} is writable and executable (Windows maps driver sections W^X)")]
    WritableAndExecutable(String),
    #[error("entry point RVA {0:#x} is not in a code section")]
    EntryOutsideCode(u32),
    #[error("base relocation at RVA {rva:#x} points outside the image (SizeOfImage {size_of_image:#x})")]
    RelocationOutsideImage { rva: u32, size_of_image: u32 },
    #[error("base relocation of type {kind} at RVA {rva:#x}: an AMD64 image has only DIR64 relocations")]
    UnsupportedRelocation { rva: u32, kind: u16 },
    #[error("malformed {what}: {why}")]
    Malformed { what: &'static str, why: String },
    #[error("imports from {0}: a kernel driver may import only from ntoskrnl.exe and HAL.dll")]
    ForeignModule(String),
    #[error("import {module}!{name} is not implemented by the NT model: the driver cannot load")]
    MissingImport { module: String, name: String },
    #[error("cannot map the image: {0}")]
    Map(std::io::Error),
}
