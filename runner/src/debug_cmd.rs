//! `vhca-run debug --run NAME`: one run of a suite started paused for a debugger, after printing exactly what to
//! type. Linux guests: QEMU's gdb stub with the guest held at its first instruction (`-S`) until gdb continues it.
//! Windows guests: the image's KDNET settings and WinDbg line plus the EXDI alternative over the gdb stub; the guest
//! starts when the person presses Enter (never tried against Windows here: no image on these machines).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::Args;

use vhca_run::debug_instructions::{linux_gdb_lines, windows_lines};
use vhca_run::qemu_cmd::GdbStub;

use super::{attach_snapshot, load_suite, pick_run, run_one, session, windows_image, BinArgs};

#[derive(Args)]
pub struct DebugArgs {
    /// A concrete run of the suite: `<run>/verifier-<mode>`, or a run name that has one mode.
    #[arg(long)]
    run: String,
    /// The suite file the run comes from [default: the built-in seed suite].
    #[arg(long)]
    suite: Option<PathBuf>,
    /// Port of QEMU's gdb stub (gdb for Linux, EXDI for Windows).
    #[arg(long, default_value_t = 1234)]
    gdb_port: u16,
    /// Only print what to type; start nothing.
    #[arg(long)]
    print_only: bool,
    /// Artifact root [default: ./vhca-artifacts/boot]
    #[arg(long)]
    artifacts: Option<PathBuf>,
}

/// This machine's name as another machine would use it (for the ssh and EXDI lines).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "THIS_HOST".into())
}

pub fn run(bins: &BinArgs, windows_flag: Option<&Path>, args: DebugArgs) -> Result<bool> {
    let (suite, file) = load_suite(args.suite.as_deref())?;
    let run = pick_run(&suite, &args.run)?;
    let windows = windows_image(&suite, file.as_deref(), windows_flag)?;
    if let (Some(image), true) = (&windows, args.print_only) {
        for line in windows_lines(&image.kdnet(), args.gdb_port, &host_name()) {
            println!("{line}");
        }
        return Ok(true);
    }
    let (mut ctx, _) = session(bins).context("debug session")?;
    attach_snapshot(&mut ctx, Some("a debugger attaches to a booting guest"))?;
    ctx.keep = true;
    let lines = match &windows {
        Some(image) => {
            ctx.gdb = Some(GdbStub { port: args.gdb_port, wait: false });
            ctx.paused = true;
            windows_lines(&image.kdnet(), args.gdb_port, &host_name())
        }
        None => {
            ctx.gdb = Some(GdbStub { port: args.gdb_port, wait: true });
            let vmlinux = ctx.image.dir.join("vmlinux");
            let symbols = if vmlinux.is_file() { vmlinux } else { ctx.image.kernel.clone() };
            linux_gdb_lines(&symbols, args.gdb_port, true)
        }
    };
    ctx.windows = windows;
    for line in &lines {
        // stdout when only printing (to paste from), stderr beside the console otherwise.
        if args.print_only {
            println!("{line}");
        } else {
            eprintln!("{line}");
        }
    }
    if args.print_only {
        return Ok(true);
    }
    run_one(&ctx, &run, args.artifacts)
}
