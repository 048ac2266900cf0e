//! vhca-run's command line: `suite`, `boot`, `qemu-args`. Sets up the session (binaries, image, accelerator, carrier),
//! hands the work to the library and the look to `ui`; exit code 0 only when every run passed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use vhca_run::accel::{self, AccelChoice};
use vhca_run::image::{self, CacheLock};
use vhca_run::paths::{self, Binaries};
use vhca_run::qemu_cmd::{probe_carrier, shell_line};
use vhca_run::run::{plan, Progress, RunContext, RunSpec};
use vhca_run::suite::{self, run_suite, SuiteReport};
use vhca_run::supervise;
use vhca_run::ui;

#[derive(Parser)]
#[command(name = "vhca-run", version, about = "Boots guests against vhca-device under QEMU and gives verdicts")]
struct Cli {
    #[command(flatten)]
    bins: BinArgs,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Args)]
struct BinArgs {
    /// vhca-device binary [env VHCA_DEVICE_BIN; default <target>/release/vhca-device]
    #[arg(long, global = true)]
    device_bin: Option<PathBuf>,
    /// Static vhca-guest binary [env VHCA_GUEST_BIN; default <target>/x86_64-unknown-linux-gnu/release/vhca-guest]
    #[arg(long, global = true)]
    guest_bin: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the built-in suite (the smoke run) and print a verdict table.
    Suite {
        /// Write the full report as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Copy every run's logs to DIR/<run>/.
        #[arg(long)]
        artifacts: Option<PathBuf>,
        /// Hard timeout per run in seconds [default 120 under TCG, 60 under KVM].
        #[arg(long)]
        timeout: Option<u64>,
    },
    /// Boot one guest, show its console, give the verdict.
    Boot {
        #[command(flatten)]
        run: RunArgs,
        /// Start QEMU paused with a gdb stub on :1234 (no timeout).
        #[arg(long)]
        gdb: bool,
        /// Keep the run's work dir (logs, event log) and print where it is.
        #[arg(long)]
        keep: bool,
        /// Copy the run's logs to DIR/<run>/.
        #[arg(long)]
        artifacts: Option<PathBuf>,
        /// Hard timeout in seconds [default 120 under TCG, 60 under KVM].
        #[arg(long)]
        timeout: Option<u64>,
    },
    /// Print the device and QEMU command lines of a run (files under --dir).
    QemuArgs {
        #[command(flatten)]
        run: RunArgs,
        /// Directory the printed command lines put their sockets and logs in.
        #[arg(long, default_value = "/tmp/vhca-run")]
        dir: PathBuf,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Guest scenario (vhca.scenario=...).
    #[arg(long, default_value = "smoke")]
    scenario: String,
    /// Extra kernel command-line word, e.g. vhca.verifier=0x80 or vhca.init=hang (repeatable).
    #[arg(long)]
    append: Vec<String>,
    /// Map registers of the device.
    #[arg(long)]
    map_registers: Option<u32>,
    /// Extra vhca-device argument (repeatable; use --device-arg=--flag for flags).
    #[arg(long, allow_hyphen_values = true)]
    device_arg: Vec<String>,
}

impl RunArgs {
    fn spec(&self, timeout: Duration) -> RunSpec {
        let mut spec = suite::smoke(timeout);
        spec.name = self.scenario.clone();
        spec.scenario = self.scenario.clone();
        spec.append = self.append.clone();
        spec.map_registers = self.map_registers;
        spec.device_args = self.device_arg.clone();
        spec
    }
}

/// Everything `suite`, `boot` and `qemu-args` share.
struct Session {
    ctx: RunContext,
    accel: AccelChoice,
}

fn require(path: &Path, what: &str, hint: &str) -> Result<()> {
    if !path.is_file() {
        bail!("{what} not found at {} ({hint})", path.display());
    }
    Ok(())
}

fn session(bins: &BinArgs) -> Result<Session> {
    let bins = Binaries::resolve(bins.device_bin.clone(), bins.guest_bin.clone());
    require(&bins.device, "vhca-device", "cargo build --release -p vhca-device, or --device-bin / VHCA_DEVICE_BIN")?;
    require(
        &bins.guest,
        "vhca-guest",
        "RUSTFLAGS='-C target-feature=+crt-static' cargo build --release -p vhca-guest --target x86_64-unknown-linux-gnu, \
         or --guest-bin / VHCA_GUEST_BIN",
    )?;
    let cache = paths::cache_dir();
    let _lock = CacheLock::acquire(&cache).context("locking the image cache")?;
    let image = image::ensure(&cache, &bins.guest, &mut |msg| eprintln!("{msg}")).context("guest image")?;
    let accel = accel::choose(&cache, &bins.qemu, &image).context("choosing the accelerator")?;
    let carrier =
        probe_carrier(&bins.qemu).with_context(|| format!("asking {} for its devices", bins.qemu.display()))?;
    let ctx = RunContext { bins, image, accel: accel.accel, carrier, artifacts: None, keep: false, gdb: false };
    Ok(Session { ctx, accel })
}

fn print_report(report: &SuiteReport) {
    let mut out = std::io::stdout().lock();
    let _ = write!(out, "{}", ui::failures(report));
    let _ = write!(out, "{}", ui::table(report));
    let _ = write!(out, "{}", ui::summary(report));
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = supervise::install_interrupt_handler() {
        eprintln!("vhca-run: cannot install the Ctrl-C handler: {e}");
        return ExitCode::from(2);
    }
    match real_main(cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        // Whatever error the interrupt surfaced as, the flag says why the run stopped.
        Err(_) if supervise::interrupted() => {
            eprintln!("vhca-run: interrupted; every child stopped and work dirs removed");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("vhca-run: error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn real_main(cli: Cli) -> Result<bool> {
    match cli.command {
        Cmd::Suite { json, artifacts, timeout } => {
            let mut s = session(&cli.bins)?;
            s.ctx.artifacts = artifacts;
            let timeout = timeout.map(Duration::from_secs).unwrap_or_else(|| suite::default_timeout(s.ctx.accel));
            let specs = suite::builtin(timeout);
            let mut on = |p: Progress| {
                if let Some(line) = ui::progress_line(&p, false) {
                    eprintln!("{line}");
                }
            };
            let report = run_suite(&s.ctx, s.accel, &specs, &mut on)?;
            if let Some(path) = json {
                std::fs::write(&path, ui::json(&report)?).with_context(|| format!("writing {}", path.display()))?;
            }
            print_report(&report);
            Ok(report.all_passed())
        }
        Cmd::Boot { run, gdb, keep, artifacts, timeout } => {
            let mut s = session(&cli.bins)?;
            s.ctx.gdb = gdb;
            s.ctx.keep = keep;
            s.ctx.artifacts = artifacts;
            let timeout = match (gdb, timeout) {
                (true, _) => Duration::ZERO,
                (false, Some(t)) => Duration::from_secs(t),
                (false, None) => suite::default_timeout(s.ctx.accel),
            };
            if gdb {
                eprintln!(
                    "QEMU starts paused with a gdb stub on :1234 (target remote :1234; vmlinux in the image dir)"
                );
            }
            let mut on = |p: Progress| {
                if let Some(line) = ui::progress_line(&p, true) {
                    eprintln!("{line}");
                }
            };
            let report = run_suite(&s.ctx, s.accel, &[run.spec(timeout)], &mut on)?;
            print_report(&report);
            if let Some(dir) = report.runs.first().and_then(|r| r.outcome.artifacts.as_ref()) {
                println!("run files: {}", dir.display());
            }
            Ok(report.all_passed())
        }
        Cmd::QemuArgs { run, dir } => {
            let s = session(&cli.bins)?;
            let spec = run.spec(suite::default_timeout(s.ctx.accel));
            let (device, qemu) = plan(&s.ctx, &spec, &dir);
            let device_args: Vec<std::ffi::OsString> = device.args().into_iter().map(Into::into).collect();
            println!("# accelerator: {} ({})", s.accel.accel.name(), s.accel.how);
            println!("mkdir -p {}", dir.display());
            println!("{}", shell_line(&device.bin, &device_args));
            println!("{}", shell_line(&qemu.qemu, &qemu.args()));
            Ok(true)
        }
    }
}
