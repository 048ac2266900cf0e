//! The built driver package (ci/build-windows.sh, target/vhca-sys/) checked as Windows would look at
//! it: the PE facts a kernel driver needs (read with the object crate), DriverEntry as the entry point (from the
//! PDB, read with the pdb crate), the signature (osslsigncode), the imports against imports.txt, and the INF.
//! Without the package these tests fail under CI=true (the test command builds it first) and skip otherwise.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

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

/// The package, or None (skip) outside CI when it was never built. Under CI=true a missing package fails.
fn package() -> Option<PathBuf> {
    let dir = package_dir();
    if dir.join("vhca.sys").is_file() {
        return Some(dir);
    }
    let why = format!("no {} : run ci/build-windows.sh (needs the x86_64-pc-windows-msvc target)", dir.display());
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{why}");
    }
    eprintln!("skipped: {why}");
    None
}

fn read(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("{}: {e}", dir.join(name).display()))
}

/// imports.txt: (module in lower case, routine).
fn allowed_imports() -> BTreeSet<(String, String)> {
    include_str!("../imports.txt")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (module, routine) = l.split_once(' ').unwrap_or_else(|| panic!("imports.txt: bad line {l:?}"));
            (module.to_ascii_lowercase(), routine.trim().to_string())
        })
        .collect()
}

/// The PE checksum (the algorithm of imagehlp's CheckSumMappedFile: 16-bit one's-complement-style sum of the file
/// with the CheckSum field taken as zero, plus the file length). Written here because neither object nor
/// goblin computes it.
fn pe_checksum(image: &[u8], checksum_offset: usize) -> u32 {
    let mut sum: u64 = 0;
    for (i, chunk) in image.chunks(2).enumerate() {
        if i * 2 == checksum_offset || i * 2 == checksum_offset + 2 {
            continue;
        }
        let word = u16::from_le_bytes([chunk[0], *chunk.get(1).unwrap_or(&0)]) as u64;
        sum += word;
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum = (sum & 0xffff) + (sum >> 16);
    (sum as u32).wrapping_add(image.len() as u32)
}

/// What the image says about itself.
struct PeFacts {
    entry_rva: u32,
    imports: Vec<(String, String)>,
}

/// Every fact a WDM driver image must have that is wrong in `image`, in words; empty when all hold.
fn pe_problems(image: &[u8], allowed: &BTreeSet<(String, String)>) -> (Vec<String>, Option<PeFacts>) {
    let mut problems = Vec::new();
    let file = match PeFile64::parse(image) {
        Ok(f) => f,
        Err(e) => return (vec![format!("not a PE32+ image: {e}")], None),
    };
    let nt = file.nt_headers();
    let header = nt.file_header();
    let optional = nt.optional_header();
    if header.machine.get(LE) != pe::IMAGE_FILE_MACHINE_AMD64 {
        problems.push(format!("machine {:#x}, not AMD64", header.machine.get(LE)));
    }
    if optional.magic() != pe::IMAGE_NT_OPTIONAL_HDR64_MAGIC {
        problems.push(format!("optional header magic {:#x}, not PE32+", optional.magic()));
    }
    if optional.subsystem() != pe::IMAGE_SUBSYSTEM_NATIVE {
        problems.push(format!("subsystem {}, not NATIVE", optional.subsystem()));
    }
    let dll = optional.dll_characteristics();
    if dll & pe::IMAGE_DLLCHARACTERISTICS_DYNAMIC_BASE == 0 {
        problems.push("DYNAMICBASE not set".into());
    }
    if dll & pe::IMAGE_DLLCHARACTERISTICS_NX_COMPAT == 0 {
        problems.push("NX_COMPAT not set".into());
    }
    if dll & pe::IMAGE_DLLCHARACTERISTICS_WDM_DRIVER == 0 {
        problems.push("WDM_DRIVER not set".into());
    }
    for section in file.section_table().iter() {
        let c = section.characteristics.get(LE);
        if c & pe::IMAGE_SCN_MEM_WRITE != 0 && c & pe::IMAGE_SCN_MEM_EXECUTE != 0 {
            let name = String::from_utf8_lossy(section.raw_name()).trim_end_matches('\0').to_string();
            problems.push(format!("section {name} is writable and executable"));
        }
    }
    let sections = file.section_table();
    let relocations = match file.data_directories().relocation_blocks(image, &sections) {
        Ok(Some(mut blocks)) => {
            let mut count = 0;
            while let Ok(Some(block)) = blocks.next() {
                count += block.count();
            }
            count
        }
        _ => 0,
    };
    if relocations == 0 {
        problems.push("no base relocations".into());
    }
    let checksum_offset = image_checksum_offset(image);
    let stored = optional.check_sum();
    if stored == 0 || stored != pe_checksum(image, checksum_offset) {
        problems.push(format!("checksum {stored:#x}, computed {:#x}", pe_checksum(image, checksum_offset)));
    }
    let mut imports = Vec::new();
    match file.import_table() {
        Ok(Some(table)) => {
            let mut descriptors = table.descriptors().expect("import descriptors");
            while let Ok(Some(d)) = descriptors.next() {
                let module = String::from_utf8_lossy(table.name(d.name.get(LE)).unwrap_or(b"?")).to_string();
                let mut thunks = table.thunks(d.original_first_thunk.get(LE)).expect("import lookup table");
                while let Ok(Some(thunk)) = thunks.next::<pe::ImageNtHeaders64>() {
                    let routine = match table.import::<pe::ImageNtHeaders64>(thunk) {
                        Ok(object::read::pe::Import::Name(_, name)) => String::from_utf8_lossy(name).to_string(),
                        Ok(object::read::pe::Import::Ordinal(o)) => format!("#{o}"),
                        Err(e) => format!("unreadable import: {e}"),
                    };
                    imports.push((module.clone(), routine));
                }
            }
        }
        _ => problems.push("no import table".into()),
    }
    for (module, routine) in &imports {
        let lower = module.to_ascii_lowercase();
        if lower != "ntoskrnl.exe" && lower != "hal.dll" {
            problems.push(format!("imports {module}!{routine}: only ntoskrnl.exe and HAL.dll may be imported"));
        } else if !allowed.contains(&(lower, routine.clone())) {
            problems.push(format!("imports {module}!{routine}, which imports.txt does not list"));
        }
    }
    (problems, Some(PeFacts { entry_rva: optional.address_of_entry_point(), imports }))
}

/// The IRQL routines wdm.h inlines on x64 (KeGetCurrentIrql always; KfRaiseIrql/KeLowerIrql as KzRaiseIrql and
/// KzLowerIrql where the WDK inlines them): vhca.sys moves the IRQL by CR8 and must import none of them.
const INLINE_IRQL_ROUTINES: [&str; 3] = ["KeGetCurrentIrql", "KfRaiseIrql", "KeLowerIrql"];

/// The `mov cr8, r64` (REX with R set, 0F 22, ModRM reg 0) and `mov r64, cr8` (0F 20) instructions in `code`.
fn cr8_moves(code: &[u8]) -> (usize, usize) {
    let (mut writes, mut reads) = (0, 0);
    for w in code.windows(4) {
        if (0x44..=0x4F).contains(&w[0]) && w[0] & 0x4 != 0 && w[1] == 0x0F && (w[3] >> 3) & 7 == 0 {
            match w[2] {
                0x22 => writes += 1,
                0x20 => reads += 1,
                _ => {}
            }
        }
    }
    (writes, reads)
}

/// The bytes of the image's .text section.
fn text_section(image: &[u8]) -> &[u8] {
    let file = PeFile64::parse(image).expect("a PE32+ image");
    let text = file.section_table().iter().find(|s| s.raw_name() == b".text").expect(".text");
    let start = text.pointer_to_raw_data.get(LE) as usize;
    &image[start..start + text.size_of_raw_data.get(LE) as usize]
}

/// What is wrong with the image's IRQL form, in words: an inline routine imported, or code without a CR8 write.
fn irql_form_problems(image: &[u8]) -> Vec<String> {
    let mut problems = Vec::new();
    let (_, facts) = pe_problems(image, &BTreeSet::new());
    for (module, routine) in facts.map(|f| f.imports).unwrap_or_default() {
        if INLINE_IRQL_ROUTINES.contains(&routine.as_str()) {
            problems.push(format!("imports {module}!{routine}, which wdm.h inlines as a CR8 access on x64"));
        }
    }
    if cr8_moves(text_section(image)).0 == 0 {
        problems.push("no CR8 write in .text: the IRQL is not raised and lowered inline".into());
    }
    problems
}

/// File offset of OptionalHeader.CheckSum: e_lfanew + signature (4) + file header (20) + 64.
fn image_checksum_offset(image: &[u8]) -> usize {
    let e_lfanew = u32::from_le_bytes(image[0x3c..0x40].try_into().unwrap()) as usize;
    e_lfanew + 4 + 20 + 64
}

/// DriverEntry's RVA from the PDB's public symbols, and whether the PDB is the image's (GUID and age match).
fn driver_entry_rva(dir: &Path, image: &[u8]) -> u32 {
    let file = PeFile64::parse(image).unwrap();
    let info = object::Object::pdb_info(&file).unwrap().expect("a CodeView record naming the PDB");
    let mut pdb = pdb::PDB::open(std::fs::File::open(dir.join("vhca.pdb")).unwrap()).unwrap();
    let pdb_info = pdb.pdb_information().unwrap();
    assert_eq!(pdb_info.guid.to_bytes_le(), info.guid(), "vhca.pdb is not the PDB of this vhca.sys");
    assert_eq!(std::str::from_utf8(info.path()).unwrap(), "vhca.pdb");
    let address_map = pdb.address_map().unwrap();
    let symbols = pdb.global_symbols().unwrap();
    let mut iter = symbols.iter();
    while let Some(symbol) = pdb::FallibleIterator::next(&mut iter).unwrap() {
        if let Ok(pdb::SymbolData::Public(public)) = symbol.parse() {
            if public.name.to_string() == "DriverEntry" {
                return public.offset.to_rva(&address_map).expect("DriverEntry has an RVA").0;
            }
        }
    }
    panic!("no DriverEntry in vhca.pdb");
}

#[test]
fn vhca_sys_is_a_signed_wdm_driver_entered_at_driver_entry() {
    let Some(dir) = package() else { return };
    let image = read(&dir, "vhca.sys");
    let (problems, facts) = pe_problems(&image, &allowed_imports());
    assert!(problems.is_empty(), "vhca.sys: {problems:#?}");
    let facts = facts.unwrap();
    assert_eq!(facts.entry_rva, driver_entry_rva(&dir, &image), "entry point is not DriverEntry");
    assert!(facts.imports.iter().any(|(m, r)| m == "ntoskrnl.exe" && r == "IoGetDmaAdapter"), "{:?}", facts.imports);
    // The interrupt path is in the image: connected message-based, disconnected and its DPCs flushed at teardown.
    for routine in ["IoConnectInterruptEx", "IoDisconnectInterruptEx", "KeInsertQueueDpc", "KeFlushQueuedDpcs"] {
        assert!(facts.imports.iter().any(|(m, r)| m == "ntoskrnl.exe" && r == routine), "no {routine} import");
    }
    // The IRQL moves inline, by CR8, as wdm.h's x64 routines compile (imports.txt says what stays imported).
    assert_eq!(irql_form_problems(&image), Vec::<String>::new());
    let file = PeFile64::parse(&image[..]).unwrap();
    let security = file.data_directory(pe::IMAGE_DIRECTORY_ENTRY_SECURITY).expect("a security directory");
    assert!(security.size.get(LE) > 0, "no Authenticode signature");
    verify_signature(&dir, "vhca.sys").expect("osslsigncode verifies the signature");
    let (writes, reads) = cr8_moves(text_section(&image));
    println!(
        "vhca.sys: {} bytes, {writes} CR8 writes and {reads} CR8 reads, {} imports: {:?}",
        image.len(),
        facts.imports.len(),
        facts.imports
    );
}

fn verify_signature(dir: &Path, name: &str) -> Result<(), String> {
    let out = Command::new("osslsigncode")
        .arg("verify")
        .arg("-CAfile")
        .arg(dir.join("vhca-test.pem"))
        .arg("-in")
        .arg(dir.join(name))
        .output()
        .map_err(|e| format!("osslsigncode: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
    }
}

/// The checks can fail: each fact broken in a copy of the real image is reported.
#[test]
fn each_broken_fact_is_caught() {
    let Some(dir) = package() else { return };
    let image = read(&dir, "vhca.unsigned.sys");
    let allowed = allowed_imports();
    assert!(pe_problems(&image, &allowed).0.is_empty(), "the unsigned image itself is sound");
    let optional = u32::from_le_bytes(image[0x3c..0x40].try_into().unwrap()) as usize + 4 + 20;

    // DllCharacteristics is the u16 at offset 70 of the PE32+ optional header.
    let mut no_nx = image.clone();
    let flags =
        u16::from_le_bytes([no_nx[optional + 70], no_nx[optional + 71]]) & !pe::IMAGE_DLLCHARACTERISTICS_NX_COMPAT;
    no_nx[optional + 70..optional + 72].copy_from_slice(&flags.to_le_bytes());
    let problems = pe_problems(&no_nx, &allowed).0;
    assert!(problems.iter().any(|p| p.contains("NX_COMPAT")), "{problems:?}");
    assert!(problems.iter().any(|p| p.contains("checksum")), "a changed byte breaks the checksum: {problems:?}");

    let mut user_mode = image.clone();
    // Subsystem: the u16 at offset 68.
    user_mode[optional + 68..optional + 70].copy_from_slice(&pe::IMAGE_SUBSYSTEM_WINDOWS_CUI.to_le_bytes());
    assert!(pe_problems(&user_mode, &allowed).0.iter().any(|p| p.contains("NATIVE")));

    let at = |needle: &[u8]| image.windows(needle.len()).position(|w| w == needle).expect("name in the image");
    let mut ntdll = image.clone();
    let module = at(b"ntoskrnl.exe\0");
    ntdll[module..module + 13].copy_from_slice(b"ntdll.dll\0\0\0\0");
    assert!(pe_problems(&ntdll, &allowed).0.iter().any(|p| p.contains("ntdll.dll!")), "ntdll import caught");

    let mut unlisted = image.clone();
    let routine = at(b"DbgPrintEx\0");
    unlisted[routine..routine + 10].copy_from_slice(b"DbgPrintXx");
    assert!(pe_problems(&unlisted, &allowed).0.iter().any(|p| p.contains("DbgPrintXx, which imports.txt")));

    // The IRQL form: an inline routine imported (KeBugCheckEx renamed in place), and code whose CR8 writes are gone
    // (each turned into a read).
    assert_eq!(irql_form_problems(&image), Vec::<String>::new(), "the unsigned image's IRQL form is sound");
    let mut imported = image.clone();
    let routine = at(b"KeBugCheckEx\0");
    imported[routine..routine + 13].copy_from_slice(b"KfRaiseIrql\0\0");
    let problems = irql_form_problems(&imported);
    assert!(problems.iter().any(|p| p.contains("ntoskrnl.exe!KfRaiseIrql, which wdm.h inlines")), "{problems:?}");
    let mut no_write = image.clone();
    for i in 0..no_write.len() - 3 {
        let w = &no_write[i..i + 4];
        if (0x44..=0x4F).contains(&w[0]) && w[0] & 0x4 != 0 && w[1] == 0x0F && w[2] == 0x22 && (w[3] >> 3) & 7 == 0 {
            no_write[i + 2] = 0x20;
        }
    }
    assert!(irql_form_problems(&no_write).iter().any(|p| p.contains("no CR8 write")));
}

#[test]
fn a_tampered_driver_fails_signature_verification() {
    let Some(dir) = package() else { return };
    let mut image = read(&dir, "vhca.sys");
    let file = PeFile64::parse(&image[..]).unwrap();
    let text =
        file.section_table().iter().find(|s| s.raw_name() == b".text").expect(".text").pointer_to_raw_data.get(LE);
    image[text as usize + 16] ^= 0xff;
    let scratch = tempfile::tempdir().unwrap();
    std::fs::write(scratch.path().join("vhca.sys"), &image).unwrap();
    std::fs::copy(dir.join("vhca-test.pem"), scratch.path().join("vhca-test.pem")).unwrap();
    assert!(verify_signature(scratch.path(), "vhca.sys").is_err(), "a changed code byte must break the signature");
}

#[test]
fn the_inf_installs_both_device_ids_with_dma_remapping() {
    let Some(dir) = package() else { return };
    let inf = String::from_utf8(read(&dir, "vhca.inf")).unwrap();
    for id in ["PCI\\VEN_1AF4&DEV_1059", "PCI\\VEN_1AF4&DEV_106A"] {
        assert!(inf.lines().any(|l| l.contains("vhca_Install") && l.trim_end().ends_with(id)), "{id} missing");
    }
    // Microsoft, "Enabling DMA remapping for device drivers": in the service install section's AddReg.
    let section = inf.split("[vhca_Service_AddReg]").nth(1).expect("service AddReg section");
    let section = section.split("\n[").next().unwrap();
    assert!(section.lines().any(|l| l.trim() == "HKR,Parameters,DmaRemappingCompatible,0x00010001,1"), "{section}");
    assert!(inf.contains("ServiceBinary = %13%\\vhca.sys") && inf.contains("CatalogFile = vhca.cat"));
    assert!(dir.join("vhca-test.cer").is_file() && dir.join("vhca.pdb").is_file());
}

/// The INF's sections by name (INF section names compare without case), each with its lines, comments and blank
/// lines left out.
fn inf_sections(inf: &str) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut sections = std::collections::BTreeMap::new();
    let mut current: Option<String> = None;
    for line in inf.lines() {
        let line = line.split(';').next().unwrap_or("").trim();
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let name = name.trim().to_ascii_lowercase();
            sections.entry(name.clone()).or_insert_with(Vec::new);
            current = Some(name);
        } else if let (Some(name), false) = (&current, line.is_empty()) {
            sections.get_mut(name).expect("section opened").push(line.to_string());
        }
    }
    sections
}

/// What is wrong with the INF's MSI-X opt-in, in words: the hardware section must be the models' DDInstall section
/// decorated as it is installed (its name + .HW), and its AddReg must write MSISupported = 1 and a
/// MessageNumberLimit of one message per virtio interrupt source (config + each queue) under the device's key.
fn msi_problems(inf: &str) -> Vec<String> {
    let sections = inf_sections(inf);
    let mut problems = Vec::new();
    // The models section's lines name the DDInstall section: `%DeviceDesc% = vhca_Install, PCI\...`.
    let models = sections.get("vhca.ntamd64").cloned().unwrap_or_default();
    let Some(install) =
        models.iter().find_map(|l| l.split_once('=')?.1.split(',').next().map(|s| s.trim().to_string()))
    else {
        return vec!["no DDInstall section named by [vhca.NTamd64]".into()];
    };
    // Windows picks the most specific decoration that exists: .NTamd64, else .NT, else none.
    let Some(decorated) = [".ntamd64", ".nt", ""]
        .iter()
        .map(|d| format!("{}{d}", install.to_ascii_lowercase()))
        .find(|name| sections.contains_key(name))
    else {
        return vec![format!("no [{install}.NT] section")];
    };
    let hw = format!("{decorated}.hw");
    let Some(hw_lines) = sections.get(&hw) else {
        problems.push(format!("no [{hw}] section: MSI-X is never enabled"));
        return problems;
    };
    let add_reg: Vec<String> = hw_lines
        .iter()
        .filter_map(|l| l.split_once('=').filter(|(k, _)| k.trim().eq_ignore_ascii_case("AddReg")).map(|(_, v)| v))
        .flat_map(|v| v.split(',').map(|s| s.trim().to_ascii_lowercase()))
        .collect();
    let entries: Vec<String> =
        add_reg.iter().flat_map(|name| sections.get(name).cloned().unwrap_or_default()).collect();
    let key = r"HKR,Interrupt Management\MessageSignaledInterruptProperties";
    let value = |name: &str| {
        entries
            .iter()
            .find_map(|e| e.strip_prefix(&format!("{key},{name},0x00010001,")))
            .map(str::trim)
            .map(String::from)
    };
    if value("MSISupported").as_deref() != Some("1") {
        problems.push(format!("[{hw}]'s AddReg does not set MSISupported to 1 under {key}"));
    }
    // What vhca.sys's routing uses when it gets all it asks for: config plus one per queue (vhca_virtio::MsixPlan).
    let plan = vhca_virtio::MsixPlan::new(u16::MAX, vhca_proto::NUM_QUEUES).expect("a plan for a large table");
    let wanted = u32::from(plan.entries_used());
    match value("MessageNumberLimit").map(|v| v.parse::<u32>()) {
        Some(Ok(n)) if n == wanted => {}
        other => problems.push(format!("MessageNumberLimit {other:?}, not {wanted} (config + each queue)")),
    }
    problems
}

/// The source INF, checked even where the package was never built.
#[test]
fn the_source_inf_enables_msi_x() {
    assert_eq!(msi_problems(include_str!("../vhca.inf")), Vec::<String>::new());
}

#[test]
fn the_inf_enables_msi_x_in_its_ddinstall_hw_section() {
    let Some(dir) = package() else { return };
    let inf = String::from_utf8(read(&dir, "vhca.inf")).unwrap();
    assert_eq!(msi_problems(&inf), Vec::<String>::new());
    assert_eq!(inf, include_str!("../vhca.inf"), "the package's INF is the source's");

    // Each broken form is caught: the HW section under another decoration than the DDInstall section's, a value off.
    let misnamed = inf.replace("[vhca_Install.NT.HW]", "[vhca_Install.HW]");
    assert!(msi_problems(&misnamed).iter().any(|p| p.contains("no [vhca_install.nt.hw] section")), "{misnamed}");
    let off = inf.replace("MSISupported,0x00010001,1", "MSISupported,0x00010001,0");
    assert!(msi_problems(&off).iter().any(|p| p.contains("MSISupported")));
    let one = inf.replace("MessageNumberLimit,0x00010001,5", "MessageNumberLimit,0x00010001,1");
    assert!(msi_problems(&one).iter().any(|p| p.contains("MessageNumberLimit")));
}

/// A public symbol's RVA from vhca.pdb.
fn public_rva(dir: &Path, name: &str) -> Option<u32> {
    let mut pdb = pdb::PDB::open(std::fs::File::open(dir.join("vhca.pdb")).unwrap()).unwrap();
    let address_map = pdb.address_map().unwrap();
    let symbols = pdb.global_symbols().unwrap();
    let mut iter = symbols.iter();
    while let Some(symbol) = pdb::FallibleIterator::next(&mut iter).unwrap() {
        if let Ok(pdb::SymbolData::Public(public)) = symbol.parse() {
            if public.name.to_string() == name {
                return public.offset.to_rva(&address_map).map(|rva| rva.0);
            }
        }
    }
    None
}

/// The RVA of the IAT slot the loader fills for ntoskrnl.exe's `routine`.
fn iat_slot(file: &PeFile64, routine: &str) -> Option<u32> {
    let table = file.import_table().ok()??;
    let mut descriptors = table.descriptors().ok()?;
    while let Some(d) = descriptors.next().ok()? {
        let mut thunks = table.thunks(d.original_first_thunk.get(LE)).ok()?;
        let mut index = 0;
        while let Some(thunk) = thunks.next::<pe::ImageNtHeaders64>().ok()? {
            if let Ok(object::read::pe::Import::Name(_, name)) = table.import::<pe::ImageNtHeaders64>(thunk) {
                if name == routine.as_bytes() {
                    return Some(d.first_thunk.get(LE) + 8 * index);
                }
            }
            index += 1;
        }
    }
    None
}

#[test]
fn the_probe_wrapper_has_an_seh_handler_bound_to_c_specific_handler() {
    let Some(dir) = package() else { return };
    let image = read(&dir, "vhca.sys");
    let file = PeFile64::parse(&image[..]).unwrap();
    let sections = file.section_table();
    let at = |rva: u32| sections.pe_data_at(&image[..], rva).unwrap_or_else(|| panic!("RVA {rva:#x} not in the file"));
    let u32_at = |rva: u32| u32::from_le_bytes(at(rva)[..4].try_into().unwrap());
    let probe = public_rva(&dir, "vhca_probe_and_lock_pages").expect("c/probe.c's wrapper is in vhca.pdb");
    let pdata = file.data_directory(pe::IMAGE_DIRECTORY_ENTRY_EXCEPTION).expect("an exception directory (.pdata)");
    let (pdata_rva, pdata_size) = (pdata.virtual_address.get(LE), pdata.size.get(LE));
    let entry = (0..pdata_size / 12)
        .map(|i| pdata_rva + 12 * i)
        .find(|&e| u32_at(e) == probe)
        .expect("a .pdata entry for the probe wrapper");
    let info = u32_at(entry + 8);
    let header = at(info);
    assert_ne!((header[0] >> 3) & 1, 0, "the wrapper's UNWIND_INFO has UNW_FLAG_EHANDLER");
    let count = u32::from(header[2]);
    let handler_at = info + 4 + 2 * (count + (count & 1));
    let handler = u32_at(handler_at);
    // The handler is the import thunk `jmp [rip + disp]` through __C_specific_handler's IAT slot.
    let code = at(handler);
    assert_eq!(&code[..2], &[0xFF, 0x25], "the handler at {handler:#x} is an import thunk");
    let slot = (handler as i64 + 6 + i32::from_le_bytes(code[2..6].try_into().unwrap()) as i64) as u32;
    assert_eq!(Some(slot), iat_slot(&file, "__C_specific_handler"), "the handler is __C_specific_handler's thunk");
    // Its scope table: a __try whose __except takes every exception (filter 1), inside the function.
    let scopes = u32_at(handler_at + 4);
    let end = u32_at(entry + 4);
    let takes_all = (0..scopes)
        .map(|i| handler_at + 8 + 16 * i)
        .any(|s| u32_at(s + 8) == 1 && (probe..end).contains(&u32_at(s + 12)) && (probe..end).contains(&u32_at(s)));
    assert!(takes_all, "no EXCEPTION_EXECUTE_HANDLER scope in the probe wrapper's table");
}
