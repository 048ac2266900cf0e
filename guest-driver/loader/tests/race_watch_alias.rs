//! The race watch on machine code, through the real trap path: a watched block in shared memory gets an alias, and
//! the driver's loads, stores, read-modify-writes and compare-exchanges on it run through that alias with the
//! block's own pages never opened; an instruction that also uses its address register as data is stepped with the
//! block open, and the count says so. Registers come back as the driver left them, values land in the block. The
//! fragments are written into a page installed as the driver image (`driver_fault::install`); the image is one per
//! process, so the case runs in a child process (this test binary again, its ignored `child` test).

mod common;

use std::sync::Arc;

use common::{child_of_this_test, routine, NoBus, StopAndExit};
use vhca_loader::driver_symbols::DriverSymbols;
use vhca_loader::io_manager::{BusDriver, IoManager};
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_loader::race_watch::{copied, doorbells, parse_tag, step_counts, RaceWatch, WatchList};
use vhca_loader::windows_sys::Wdk::Foundation::IO_STACK_LOCATION;
use vhca_loader::windows_sys::Win32::Foundation::{NTSTATUS, STATUS_NOT_SUPPORTED};
use vhca_ntmodel::{HostDmaBackend, InterleavingConfig, InterleavingMode, NtModel, NtModelConfig};

const CASE: &str = "VHCA_LOADER_RACE_WATCH_CASE";
const PAGE: usize = 4096;

fn map(shared: bool, prot: i32) -> usize {
    let sharing = if shared { libc::MAP_SHARED } else { libc::MAP_PRIVATE };
    // SAFETY: a fresh anonymous mapping the kernel places.
    let at = unsafe { libc::mmap(std::ptr::null_mut(), PAGE, prot, sharing | libc::MAP_ANONYMOUS, -1, 0) };
    assert_ne!(at, libc::MAP_FAILED);
    at as usize
}

type OneArgument = unsafe extern "win64" fn(u64) -> u64;
type TwoArguments = unsafe extern "win64" fn(u64, u64) -> u64;

fn win64<F: Copy>(address: usize) -> F {
    // SAFETY: F is the fragment's extern "win64" signature.
    unsafe { std::mem::transmute_copy::<usize, F>(&address) }
}

/// A scheduling point on this thread (an IRQL raise and its lower), where blocks watched since the last one close.
fn point() {
    let raise: unsafe extern "win64" fn(u8) -> u8 = routine("KfRaiseIrql");
    let lower: unsafe extern "win64" fn(u8) = routine("KeLowerIrql");
    // SAFETY: a raise to DISPATCH_LEVEL and the lower back, as a driver pairs them.
    unsafe { lower(raise(2)) };
}

/// A bus with one page of "registers" (shared memory standing in for a BAR's mapping), which it maps a second
/// time on request as the guest's VFIO bus maps a BAR region again.
struct OnePageBus(usize);

impl BusDriver for OnePageBus {
    fn pnp(&self, _stack: &IO_STACK_LOCATION) -> NTSTATUS {
        STATUS_NOT_SUPPORTED
    }
    fn map_io_space(&self, _physical: u64, length: usize) -> Option<*mut u8> {
        (length <= PAGE).then_some(self.0 as *mut u8)
    }
    fn alias_io_space(&self, base: *mut u8, length: usize) -> Option<*mut u8> {
        // SAFETY: a second mapping of the shared page, placed by the kernel.
        let alias = unsafe { libc::mremap(base.cast(), 0, length, libc::MREMAP_MAYMOVE) };
        (alias != libc::MAP_FAILED).then_some(alias.cast())
    }
}

/// The fragments' page, written then sealed read-execute and installed as the driver image.
struct Fragments {
    code: usize,
    used: usize,
}

impl Fragments {
    fn new() -> Fragments {
        Fragments { code: map(false, libc::PROT_READ | libc::PROT_WRITE), used: 0 }
    }

    fn routine(&mut self, bytes: &[u8]) -> usize {
        let at = self.code + self.used;
        // SAFETY: inside the code page, still writable.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), at as *mut u8, bytes.len()) };
        self.used += bytes.len().div_ceil(16) * 16;
        at
    }

    fn install(&self) {
        // SAFETY: our own page, read-execute from now as the loader maps an image's code.
        let sealed = unsafe { libc::mprotect(self.code as *mut libc::c_void, PAGE, libc::PROT_READ | libc::PROT_EXEC) };
        assert_eq!(sealed, 0);
        vhca_loader::driver_fault::install(self.code, PAGE, "fragment.sys", DriverSymbols::entry_only(0));
    }
}

fn install_watching(bus: Box<dyn BusDriver>) {
    install_with(bus, RaceWatch::new(WatchList::parse("Test").unwrap()))
}

fn install_with(bus: Box<dyn BusDriver>, watch: RaceWatch) {
    let interleaving = InterleavingConfig { mode: InterleavingMode::Record, ..Default::default() };
    let config = NtModelConfig { interleaving, ..Default::default() };
    let model = Arc::new(NtModel::new(config, Arc::new(HostDmaBackend::default()), Arc::new(StopAndExit)));
    let mut state = LoaderKernel::new(model, IoManager::new(bus));
    state.race_watch = watch;
    assert!(install(state));
}

/// Device registers mapped through MmMapIoSpaceEx while the watch is on: trapped, stepped through the bus's
/// second mapping, the store counted as a doorbell and the load not; unmapped, accessible again.
fn registers_case(doorbells_only: bool) {
    let registers = map(true, libc::PROT_READ | libc::PROT_WRITE);
    let watch = if doorbells_only {
        // As every vhca.sys interleaving run makes it: no pool block listed, the registers trapped all the same.
        RaceWatch::with_doorbells(WatchList::default())
    } else {
        RaceWatch::new(WatchList::parse("Test").unwrap())
    };
    install_with(Box::new(OnePageBus(registers)), watch);
    let mut fragments = Fragments::new();
    let store = fragments.routine(&[0x89, 0x51, 0x04, 0xC3]); // mov [rcx+4], edx; ret
    let load = fragments.routine(&[0x8B, 0x41, 0x04, 0xC3]); // mov eax, [rcx+4]; ret
    fragments.install();
    let map_io: unsafe extern "win64" fn(i64, usize, u32) -> *mut libc::c_void = routine("MmMapIoSpaceEx");
    let unmap_io: unsafe extern "win64" fn(*mut libc::c_void, usize) = routine("MmUnmapIoSpace");
    // SAFETY: the thunks and fragments on the bus's page, as a driver maps and rings its BAR.
    let (read_back, doorbells, counts) = unsafe {
        let at = map_io(0xFE00_0000, 0x100, 0x204);
        assert_eq!(at as usize, registers);
        win64::<TwoArguments>(store)(at as u64, 7);
        let read_back = win64::<OneArgument>(load)(at as u64);
        let seen = (read_back, doorbells(), step_counts());
        unmap_io(at, 0x100);
        seen
    };
    // SAFETY: accessible again after the unmap.
    let stored = unsafe { ((registers + 4) as *const u32).read() };
    let (aliased, opened) = counts;
    println!(
        "registers: read {read_back}, stored {stored}, {doorbells} doorbells, {aliased} through the alias, \
         {opened} opened, {} as copies",
        copied()
    );
}

/// The shared page mapped read-write whose word at +8 is `marker`: the watched block's alias (the block itself is
/// mapped without access while watched), found in /proc/self/maps as the test cannot ask the watch for it.
fn alias_holding(marker: u64) -> Option<usize> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        let (range, perms) = (words.next()?, words.next()?);
        let (from, to) = range.split_once('-')?;
        let (from, to) = (usize::from_str_radix(from, 16).ok()?, usize::from_str_radix(to, 16).ok()?);
        // SAFETY: a readable mapping of this process, one page long, read at an offset inside it.
        (perms == "rw-s" && to - from == PAGE && unsafe { ((from + 8) as *const u64).read_volatile() } == marker)
            .then_some(from)
    })
}

/// A load runs as its copy once; then its block's alias goes away behind the watch's back (as a free on another
/// processor takes it between the hook and the copy), and the same load again faults inside its copy: taken back
/// to the image's instruction, it runs there with the block opened for it and still reads the block.
fn copy_fault_case() {
    install_watching(Box::new(NoBus));
    let mut fragments = Fragments::new();
    // mov rax, [rcx+8]; ret
    let load = fragments.routine(&[0x48, 0x8B, 0x41, 0x08, 0xC3]);
    fragments.install();
    const MARKER: u64 = 0x5EED_C0DE_0000_1234;
    let block = map(true, libc::PROT_READ | libc::PROT_WRITE);
    // SAFETY: the block, still accessible.
    unsafe { ((block + 8) as *mut u64).write(MARKER) };
    kernel().race_watch.insert(block, PAGE, 0x5000_0000, parse_tag("Test").unwrap());
    point();
    // SAFETY: the fragment on the watched block.
    let first = unsafe { win64::<OneArgument>(load)(block as u64) };
    let alias = alias_holding(MARKER).expect("the block's alias in /proc/self/maps");
    // SAFETY: the alias page, which only the watch's copies use; unmapped to stand in for a concurrent free.
    assert_eq!(unsafe { libc::munmap(alias as *mut libc::c_void, PAGE) }, 0);
    // SAFETY: as above; its copy now faults on the unmapped alias.
    let second = unsafe { win64::<OneArgument>(load)(block as u64) };
    let (through_alias, opened) = step_counts();
    println!(
        "copy fault: first {first:#x}, second {second:#x}, {through_alias} through the alias, {opened} opened, {} \
         as copies",
        copied()
    );
}

fn run_case(case: &str) {
    if case == "registers" || case == "doorbells_only" {
        return registers_case(case == "doorbells_only");
    }
    if case == "copy_fault" {
        return copy_fault_case();
    }
    install_watching(Box::new(NoBus));
    // The fragments, Windows x64 routines on rcx (the block) and rdx.
    let mut fragments = Fragments::new();
    let mut routine_of = |bytes: &[u8]| fragments.routine(bytes);
    // mov rax, [rcx+8]; ret
    let load = routine_of(&[0x48, 0x8B, 0x41, 0x08, 0xC3]);
    // mov rax, [rcx+8]; mov rax, rcx; ret
    let load_keeps_rcx = routine_of(&[0x48, 0x8B, 0x41, 0x08, 0x48, 0x89, 0xC8, 0xC3]);
    // mov rax, rcx; mov rax, [rax+8]; ret
    let load_over_base = routine_of(&[0x48, 0x89, 0xC8, 0x48, 0x8B, 0x40, 0x08, 0xC3]);
    // mov [rcx+8], rdx; mov rax, rcx; ret
    let store = routine_of(&[0x48, 0x89, 0x51, 0x08, 0x48, 0x89, 0xC8, 0xC3]);
    // lock inc qword [rcx+8]; mov rax, rcx; ret
    let increment = routine_of(&[0xF0, 0x48, 0xFF, 0x41, 0x08, 0x48, 0x89, 0xC8, 0xC3]);
    // mov rax, [rcx+8]; lock cmpxchg [rcx+8], rdx; ret (rax: what was there)
    let exchange = routine_of(&[0x48, 0x8B, 0x41, 0x08, 0xF0, 0x48, 0x0F, 0xB1, 0x51, 0x08, 0xC3]);
    // mov [rcx+16], rcx; ret
    let store_own_address = routine_of(&[0x48, 0x89, 0x49, 0x10, 0xC3]);
    fragments.install();

    let block = map(case == "shared", libc::PROT_READ | libc::PROT_WRITE);
    // SAFETY: the block, still accessible.
    unsafe { ((block + 8) as *mut u64).write(5) };
    kernel().race_watch.insert(block, PAGE, 0x5000_0000, parse_tag("Test").unwrap());
    point();
    let b = block as u64;
    // SAFETY: the fragments on the watched block, each an access the watch traps.
    unsafe {
        assert_eq!(win64::<OneArgument>(load)(b), 5, "a load");
        assert_eq!(win64::<OneArgument>(load_keeps_rcx)(b), b, "the address register moved back");
        assert_eq!(win64::<OneArgument>(load_over_base)(b), 5, "a load over its own address register");
        assert_eq!(win64::<TwoArguments>(store)(b, 9), b, "a store");
        assert_eq!(win64::<OneArgument>(increment)(b), b, "a locked increment");
        assert_eq!(win64::<TwoArguments>(exchange)(b, 20), 10, "a compare-exchange saw the increment");
    }
    let (through_alias, opened) = step_counts();
    println!("before the open one: {through_alias} through the alias, {opened} opened, {} as copies", copied());
    // SAFETY: the address register stored as data: it must not move.
    unsafe { win64::<OneArgument>(store_own_address)(b) };
    // The loader's own read of the block (not the driver's: decoded, not reported).
    // SAFETY: a watched block, read through the trap path.
    let seen = unsafe { ((block + 8) as *const u64).read_volatile() };
    let (through_alias_after, opened_after) = step_counts();
    kernel().race_watch.remove(block);
    // SAFETY: accessible again after its removal.
    let (value, own_address) = unsafe { (((block + 8) as *const u64).read(), ((block + 16) as *const u64).read()) };
    println!(
        "after: {through_alias_after} through the alias, {opened_after} opened, {} as copies; value {value}, \
         seen {seen}, stored address {own_address:#x} of {block:#x}",
        copied()
    );
}

#[test]
#[ignore]
fn child() {
    run_case(&std::env::var(CASE).expect("run by the tests below, with the case named"));
}

fn run_child(case: &str) -> String {
    let out = child_of_this_test(CASE, case).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    text
}

fn figures(out: &str, line: &str) -> Vec<u64> {
    // The child's harness may print its "test child ..." before the first line.
    let at = out.find(line).unwrap_or_else(|| panic!("no `{line}` in {out}"));
    let line = out[at..].lines().next().unwrap_or_default();
    line.split(|c: char| !c.is_ascii_alphanumeric())
        .filter_map(|w| w.strip_prefix("0x").map_or_else(|| w.parse().ok(), |h| u64::from_str_radix(h, 16).ok()))
        .collect()
}

#[test]
fn in_shared_memory_the_drivers_accesses_run_through_the_alias_and_never_open_the_block() {
    let out = run_child("shared");
    // All but the compare-exchange (a conditional write, stepped) run as copies.
    assert_eq!(figures(&out, "before the open one:"), [7, 0, 6], "{out}");
    let after = figures(&out, "after:");
    assert_eq!(after[..3], [8, 1, 7], "one stepped open, the loader's read a copy: {out}");
    let (value, seen, stored, block) = (after[3], after[4], after[5], after[6]);
    assert_eq!((value, seen), (20, 20), "the exchange's value, in the block and through the trap: {out}");
    assert_eq!(stored, block, "the address register stored unmoved: {out}");
}

#[test]
fn in_private_memory_there_is_no_alias_and_every_access_opens_its_block() {
    let out = run_child("private");
    assert_eq!(figures(&out, "before the open one:"), [0, 7, 0], "{out}");
    let after = figures(&out, "after:");
    assert_eq!(after[..5], [0, 9, 0, 20, 20], "{out}");
    assert_eq!(after[5], after[6], "{out}");
}

#[test]
fn device_registers_mapped_while_watching_trap_their_stores_as_doorbells() {
    let out = run_child("registers");
    assert_eq!(figures(&out, "registers:"), [7, 7, 1, 2, 0, 2], "{out}");
}

#[test]
fn a_fault_inside_a_copy_runs_the_instruction_again_in_the_image_and_it_still_reads_the_block() {
    let out = run_child("copy_fault");
    let figures = figures(&out, "copy fault:");
    assert_eq!(figures[..2], [0x5EED_C0DE_0000_1234, 0x5EED_C0DE_0000_1234], "both loads read the block: {out}");
    // Two hooks, each planned through the alias and run as a copy; the second copy faulted and its instruction
    // stepped in place with the block open.
    assert_eq!(figures[2..], [2, 1, 2], "{out}");
}

#[test]
fn a_watch_made_with_doorbells_traps_the_registers_with_no_pool_block_listed() {
    let out = run_child("doorbells_only");
    assert_eq!(figures(&out, "registers:"), [7, 7, 1, 2, 0, 2], "{out}");
}
