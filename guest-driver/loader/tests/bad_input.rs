//! The loader against the real vhca.sys and broken copies of it: each bad image or misbehaving driver ends with a
//! verdict naming its cause (refusal, failed step, STOP line, hang), never a crash. The driver runs in a child
//! process (`vhca-load`), since a fault or bugcheck inside it ends the process as it ends a machine.
//! Without the package these tests fail under CI=true (the test command builds it first) and skip otherwise.

mod common;

use std::process::{Command, Output};

use object::pe;
use object::read::pe::{ImageNtHeaders, PeFile64};
use object::LittleEndian as LE;
use vhca_loader::driver_symbols::DriverSymbols;
use vhca_loader::nt_thunks::NtThunks;
use vhca_loader::{load, ImportResolver, LoadError, PeImage};

use common::vhca_sys_package::{package_dir, vhca_sys};

/// Offsets of the fields the tests break, read by `object` from the pristine image.
struct Layout {
    machine: usize,
    /// Section headers: (VirtualAddress offset, Characteristics offset), in file order.
    sections: Vec<(usize, usize)>,
    reloc_block: usize,
    entry: usize,
}

fn layout(bytes: &[u8]) -> Layout {
    let file = PeFile64::parse(bytes).expect("vhca.sys parses");
    let lfanew = file.dos_header().nt_headers_offset() as usize;
    let headers = file.nt_headers();
    let size_of_optional = headers.file_header().size_of_optional_header.get(LE) as usize;
    let section_table = lfanew + 4 + 20 + size_of_optional;
    let sections = (0..file.section_table().len())
        .map(|i| {
            let at = section_table + i * 40;
            (at + 12, at + 36)
        })
        .collect();
    let reloc_rva =
        file.data_directory(pe::IMAGE_DIRECTORY_ENTRY_BASERELOC).expect("relocations").virtual_address.get(LE);
    let entry_rva = headers.optional_header().address_of_entry_point.get(LE);
    let file_offset = |rva: u32| {
        let (offset, _) = file.section_table().pe_file_range_at(rva).expect("rva in a section");
        offset as usize
    };
    Layout { machine: lfanew + 4, sections, reloc_block: file_offset(reloc_rva), entry: file_offset(entry_rva) }
}

fn put_u32(bytes: &mut [u8], at: usize, v: u32) {
    bytes[at..at + 4].copy_from_slice(&v.to_le_bytes());
}

/// Runs `vhca-load` on `image` (written to a temp dir beside vhca.pdb's copy), with `args`.
fn run(image: &[u8], args: &[&str]) -> (Output, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("vhca.sys");
    std::fs::write(&path, image).expect("write image");
    let pdb = package_dir().join("vhca.pdb");
    let out = Command::new(env!("CARGO_BIN_EXE_vhca-load"))
        .args(args)
        .arg("--pdb")
        .arg(&pdb)
        .arg(&path)
        .output()
        .expect("run vhca-load");
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out, text)
}

#[test]
fn the_real_driver_runs_its_pnp_life() {
    let Some(bytes) = vhca_sys() else { return };
    let (out, text) = run(&bytes, &["--trap-unbound", "--verifier", "0x8"]);
    assert_eq!(out.status.code(), Some(0), "{text}");
    assert!(text.contains("DriverEntry, AddDevice, REMOVE_DEVICE, DriverUnload: ok"), "{text}");
}

#[test]
fn a_truncated_image_is_refused() {
    let Some(bytes) = vhca_sys() else { return };
    for len in [100, 0x400, bytes.len() / 2] {
        let e = PeImage::parse(&bytes[..len]).expect_err("truncated");
        assert!(matches!(e, LoadError::Truncated { .. }), "{len}: {e}");
        assert!(e.to_string().contains("truncated"), "{e}");
    }
}

#[test]
fn a_wrong_machine_is_refused() {
    let Some(mut bytes) = vhca_sys() else { return };
    let at = layout(&bytes).machine;
    bytes[at..at + 2].copy_from_slice(&pe::IMAGE_FILE_MACHINE_ARM64.to_le_bytes());
    let e = PeImage::parse(&bytes).expect_err("ARM64");
    assert!(matches!(e, LoadError::WrongMachine(0xAA64)), "{e}");
    let (out, text) = run(&bytes, &[]);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("refused: wrong machine 0xaa64"), "{text}");
}

#[test]
fn overlapping_sections_are_refused() {
    let Some(mut bytes) = vhca_sys() else { return };
    let l = layout(&bytes);
    // .rdata moved onto the last page of .text.
    let text_rva = u32::from_le_bytes(bytes[l.sections[0].0..][..4].try_into().unwrap());
    put_u32(&mut bytes, l.sections[1].0, text_rva + 0x1000);
    let e = PeImage::parse(&bytes).expect_err("overlap");
    assert!(matches!(&e, LoadError::SectionOverlap { first, second } if first == ".text" && second == ".rdata"), "{e}");
}

#[test]
fn a_writable_code_section_is_refused() {
    let Some(mut bytes) = vhca_sys() else { return };
    let at = layout(&bytes).sections[0].1;
    let c = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    put_u32(&mut bytes, at, c | pe::IMAGE_SCN_MEM_WRITE);
    let e = PeImage::parse(&bytes).expect_err("W+X");
    assert!(matches!(&e, LoadError::WritableAndExecutable(s) if s == ".text"), "{e}");
}

#[test]
fn a_relocation_outside_the_image_is_refused() {
    let Some(mut bytes) = vhca_sys() else { return };
    let l = layout(&bytes);
    let size_of_image = PeImage::parse(&bytes).unwrap().size_of_image;
    // The first block's page moved to the end of the image: its fix-ups land outside.
    put_u32(&mut bytes, l.reloc_block, size_of_image);
    let e = PeImage::parse(&bytes).expect_err("relocation outside");
    assert!(matches!(e, LoadError::RelocationOutsideImage { rva, .. } if rva >= size_of_image), "{e}");
}

#[test]
fn an_import_the_model_lacks_refuses_the_load_naming_it() {
    let Some(mut bytes) = vhca_sys() else { return };
    // The hint/name entry of KeBugCheckEx renamed to a routine no kernel has.
    let at = bytes.windows(13).position(|w| w == b"KeBugCheckEx\0").expect("KeBugCheckEx imported");
    bytes[at..at + 12].copy_from_slice(b"KeBugCheckZz");
    // A kernel that has every routine but that one (addresses only bound, never called: nothing runs).
    struct EveryRoutineButThat;
    impl ImportResolver for EveryRoutineButThat {
        fn resolve(&self, _module: &str, name: &str) -> Option<usize> {
            (name != "KeBugCheckZz").then_some(0x1000)
        }
    }
    let e = load(&bytes, &EveryRoutineButThat).expect_err("refused");
    assert!(
        matches!(&e, LoadError::MissingImport { module, name } if module == "ntoskrnl.exe" && name == "KeBugCheckZz"),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "import ntoskrnl.exe!KeBugCheckZz is not implemented by the NT model: the driver cannot load"
    );
    // The loader binary refuses such an image with that line and its own exit status.
    let (out, text) = run(&bytes, &[]);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(text.contains("VHCA-LOADER: refused: import ntoskrnl.exe!"), "{text}");
    assert!(load(&bytes, &NtThunks).is_err());
}

/// The entry point's first bytes replaced by `code`.
fn with_entry_code(bytes: &[u8], code: &[u8]) -> Vec<u8> {
    let mut bytes = bytes.to_vec();
    let at = layout(&bytes).entry;
    bytes[at..at + code.len()].copy_from_slice(code);
    bytes
}

#[test]
fn driver_entry_failing_ends_the_life_with_its_status() {
    let Some(bytes) = vhca_sys() else { return };
    // mov eax, 0xC0000001 (STATUS_UNSUCCESSFUL); ret
    let bytes = with_entry_code(&bytes, &[0xB8, 0x01, 0x00, 0x00, 0xC0, 0xC3]);
    let (out, text) = run(&bytes, &["--trap-unbound"]);
    assert_eq!(out.status.code(), Some(4), "{text}");
    assert!(text.contains("DriverEntry failed with status 0xc0000001"), "{text}");
}

#[test]
fn add_device_failing_ends_the_life_with_its_status() {
    let Some(bytes) = vhca_sys() else { return };
    let image = PeImage::parse(&bytes).unwrap();
    let symbols = DriverSymbols::load(&package_dir().join("vhca.pdb"), image.entry_rva);
    let rva = symbols.rva_of(|name| name.contains("add_device")).expect("add_device in the PDB");
    let section = image.sections.iter().find(|s| rva >= s.rva && rva < s.rva + s.virtual_size).unwrap();
    let at = (section.file_offset + rva - section.rva) as usize;
    let mut patched = bytes.clone();
    // mov eax, 0xC000000E (STATUS_NO_SUCH_DEVICE); ret
    patched[at..at + 6].copy_from_slice(&[0xB8, 0x0E, 0x00, 0x00, 0xC0, 0xC3]);
    let (out, text) = run(&patched, &["--trap-unbound"]);
    assert_eq!(out.status.code(), Some(4), "{text}");
    assert!(text.contains("AddDevice failed with status 0xc000000e"), "{text}");
}

#[test]
fn a_null_dereference_in_the_driver_is_0x7e_naming_the_rva_and_symbol() {
    let Some(bytes) = vhca_sys() else { return };
    // mov rax, qword ptr [0]
    let bytes = with_entry_code(&bytes, &[0x48, 0x8B, 0x04, 0x25, 0x00, 0x00, 0x00, 0x00]);
    let (out, text) = run(&bytes, &["--trap-unbound"]);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("*** STOP: 0x0000007E (0x00000000C0000005,"), "{text}");
    assert!(text.contains("SYSTEM_THREAD_EXCEPTION_NOT_HANDLED"), "{text}");
    assert!(text.contains("access violation in vhca.sys at RVA 0x1000 (DriverEntry+0x0) touching 0x0"), "{text}");
}

#[test]
fn a_write_to_a_wild_kernel_address_is_0x50() {
    let Some(bytes) = vhca_sys() else { return };
    // mov qword ptr [0xFFFFFFFFDEAD0000], 0 (the disp32 is sign-extended)
    let code = [0x48, 0xC7, 0x04, 0x25, 0x00, 0x00, 0xAD, 0xDE, 0x00, 0x00, 0x00, 0x00];
    let bytes = with_entry_code(&bytes, &code);
    let (out, text) = run(&bytes, &["--trap-unbound"]);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("*** STOP: 0x00000050 (0xFFFFFFFFDEAD0000,0x0000000000000002,"), "{text}");
    assert!(text.contains("PAGE_FAULT_IN_NONPAGED_AREA"), "{text}");
}

#[test]
fn a_driver_that_never_returns_is_a_hang() {
    let Some(bytes) = vhca_sys() else { return };
    // jmp $
    let bytes = with_entry_code(&bytes, &[0xEB, 0xFE]);
    let (out, text) = run(&bytes, &["--trap-unbound", "--timeout", "2"]);
    assert_eq!(out.status.code(), Some(5), "{text}");
    assert!(text.contains("hang: DriverEntry did not return within 2s"), "{text}");
}

/// The first `*** STOP: CODE (...)` line of `text` and its four parameters.
fn stop_params<'a>(text: &'a str, code: &str) -> (&'a str, Vec<u64>) {
    let stop = text.lines().find(|l| l.contains(&format!("*** STOP: {code}"))).unwrap_or_else(|| panic!("{text}"));
    let params = stop[stop.find('(').unwrap() + 1..stop.find(')').unwrap()]
        .split(',')
        .map(|p| u64::from_str_radix(p.trim_start_matches("0x"), 16).unwrap())
        .collect();
    (stop, params)
}

/// `bytes` with the section holding the entry point renamed `name` (8 bytes, NUL-padded, as a section header
/// keeps it).
fn with_entry_section_named(bytes: &[u8], name: &[u8]) -> Vec<u8> {
    let image = PeImage::parse(bytes).unwrap();
    let index = image
        .sections
        .iter()
        .position(|s| image.entry_rva >= s.rva && image.entry_rva < s.rva + s.virtual_size)
        .expect("the entry point's section");
    let header = layout(bytes).sections[index].0 - 12;
    let mut bytes = bytes.to_vec();
    let mut field = [0u8; 8];
    field[..name.len()].copy_from_slice(name);
    bytes[header..header + 8].copy_from_slice(&field);
    bytes
}

/// mov eax, 2; mov cr8, rax (a raise to DISPATCH_LEVEL, as wdm.h's KeRaiseIrql compiles); xor eax, eax;
/// mov cr8, rax (the lower); mov eax, 0xC0000001; ret.
const RAISE_LOWER_FAIL: [u8; 22] = [
    0xB8, 0x02, 0x00, 0x00, 0x00, 0x44, 0x0F, 0x22, 0xC0, 0x31, 0xC0, 0x44, 0x0F, 0x22, 0xC0, 0xB8, 0x01, 0x00, 0x00,
    0xC0, 0xC3, 0x90,
];

#[test]
fn code_in_a_page_section_run_at_dispatch_level_is_0xd1_execute_under_irql_checking() {
    let Some(bytes) = vhca_sys() else { return };
    let entry_rva = PeImage::parse(&bytes).unwrap().entry_rva as u64;
    let paged = with_entry_section_named(&with_entry_code(&bytes, &RAISE_LOWER_FAIL), b"PAGE");
    let (out, text) = run(&paged, &["--trap-unbound", "--verifier", "0x2"]);
    assert!(!out.status.success(), "{text}");
    // The raise trimmed the section; the instruction after it (entry + 9) is fetched at DISPATCH_LEVEL: P1 and P4
    // its address, P2 the IRQL, P3 8 (an execute).
    let (stop, params) = stop_params(&text, "0x000000D1");
    assert_eq!(params[1..3], [2, 8], "{stop}");
    assert_eq!(params[0], params[3], "the address fetched is the referencing instruction: {stop}");
    assert_eq!(params[0] % 0x1000, (entry_rva + 9) % 0x1000, "{stop}");
    // The same image without IRQL checking, and the code's own section name with it: raised, lowered, returned.
    for (image, verifier) in [(&paged, "0x0"), (&with_entry_code(&bytes, &RAISE_LOWER_FAIL), "0x2")] {
        let (out, text) = run(image, &["--trap-unbound", "--verifier", verifier]);
        assert_eq!(out.status.code(), Some(4), "{text}");
        assert!(text.contains("DriverEntry failed with status 0xc0000001"), "{text}");
    }
}

#[test]
fn code_in_an_init_section_called_after_driver_entry_is_0x50_execute() {
    let Some(bytes) = vhca_sys() else { return };
    // The code section renamed INIT: DriverEntry runs from it, and the AddDevice it set lies in it too, so the
    // PnP manager's call after DriverEntry returned jumps into discarded pages. P1 the address, P2 0x10 (an
    // execute), P3 the referencing instruction: the same address.
    let init = with_entry_section_named(&bytes, b"INIT");
    let (out, text) = run(&init, &["--trap-unbound"]);
    assert!(!out.status.success(), "{text}");
    let (stop, params) = stop_params(&text, "0x00000050");
    assert_eq!(params[1], 0x10, "{stop}");
    assert_eq!(params[0], params[2], "{stop}");
    assert!(text.contains("PAGE_FAULT_IN_NONPAGED_AREA"), "{text}");
    // Its own name kept: the same life runs to its end.
    let (out, text) = run(&bytes, &["--trap-unbound"]);
    assert_eq!(out.status.code(), Some(0), "{text}");
}
