//! A driver built the WDK way, in machine code: CR8 reads and writes (wdm.h's x64 KeGetCurrentIrql, KzRaiseIrql,
//! KzLowerIrql) through the real trap path, every register form, against the NT model's IRQL and its verifier; GS
//! reads (KeGetCurrentThread, KeGetPcr, the processor number) against the thread's KPCR. The verdicts are the
//! imports': a spin lock above DISPATCH_LEVEL, IRQL checking's trim of paged pool, the DPCs a lowering runs. The fragments are written
//! into a page installed as the driver image (`driver_fault::install`), so their traps are the driver's. A
//! bugcheck stops the machine, and the image is one per process, so each case runs in a child process (this test
//! binary again, its ignored `child` test), as `async_thunk_rules.rs` does.

mod common;

use std::ffi::c_void;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use common::{routine, NoBus, StopAndExit, STOPPED};
use vhca_loader::driver_symbols::DriverSymbols;
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_loader::processor_block;
use vhca_ntmodel::{HostDmaBackend, NtModel, NtModelConfig, VerifierFlags};
use windows_sys::Wdk::Foundation::KDPC;

const CASE: &str = "VHCA_LOADER_CR8_CASE";
const PAGE: usize = 4096;

/// Machine code in a page of its own, read-execute once written, never unmapped (its routines may be queued).
struct Code {
    base: usize,
    used: usize,
}

impl Code {
    fn new() -> Code {
        // SAFETY: a fresh private anonymous mapping.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        Code { base: base as usize, used: 0 }
    }

    /// Appends a routine; its address.
    fn routine(&mut self, bytes: &[u8]) -> usize {
        let at = self.base + self.used;
        assert!(self.used + bytes.len() <= PAGE);
        // SAFETY: inside the page, still writable (`seal` comes after every routine).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), at as *mut u8, bytes.len()) };
        self.used += bytes.len().div_ceil(16) * 16;
        at
    }

    /// Read-execute from now on, as the loader maps an image's code.
    fn seal(&self) {
        // SAFETY: our own page.
        assert_eq!(unsafe { libc::mprotect(self.base as *mut c_void, PAGE, libc::PROT_READ | libc::PROT_EXEC) }, 0);
    }
}

/// A Windows x64 routine at `address`, typed as F.
fn win64<F: Copy>(address: usize) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<usize>());
    // SAFETY: F is the routine's extern "win64" signature, as the fragment was written for.
    unsafe { std::mem::transmute_copy::<usize, F>(&address) }
}

type IrqlRoutine = unsafe extern "win64" fn(u64) -> u64;
type TwoArguments = unsafe extern "win64" fn(u64, u64) -> u64;

/// `mov cr8, r` then `mov r, cr8` through general register `r` (0 rax ... 15 r15, not rsp), the new IRQL from the
/// first argument (rcx), the IRQL read back returned: each register form the compiler may emit, REX.B included.
fn write_then_read_through(r: u8) -> Vec<u8> {
    let nonvolatile = matches!(r, 3 | 5 | 6 | 7 | 12..=15);
    let (rex_b, low) = (r >> 3, r & 7);
    let mut code = Vec::new();
    if nonvolatile {
        code.extend(if r < 8 { vec![0x50 + low] } else { vec![0x41, 0x50 + low] });
    }
    code.extend([0x48 | rex_b, 0x89, 0xC8 | low]); // mov r, rcx
    code.extend([0x44 | rex_b, 0x0F, 0x22, 0xC0 | low]); // mov cr8, r
    code.extend([0x44 | rex_b, 0x0F, 0x20, 0xC0 | low]); // mov r, cr8
    code.extend([0x48 | (rex_b << 2), 0x89, 0xC0 | (low << 3)]); // mov rax, r
    if nonvolatile {
        code.extend(if r < 8 { vec![0x58 + low] } else { vec![0x41, 0x58 + low] });
    }
    code.push(0xC3);
    code
}

const WRITE_RCX: [u8; 4] = [0x44, 0x0F, 0x22, 0xC1]; // mov cr8, rcx
const READ_RAX: [u8; 4] = [0x44, 0x0F, 0x20, 0xC0]; // mov rax, cr8

/// `mov rax, gs:[offset]; ret` (or a dword / byte read, zero-extended).
fn gs_read(width: u8, offset: u32) -> Vec<u8> {
    let mut code = match width {
        8 => vec![0x65, 0x48, 0x8B, 0x04, 0x25],
        4 => vec![0x65, 0x8B, 0x04, 0x25],
        _ => vec![0x65, 0x0F, 0xB6, 0x04, 0x25],
    };
    code.extend(offset.to_le_bytes());
    code.push(0xC3);
    code
}

fn irql() -> u8 {
    common::shared_kernel::irql()
}

fn install_kernel(verifier: VerifierFlags) {
    let config = NtModelConfig { verifier, ..Default::default() };
    let model = Arc::new(NtModel::new(config, Arc::new(HostDmaBackend::default()), Arc::new(StopAndExit)));
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
}

/// The fragments' page as the driver image.
fn install_image(code: &Code) {
    code.seal();
    vhca_loader::driver_fault::install(code.base, PAGE, "fragment.sys", DriverSymbols::entry_only(0));
}

/// One case, in this (child) process.
fn run_case(case: &str) {
    let mut code = Code::new();
    match case {
        "every-register" => {
            install_kernel(VerifierFlags::IRQL_CHECKING);
            let routines: Vec<(u8, usize)> =
                (0..16u8).filter(|r| *r != 4).map(|r| (r, code.routine(&write_then_read_through(r)))).collect();
            install_image(&code);
            for (r, address) in routines {
                let f: IrqlRoutine = win64(address);
                // SAFETY: the fragment, a raise to DISPATCH_LEVEL then the lower back, as a driver pairs them.
                unsafe {
                    assert_eq!(f(2), 2, "register {r}: the read back");
                    assert_eq!(irql(), 2, "register {r}: the model's IRQL after the write");
                    assert_eq!(f(0), 0, "register {r}");
                    assert_eq!(irql(), 0, "register {r}");
                }
            }
            println!("every register: ok");
        }
        "preserves-state" => {
            install_kernel(VerifierFlags::NONE);
            // movq xmm0, rdx; mov cr8, rcx; movq rax, xmm0; ret
            let xmm = code.routine(
                &[[0x66, 0x48, 0x0F, 0x6E, 0xC2].as_slice(), &WRITE_RCX, &[0x66, 0x48, 0x0F, 0x7E, 0xC0, 0xC3]]
                    .concat(),
            );
            // mov cr8, rcx; mov rax, rdx; ret
            let gpr = code.routine(&[WRITE_RCX.as_slice(), &[0x48, 0x89, 0xD0, 0xC3]].concat());
            // xor eax, eax; stc; mov cr8, rcx; setc al; ret
            let flags = code.routine(&[[0x31, 0xC0, 0xF9].as_slice(), &WRITE_RCX, &[0x0F, 0x92, 0xC0, 0xC3]].concat());
            install_image(&code);
            let marker = 0x1234_5678_9abc_def0;
            // SAFETY: the fragments, each raising to DISPATCH_LEVEL and lowering back.
            unsafe {
                for (name, routine) in [("xmm0", xmm), ("rdx", gpr)] {
                    let f: TwoArguments = win64(routine);
                    assert_eq!(f(2, marker), marker, "{name} across the raise");
                    assert_eq!(f(0, marker), marker, "{name} across the lower");
                }
                let f: TwoArguments = win64(flags);
                assert_eq!((f(2, 0), f(0, 0)), (1, 1), "the carry flag across both");
            }
            println!("state preserved: ok");
        }
        "raise-above-dispatch-then-spin-lock" => {
            install_kernel(VerifierFlags::IRQL_CHECKING);
            let write = code.routine(&[WRITE_RCX.as_slice(), &[0xC3]].concat());
            install_image(&code);
            let f: IrqlRoutine = win64(write);
            let acquire: unsafe extern "win64" fn(*mut u64) -> u8 = routine("KeAcquireSpinLockRaiseToDpc");
            let mut lock = 0u64;
            // SAFETY: the fragment raises to 5 (a DIRQL); the spin lock above DISPATCH_LEVEL is the bug under test.
            unsafe {
                f(5);
                acquire(&mut lock);
            }
        }
        "lower-runs-queued-dpcs" => {
            install_kernel(VerifierFlags::IRQL_CHECKING);
            let write = code.routine(&[WRITE_RCX.as_slice(), &[0xC3]].concat());
            // The DPC routine, in the image: mov rax, cr8; mov [rdx], rax (DeferredContext); ret. Its own trap runs
            // nested in the lowering's trampoline.
            let dpc_routine = code.routine(&[READ_RAX.as_slice(), &[0x48, 0x89, 0x02, 0xC3]].concat());
            install_image(&code);
            let f: IrqlRoutine = win64(write);
            let seen = Box::into_raw(Box::new(0xFFu64));
            // SAFETY: a zeroed KDPC, initialized and queued through the thunks, resident for the process.
            unsafe {
                let dpc = Box::into_raw(Box::new(std::mem::zeroed::<KDPC>()));
                let init: unsafe extern "win64" fn(*mut KDPC, usize, *mut c_void) = routine("KeInitializeDpc");
                let insert: unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void) -> u8 =
                    routine("KeInsertQueueDpc");
                init(dpc, dpc_routine, seen.cast());
                f(2);
                insert(dpc, std::ptr::null_mut(), std::ptr::null_mut());
                assert_eq!(*seen, 0xFF, "queued at DISPATCH_LEVEL: not run yet");
                f(0);
                assert_eq!(*seen, 2, "run by the lowering write, at DISPATCH_LEVEL");
            }
            println!("dpc ran at {}", unsafe { *seen });
        }
        "paged-read-after-cr8-raise" => {
            install_kernel(VerifierFlags::IRQL_CHECKING);
            let write = code.routine(&[WRITE_RCX.as_slice(), &[0xC3]].concat());
            // movzx eax, byte [rcx]; ret: the driver reading its paged pool.
            let read = code.routine(&[0x0F, 0xB6, 0x01, 0xC3]);
            install_image(&code);
            let (f, touch): (IrqlRoutine, IrqlRoutine) = (win64(write), win64(read));
            // A page of its own standing for a paged pool block, as the pool thunk registers one.
            let block = Code::new().base;
            // SAFETY: the page just mapped, read-write.
            unsafe { (block as *mut u8).write(7) };
            kernel().pageable.insert(block, PAGE);
            // SAFETY: the fragments: a raise to DISPATCH_LEVEL trims, a touch at PASSIVE_LEVEL pages the block back
            // in, a touch after the next raise is the bug under test.
            unsafe {
                f(2);
                f(0);
                assert_eq!(touch(block as u64), 7, "paged back in at PASSIVE_LEVEL");
                f(2);
                touch(block as u64);
            }
            println!("no 0xD1 at {block:#x}");
        }
        "rdmsr" | "cli" => {
            install_kernel(VerifierFlags::NONE);
            let bytes: &[u8] = if case == "rdmsr" { &[0x0F, 0x32, 0xC3] } else { &[0xFA, 0xC3] };
            code.routine(&[0x90; 16]); // so the instruction is at RVA 0x10
            let at = code.routine(bytes);
            install_image(&code);
            let f: IrqlRoutine = win64(at);
            // SAFETY: the fragment; its instruction stops the run.
            unsafe { f(0) };
        }
        "outside-the-image" => {
            install_kernel(VerifierFlags::NONE);
            code.routine(&[0xC3]);
            install_image(&code);
            let mut elsewhere = Code::new();
            let write = elsewhere.routine(&[WRITE_RCX.as_slice(), &[0xC3]].concat());
            elsewhere.seal();
            let f: IrqlRoutine = win64(write);
            // SAFETY: a CR8 write in code that is not the driver's: the loader's own crash.
            unsafe { f(2) };
        }
        "bench" => {
            install_kernel(VerifierFlags::NONE);
            // mov cr8, rcx; xor eax, eax; mov cr8, rax; ret: a raise and its lower, as wdm.h inlines them.
            let pair = code.routine(&[WRITE_RCX.as_slice(), &[0x31, 0xC0], &[0x44, 0x0F, 0x22, 0xC0, 0xC3]].concat());
            let read = code.routine(&[READ_RAX.as_slice(), &[0xC3]].concat());
            install_image(&code);
            let by_trap: IrqlRoutine = win64(pair);
            let read_by_trap: IrqlRoutine = win64(read);
            let read_by_import: unsafe extern "win64" fn() -> u8 = routine("KeGetCurrentIrql");
            let raise: unsafe extern "win64" fn(u8) -> u8 = routine("KfRaiseIrql");
            let lower: unsafe extern "win64" fn(u8) = routine("KeLowerIrql");
            let rounds = 20_000u32;
            let time = |f: &dyn Fn()| {
                let started = Instant::now();
                for _ in 0..rounds {
                    f();
                }
                started.elapsed().as_nanos() as f64 / f64::from(rounds)
            };
            // SAFETY: the thunks and the fragment, each a raise to DISPATCH_LEVEL and the lower back.
            let (mut imports, mut traps, mut reads) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..3 {
                reads.push((
                    time(&|| unsafe {
                        read_by_import();
                    }),
                    time(&|| unsafe {
                        read_by_trap(0);
                    }),
                ));
                imports.push(time(&|| unsafe { lower(raise(2)) }));
                traps.push(time(&|| unsafe {
                    by_trap(2);
                }));
            }
            assert_eq!(irql(), 0);
            let best = |v: &[f64]| v.iter().copied().fold(f64::MAX, f64::min);
            let (read_imports, read_traps): (Vec<f64>, Vec<f64>) = reads.into_iter().unzip();
            println!(
                "IRQL read: import {:.0} ns, CR8 trap {:.0} ns (best of 3 x {rounds})",
                best(&read_imports),
                best(&read_traps)
            );
            println!(
                "raise+lower pair: imports {:.0} ns, CR8 traps {:.0} ns (best of 3 x {rounds}; all {imports:.0?} / {traps:.0?})",
                best(&imports),
                best(&traps)
            );
        }
        other => panic!("no case {other}"),
    }
}

/// Not a test of its own: the parent runs it in a child process with the case in the environment.
#[test]
#[ignore]
fn child() {
    run_case(&std::env::var(CASE).expect("run by the tests below, with the case named"));
}

/// The child's exit status (or its signal, negated) and its stdout.
fn run_child(case: &str) -> (i32, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--ignored", "--nocapture", "--test-threads", "1"])
        .env(CASE, case)
        .output()
        .unwrap();
    let status = out.status.code().unwrap_or_else(|| -out.status.signal().unwrap_or(0));
    (status, String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
}

fn stop_line(output: &str) -> String {
    output.lines().find_map(|l| l.find("*** STOP:").map(|at| l[at..].to_string())).unwrap_or_default()
}

#[test]
fn every_register_form_of_mov_cr8_moves_the_models_irql() {
    let (status, out) = run_child("every-register");
    assert_eq!(status, 0, "{out}");
    assert!(out.contains("every register: ok"), "{out}");
}

#[test]
fn a_cr8_write_keeps_the_drivers_registers_vectors_and_flags() {
    let (status, out) = run_child("preserves-state");
    assert_eq!(status, 0, "{out}");
    assert!(out.contains("state preserved: ok"), "{out}");
}

#[test]
fn a_spin_lock_after_a_cr8_raise_above_dispatch_is_c4_42_at_that_irql() {
    let (status, out) = run_child("raise-above-dispatch-then-spin-lock");
    assert_eq!(status, STOPPED, "{out}");
    assert!(stop_line(&out).starts_with("*** STOP: 0x000000C4 (0x0000000000000042,0x0000000000000005,"), "{out}");
}

#[test]
fn paged_pool_touched_after_a_cr8_raise_to_dispatch_is_0xd1_under_irql_checking() {
    let (status, out) = run_child("paged-read-after-cr8-raise");
    assert_eq!(status, STOPPED, "{out}");
    let stop = stop_line(&out);
    assert!(stop.starts_with("*** STOP: 0x000000D1 (0x"), "{out}");
    let params: Vec<&str> = stop["*** STOP: 0x000000D1 (".len()..].trim_end_matches(')').split(',').collect();
    assert_eq!(params[1..3], ["0x0000000000000002", "0x0000000000000000"], "at DISPATCH_LEVEL, a read: {stop}");
}

#[test]
fn a_cr8_lower_below_dispatch_runs_the_queued_dpc_whose_own_cr8_read_traps() {
    let (status, out) = run_child("lower-runs-queued-dpcs");
    assert_eq!(status, 0, "{out}");
    assert!(out.contains("dpc ran at 2"), "{out}");
}

#[test]
fn an_unemulated_privileged_instruction_is_0x7e_naming_it_and_its_rva() {
    for (case, name) in [("rdmsr", "rdmsr"), ("cli", "cli")] {
        let (status, out) = run_child(case);
        assert_eq!(status, STOPPED, "{out}");
        assert!(out.contains(&format!("privileged instruction `{name}` in fragment.sys at RVA 0x10")), "{out}");
        assert!(stop_line(&out).starts_with("*** STOP: 0x0000007E (0x00000000C0000096,"), "{out}");
    }
}

#[test]
fn a_cr8_write_outside_the_image_is_still_the_loaders_own_crash() {
    let (status, out) = run_child("outside-the-image");
    assert_eq!(status, -libc::SIGSEGV, "{out}");
    assert!(!out.contains("*** STOP:"), "{out}");
}

/// The cost of one raise and lower by trap against the imports; prints the figures (docs/bench.md).
#[test]
fn cr8_trap_cost_against_the_imports() {
    let (status, out) = run_child("bench");
    assert_eq!(status, 0, "{out}");
    // The harness prints "test child ... " before the child's first line.
    for figure in ["IRQL read:", "raise+lower pair:"] {
        let line = out.lines().find_map(|l| l.find(figure).map(|at| &l[at..])).unwrap_or_else(|| panic!("{out}"));
        println!("{line}");
    }
}

#[test]
fn gs_reads_give_the_threads_kpcr_kthread_and_processor_number() {
    let mut code = Code::new();
    let read = |code: &mut Code, width, offset| code.routine(&gs_read(width, offset));
    let [self_, prcb, thread, index, legacy] = [
        read(&mut code, 8, 0x18),
        read(&mut code, 8, 0x20),
        read(&mut code, 8, 0x188),
        read(&mut code, 4, 0x1a4),
        read(&mut code, 1, 0x184),
    ];
    code.seal();
    let on_this_thread = move || {
        vhca_loader::driver_fault::prepare_thread();
        let block = processor_block::prepare(0).expect("a processor block");
        let get = |address| {
            let f: unsafe extern "win64" fn() -> u64 = win64(address);
            // SAFETY: the fragment, a GS read.
            unsafe { f() as usize }
        };
        assert_eq!(processor_block::gs_base(), block.kpcr);
        assert_eq!(get(self_), block.kpcr, "KPCR.Self");
        assert_eq!(get(prcb), block.kpcr + 0x180, "KPCR.CurrentPrcb");
        assert_eq!(get(thread), block.kthread, "KeGetCurrentThread");
        assert_eq!((get(index), get(legacy)), (0, 0), "processor 0");
        // Thread locals and the allocator (FS) still work with GS moved.
        thread_local!(static T: std::cell::Cell<u32> = const { std::cell::Cell::new(7) });
        assert_eq!(T.with(|t| t.get()) + vec![1u32; 100].len() as u32, 107);
        block.kthread
    };
    let here = on_this_thread();
    let there = std::thread::spawn(on_this_thread).join().unwrap();
    assert_ne!(here, there, "each thread its own KTHREAD");
}
