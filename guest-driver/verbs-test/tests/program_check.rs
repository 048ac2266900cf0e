//! The built program (ci/build-windows.sh copies it to target/vhca-sys/vhca-verbs-test.exe) checked as Windows'
//! loader would look at it, since it never runs here: a PE32+ AMD64 console image, relocatable and NX, no section
//! both writable and executable, its entry point in code, and exactly the imports the Win32 half calls: nothing
//! from a C runtime DLL, which a clean Windows may not have. Without the program these tests fail under CI=true
//! (the test command builds it first) and skip otherwise.

use std::collections::BTreeSet;

use object::pe;
use object::read::pe::{ImageNtHeaders, ImageOptionalHeader, PeFile64};
use object::{LittleEndian as LE, Object};

// The package's location and the rule for its absence, shared with the loader's tests of vhca.sys.
#[path = "../../loader/tests/common/vhca_sys_package.rs"]
mod vhca_sys_package;

use vhca_sys_package::package_file as built;

/// What the Win32 half calls (src/win32/), by module in lower case; ntdll.dll's are the memory routines the
/// compiler's code may call (runtime.rs), of which the linker keeps those used.
const EXPECTED: [(&str, &str); 20] = [
    ("cfgmgr32.dll", "CM_Get_Device_Interface_ListW"),
    ("cfgmgr32.dll", "CM_Get_Device_Interface_List_SizeW"),
    ("kernel32.dll", "CancelIoEx"),
    ("kernel32.dll", "CloseHandle"),
    ("kernel32.dll", "CreateEventW"),
    ("kernel32.dll", "CreateFileW"),
    ("kernel32.dll", "DeviceIoControl"),
    ("kernel32.dll", "ExitProcess"),
    ("kernel32.dll", "GetCommandLineW"),
    ("kernel32.dll", "GetLastError"),
    ("kernel32.dll", "GetOverlappedResultEx"),
    ("kernel32.dll", "GetProcessHeap"),
    ("kernel32.dll", "GetStdHandle"),
    ("kernel32.dll", "HeapAlloc"),
    ("kernel32.dll", "HeapFree"),
    ("kernel32.dll", "SetEvent"),
    ("kernel32.dll", "Sleep"),
    ("kernel32.dll", "VirtualAlloc"),
    ("kernel32.dll", "WaitForSingleObject"),
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
    let imports: BTreeSet<(String, String)> = match file.imports() {
        Ok(list) => list
            .iter()
            .map(|i| {
                let text = |b: &[u8]| String::from_utf8_lossy(b).to_string();
                (text(i.library()).to_ascii_lowercase(), text(i.name()))
            })
            .collect(),
        Err(e) => {
            problems.push(format!("no readable import table: {e}"));
            BTreeSet::new()
        }
    };
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
