//! vhca-load: loads a driver image and runs its PnP life in this process, as the guest does with vhca.sys. Prints
//! one `VHCA-LOADER:` line per step; a refusal, a failed step, a bugcheck (the `*** STOP:` line) or a hang ends it
//! with its own exit status, so a test can tell them apart.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use vhca_loader::driver_symbols::DriverSymbols;
use vhca_loader::io_manager::{BusDriver, IoManager};
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_loader::nt_thunks::NtThunks;
use vhca_loader::pnp_life::{run_life, STEP};
use vhca_loader::unbound_import_trap::TrapUnbound;
use vhca_loader::{driver_fault, load};
use vhca_ntmodel::{NtModel, NtModelConfig, PrintAndExit, VerifierFlags};
use windows_sys::Wdk::Foundation::IO_STACK_LOCATION;
use windows_sys::Wdk::System::SystemServices::{IRP_MN_REMOVE_DEVICE, IRP_MN_START_DEVICE};
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_NOT_SUPPORTED, STATUS_SUCCESS};

/// Exit statuses: 0 the life completed; 2 the image was refused; 4 a step of the life failed; 5 hang.
/// (3 is an unbound import called, 0xE6 a bugcheck: the model's PrintAndExit.)
const EXIT_REFUSED: i32 = 2;
const EXIT_STEP_FAILED: i32 = 4;
const EXIT_HANG: i32 = 5;

#[derive(Parser)]
struct Args {
    /// The driver image (vhca.sys).
    image: PathBuf,
    /// Its PDB, for symbol names in fault verdicts (default: the image's path with .pdb).
    #[arg(long)]
    pdb: Option<PathBuf>,
    /// Verifier flags (Windows' values: 0x2 IRQL, 0x8 pool tracking, 0x80 DMA checking).
    #[arg(long, default_value = "0", value_parser = parse_flags)]
    verifier: u32,
    /// Bind imports the model lacks to stubs that end the run naming the routine if called, instead of refusing.
    #[arg(long)]
    trap_unbound: bool,
    /// A step of the life that does not return within this many seconds is a hang.
    #[arg(long, default_value_t = 30)]
    timeout: u64,
}

fn parse_flags(text: &str) -> Result<u32, String> {
    let t = text.trim();
    match t.strip_prefix("0x") {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => t.parse(),
    }
    .map_err(|e| format!("verifier flags {text:?}: {e}"))
}

/// The PCI bus driver below the FDO, with no device behind it: PnP IRPs succeed, config reads find no device.
struct NoDeviceBus;

impl BusDriver for NoDeviceBus {
    fn pnp(&self, stack: &IO_STACK_LOCATION) -> NTSTATUS {
        match stack.MinorFunction as u32 {
            IRP_MN_START_DEVICE | IRP_MN_REMOVE_DEVICE => STATUS_SUCCESS,
            _ => STATUS_NOT_SUPPORTED,
        }
    }
}

fn main() {
    let args = Args::parse();
    let bytes = match std::fs::read(&args.image) {
        Ok(b) => b,
        Err(e) => {
            println!("VHCA-LOADER: refused: cannot read {}: {e}", args.image.display());
            std::process::exit(EXIT_REFUSED);
        }
    };
    let config = NtModelConfig { verifier: VerifierFlags(args.verifier), ..NtModelConfig::default() };
    let backend = Arc::new(vhca_ntmodel::HostDmaBackend::default());
    let model = Arc::new(NtModel::new(config, backend, Arc::new(PrintAndExit)));
    install(LoaderKernel::new(model, IoManager::new(Box::new(NoDeviceBus))));

    let load_started = Instant::now();
    let trap = TrapUnbound::new(NtThunks);
    let mapped = if args.trap_unbound { load(&bytes, &trap) } else { load(&bytes, &NtThunks) };
    let mapped = match mapped {
        Ok(m) => m,
        Err(e) => {
            println!("VHCA-LOADER: refused: {e}");
            std::process::exit(EXIT_REFUSED);
        }
    };
    trap.seal();
    let load_time = load_started.elapsed();
    println!(
        "VHCA-LOADER: mapped {} at {:#x} ({} sections, {} relocations, {} imports, {} unbound)",
        args.image.display(),
        mapped.base(),
        mapped.image.sections.len(),
        mapped.image.relocations.len(),
        mapped.image.imports.len(),
        trap.unbound().len()
    );
    for name in trap.unbound() {
        println!("VHCA-LOADER: unbound import {name}");
    }
    let pdb = args.pdb.unwrap_or_else(|| args.image.with_extension("pdb"));
    let symbols = DriverSymbols::load(&pdb, mapped.image.entry_rva);
    let name = args.image.file_name().map_or("driver".into(), |n| n.to_string_lossy().into_owned());
    driver_fault::install(mapped.base(), mapped.size(), &name, symbols);
    kernel().register_pageable_sections(&mapped);

    let timeout = Duration::from_secs(args.timeout);
    std::thread::spawn(move || {
        std::thread::sleep(timeout);
        let step = *STEP.lock().unwrap_or_else(|e| e.into_inner());
        println!("VHCA-LOADER: hang: {step} did not return within {}s", timeout.as_secs());
        std::process::exit(EXIT_HANG);
    });
    // No device behind this bus: the life stops short of START_DEVICE (the guest starts it on the real device).
    let life_started = Instant::now();
    match run_life(&mapped, false) {
        Ok(()) => {
            println!("VHCA-LOADER: DriverEntry, AddDevice, REMOVE_DEVICE, DriverUnload: ok");
            println!(
                "VHCA-LOADER: load (parse, map, relocate, bind) {} us, life {} us",
                load_time.as_micros(),
                life_started.elapsed().as_micros()
            );
        }
        Err(failure) => {
            println!("VHCA-LOADER: {failure}");
            std::process::exit(EXIT_STEP_FAILED);
        }
    }
}
