//! The built program (ci/build-windows.sh copies it to target/vhca-sys/vhca-verbs-test.exe) checked as Windows'
//! loader would look at it, since it never runs here: a PE32+ AMD64 console image, relocatable and NX, no section
//! both writable and executable, its entry point in code, and exactly the imports the Win32 half calls: nothing
//! from a C runtime DLL, which a clean Windows may not have. Without the program these tests fail under CI=true
//! (the test command builds it first) and skip otherwise.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use object::pe;
use object::read::pe::{ImageNtHeaders, ImageOptionalHeader, PeFile64};
use object::LittleEndian as LE;

fn package_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("VHCA_WINDOWS_DRIVER_DIR") {
        return PathBuf::from(dir);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    target.join("vhca-sys")
}

/// The bytes of `name` in the package, or None (skip) outside CI when it was never built.
fn built(name: &str) -> Option<Vec<u8>> {
    let path = package_dir().join(name);
    match std::fs::read(&path) {
        Ok(bytes) => Some(bytes),
        Err(e) => {
            let why =
                format!("{}: {e}: run ci/build-windows.sh (needs the x86_64-pc-windows-msvc target)", path.display());
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{why}");
            }
            eprintln!("skipped: {why}");
            None
        }
    }
}

/// What the Win32 half calls (src/win32/), by module in lower case; ntdll.dll's are the memory routines the
/// compiler's code may call (runtime.rs), of which the linker keeps those used.
const EXPECTED: [(&str, &str); 14] = [
    ("cfgmgr32.dll", "CM_Get_Device_Interface_ListW"),
    ("cfgmgr32.dll", "CM_Get_Device_Interface_List_SizeW"),
    ("kernel32.dll", "CloseHandle"),
    ("kernel32.dll", "CreateFileW"),
    ("kernel32.dll", "DeviceIoControl"),
    ("kernel32.dll", "ExitProcess"),
    ("kernel32.dll", "GetLastError"),
    ("kernel32.dll", "GetProcessHeap"),
    ("kernel32.dll", "GetStdHandle"),
    ("kernel32.dll", "HeapAlloc"),
    ("kernel32.dll", "HeapFree"),
    ("kernel32.dll", "Sleep"),
    ("kernel32.dll", "VirtualAlloc"),
    ("kernel32.dll", "WriteFile"),
];
const NTDLL_MEMORY_ROUTINES: [&str; 5] = ["memcpy", "memmove", "memset", "memcmp", "strlen"];

/// Every fact a console program built this way must have that is wrong in `image`, in words; empty when all hold.
fn problems(image: &[u8]) -> Vec<String> {
    let mut problems = Vec::new();
    let file = match PeFile64::parse(image) {
        Ok(f) => f,
        Err(e) => return vec![format!("not a PE32+ image: {e}")],
    };
    let nt = file.nt_headers();
    let optional = nt.optional_header();
    if nt.file_header().machine.get(LE) != pe::IMAGE_FILE_MACHINE_AMD64 {
        problems.push(format!("machine {:#x}, not AMD64", nt.file_header().machine.get(LE)));
    }
    if optional.subsystem() != pe::IMAGE_SUBSYSTEM_WINDOWS_CUI {
        problems.push(format!("subsystem {}, not WINDOWS_CUI (a console program)", optional.subsystem()));
    }
    let dll = optional.dll_characteristics();
    for (flag, name) in [
        (pe::IMAGE_DLLCHARACTERISTICS_DYNAMIC_BASE, "DYNAMICBASE"),
        (pe::IMAGE_DLLCHARACTERISTICS_NX_COMPAT, "NX_COMPAT"),
    ] {
        if dll & flag == 0 {
            problems.push(format!("{name} not set"));
        }
    }
    let entry = optional.address_of_entry_point();
    let mut entry_in_code = false;
    for section in file.section_table().iter() {
        let c = section.characteristics.get(LE);
        let name = String::from_utf8_lossy(section.raw_name()).trim_end_matches('\0').to_string();
        if c & pe::IMAGE_SCN_MEM_WRITE != 0 && c & pe::IMAGE_SCN_MEM_EXECUTE != 0 {
            problems.push(format!("section {name} is writable and executable"));
        }
        let (start, size) = (section.virtual_address.get(LE), section.virtual_size.get(LE));
        if c & pe::IMAGE_SCN_MEM_EXECUTE != 0 && (start..start + size).contains(&entry) {
            entry_in_code = true;
        }
    }
    if !entry_in_code {
        problems.push(format!("entry point {entry:#x} is in no executable section"));
    }
    let sections = file.section_table();
    if !matches!(file.data_directories().relocation_blocks(image, &sections), Ok(Some(_))) {
        problems.push("no base relocations".into());
    }
    let mut imports = BTreeSet::new();
    match file.import_table() {
        Ok(Some(table)) => {
            let mut descriptors = table.descriptors().expect("import descriptors");
            while let Ok(Some(d)) = descriptors.next() {
                let module = String::from_utf8_lossy(table.name(d.name.get(LE)).unwrap_or(b"?")).to_ascii_lowercase();
                let mut thunks = table.thunks(d.original_first_thunk.get(LE)).expect("import lookup table");
                while let Ok(Some(thunk)) = thunks.next::<pe::ImageNtHeaders64>() {
                    let routine = match table.import::<pe::ImageNtHeaders64>(thunk) {
                        Ok(object::read::pe::Import::Name(_, name)) => String::from_utf8_lossy(name).to_string(),
                        Ok(object::read::pe::Import::Ordinal(o)) => format!("#{o}"),
                        Err(e) => format!("unreadable import: {e}"),
                    };
                    imports.insert((module.clone(), routine));
                }
            }
        }
        _ => problems.push("no import table".into()),
    }
    let expected: BTreeSet<(String, String)> = EXPECTED.iter().map(|(m, r)| (m.to_string(), r.to_string())).collect();
    for (module, routine) in &imports {
        let memory = module == "ntdll.dll" && NTDLL_MEMORY_ROUTINES.contains(&routine.as_str());
        if !memory && !expected.contains(&(module.clone(), routine.clone())) {
            problems.push(format!("imports {module}!{routine}, which the Win32 half does not call"));
        }
    }
    for (module, routine) in expected.difference(&imports) {
        problems.push(format!("does not import {module}!{routine}"));
    }
    problems
}

#[test]
fn the_program_is_a_console_image_with_only_the_imports_it_calls() {
    let Some(image) = built("vhca-verbs-test.exe") else { return };
    assert_eq!(problems(&image), Vec::<String>::new());
}

#[test]
fn the_check_finds_what_a_console_program_must_not_be() {
    // vhca.sys is a PE32+ AMD64 image too, but a native-subsystem driver importing ntoskrnl.exe: every one of those
    // facts must be named, or the check above proves nothing.
    let Some(driver) = built("vhca.sys") else { return };
    let found = problems(&driver);
    assert!(found.iter().any(|p| p.contains("not WINDOWS_CUI")), "{found:?}");
    assert!(found.iter().any(|p| p.contains("ntoskrnl.exe!")), "{found:?}");
    assert!(found.iter().any(|p| p.contains("does not import kernel32.dll!DeviceIoControl")), "{found:?}");
    assert_eq!(problems(b"MZ not an image"), ["not a PE32+ image: Invalid DOS header size or alignment"]);
}
