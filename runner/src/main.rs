//! vhca-run's command line: `suite`, `boot`, `qemu-args`, `bench`, `report merge`. Sets up the session (binaries, image, accelerator,
//! carrier, snapshot), picks the runs, hands the work to the library and the look to `ui`; exit code 0 only when every
//! run passed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use vhca_suite::{render_junit, render_table, ConcreteRun, InterleavingsScope, Personality, Shard, Suite, SuiteReport};

use vhca_run::accel::{self, AccelChoice};
use vhca_run::bench;
use vhca_run::debug_instructions::linux_gdb_lines;
use vhca_run::image::{self, CacheLock};
use vhca_run::paths::{self, Binaries};
use vhca_run::qemu_cmd::{probe_carrier, GdbStub};
use vhca_run::run_context::RunContext;
use vhca_run::run_plan::{command_lines, plan};
use vhca_run::snapshot;
use vhca_run::soak;
use vhca_run::suite_run::{run_suite, SuiteOptions};
use vhca_run::supervise;
use vhca_run::ui::SuiteUi;
use vhca_run::windows_guest::image_dir::WindowsImage;

mod debug_cmd;
mod windows_image_cmd;

#[derive(Parser)]
#[command(name = "vhca-run", version, about = "Boots guests against vhca-device under QEMU and gives verdicts")]
struct Cli {
    #[command(flatten)]
    bins: BinArgs,
    /// Boot every run cold instead of restoring the saved guest (the snapshot path is the default).
    #[arg(long, global = true)]
    cold: bool,
    /// Restore a fresh guest from the snapshot for every run. By default a restored guest whose run left it clean
    /// (no crash, no IOMMU fault logged, its HCA ejected) serves its worker's next run, in a fresh process.
    #[arg(long, global = true)]
    restore_per_run: bool,
    /// The Windows image directory (`vhca-run windows-image build --out DIR`) for a suite with `guest = "windows"`;
    /// overrides the suite's `windows_image`.
    #[arg(long, global = true)]
    windows_image: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Args)]
struct BinArgs {
    /// vhca-device binary [env VHCA_DEVICE_BIN; default: next to vhca-run, else on PATH, else <target>/release]
    #[arg(long, global = true)]
    device_bin: Option<PathBuf>,
    /// Static vhca-guest binary [env VHCA_GUEST_BIN; default: next to vhca-run, else on PATH, else
    /// <target>/x86_64-unknown-linux-gnu/release]
    #[arg(long, global = true)]
    guest_bin: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a suite (the built-in seed suite unless FILE is given): result table, JSON and JUnit reports, artifacts.
    Suite {
        /// Suite file (TOML, docs/suites.md) [default: the built-in seed suite]
        file: Option<PathBuf>,
        /// Runs at a time [default: number of cores]
        #[arg(short = 'j', long)]
        jobs: Option<usize>,
        /// Only the concrete runs whose name (`<run>/verifier-<mode>`) this regex matches.
        #[arg(long)]
        filter: Option<String>,
        /// Artifact root: per-run folders, report.json, junit.xml [default: ./vhca-artifacts/<suite>]
        #[arg(long)]
        artifacts: Option<PathBuf>,
        /// Also write the JSON report here.
        #[arg(long)]
        json: Option<PathBuf>,
        /// Also write the JUnit XML report here.
        #[arg(long)]
        junit: Option<PathBuf>,
        /// Print the concrete runs (after --filter) and exit without running them.
        #[arg(long)]
        list: bool,
        /// Run every scenario with this driver: `native` (the driver core in the guest program) or `sys` (the
        /// signed vhca.sys through the guest's PE loader) [default: each run's `driver`, else native]
        #[arg(long, value_parser = parse_driver)]
        driver: Option<Personality>,
        /// Run only shard I of N (1-based): a deterministic share of the runs, balanced by the durations in
        /// --durations; `vhca-run report merge` combines the shards' reports (docs/suites.md, "Sharding").
        #[arg(long, value_name = "I/N")]
        shard: Option<Shard>,
        /// A previous JSON report whose run times balance the shards [default: the artifact root's report.json,
        /// if there is one; else every run counts the same]
        #[arg(long, requires = "shard")]
        durations: Option<PathBuf>,
        /// Which runs expand into interleaving runs: `entries` (those whose entry sets `interleavings`), `all`
        /// (every run, preempt1 where its entry names no plan: the sweep over every scenario) or `off`
        /// [default: entries]
        #[arg(long, value_parser = parse_interleavings_scope, default_value = "entries")]
        interleavings: InterleavingsScope,
    },
    /// Work with reports: `merge` combines shards' reports into one.
    Report {
        #[command(subcommand)]
        action: ReportCmd,
    },
    /// Boot one run interactively: its console on stderr, then its verdict.
    Boot {
        #[command(flatten)]
        pick: RunPick,
        /// Give QEMU a gdb stub (-gdb tcp::PORT); turns the timeout and silence limit off.
        #[arg(long)]
        gdb: bool,
        /// Port of the gdb stub.
        #[arg(long, default_value_t = 1234)]
        gdb_port: u16,
        /// Start the guest paused (-S) until gdb continues it. Implies --gdb.
        #[arg(long)]
        gdb_wait: bool,
        /// Keep the run's work dir (sockets, logs, event log) and print where it is.
        #[arg(long)]
        keep: bool,
        /// Artifact root [default: ./vhca-artifacts/boot]
        #[arg(long)]
        artifacts: Option<PathBuf>,
    },
    /// Time a suite (the seed suite by default) from the snapshot and cold in one session; print a Markdown table.
    Bench {
        /// Suite file [default: the built-in seed suite]
        file: Option<PathBuf>,
        /// Parallelism to measure, comma-separated.
        #[arg(short = 'j', long, value_delimiter = ',', default_values_t = [1, 2])]
        jobs: Vec<usize>,
        /// Only the concrete runs whose name this regex matches.
        #[arg(long)]
        filter: Option<String>,
        /// Instead: time one QUERY_DEVICE round trip in the guest against one read from QEMU's virtio-rng.
        #[arg(long)]
        roundtrip: bool,
        /// Samples of each kind for --roundtrip.
        #[arg(long, default_value_t = 10_000, requires = "roundtrip")]
        samples: usize,
        /// Instead: the suite from the snapshot with each --completion mode in turn, alternated --rounds times at
        /// each -j; per-run median and wall of each mode, and their ratios to the first.
        #[arg(long, conflicts_with = "roundtrip")]
        alternate_completion: bool,
        /// The `vhca.completion` modes, in order: one guest each for --roundtrip, one suite run each per round for
        /// --alternate-completion. Always passed to the guest, over its default and a suite entry's own `completion`
        /// (an entry that needs interrupts then fails its polling runs: leave it out with --filter).
        #[arg(long, value_delimiter = ',', default_values_t = ["poll".to_string(), "interrupt".to_string()])]
        completion: Vec<String>,
        /// Rounds of --alternate-completion.
        #[arg(long, default_value_t = 2, requires = "alternate_completion")]
        rounds: usize,
    },
    /// N back-to-back runs mixing passes, bugchecks, a device fault, a hang and a guest panic; the runner's memory
    /// and fds after each run, one line per run; fails on a wrong verdict, a leak or growth (docs/fuzz.md).
    Soak {
        /// Number of runs.
        #[arg(short = 'n', long, default_value_t = 200)]
        runs: usize,
        /// Artifact root [default: ./vhca-artifacts/soak]
        #[arg(long)]
        artifacts: Option<PathBuf>,
        /// Also write the samples and the judgement as JSON here.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Start one run paused for a debugger and print exactly what to type (gdb; for Windows KDNET/WinDbg and EXDI).
    Debug(debug_cmd::DebugArgs),
    /// Build a Windows image from your own ISO and the driver package, or add a boot state to one.
    #[command(subcommand)]
    WindowsImage(windows_image_cmd::WindowsImageCmd),
    /// Print the exact vhca-device and QEMU command lines of one run, cold-boot form (its files under --dir).
    QemuArgs {
        #[command(flatten)]
        pick: RunPick,
        /// Directory the printed command lines put their sockets and logs in.
        #[arg(long, default_value = "/tmp/vhca-run")]
        dir: PathBuf,
    },
}

#[derive(Subcommand)]
enum ReportCmd {
    /// Combine the shards' report.json and junit.xml (each SHARD_DIR is a `suite --shard` artifact root) into one
    /// report.json and junit.xml in --out; exit status 0 only if every run of every shard passed.
    Merge {
        /// Where the merged report.json and junit.xml go.
        #[arg(long)]
        out: PathBuf,
        /// The shards' artifact roots.
        #[arg(required = true)]
        shard_dirs: Vec<PathBuf>,
    },
}

/// One run: a concrete run of a suite (`--run`), or one described by flags.
#[derive(Args)]
struct RunPick {
    /// A concrete run of the suite: `<run>/verifier-<mode>`, or a run name that has one mode.
    #[arg(long, conflicts_with_all = ["scenario", "lock", "verifier", "map_registers", "inject", "param", "expect"])]
    run: Option<String>,
    /// The suite file --run picks from [default: the built-in seed suite].
    #[arg(long, requires = "run")]
    suite: Option<PathBuf>,
    /// Fail only the low-resources simulation's failure point K of --run (1-based, as its recording numbered
    /// them): the reproducer of one run of an `each_fail_point` expansion.
    #[arg(long, requires = "run", value_parser = clap::value_parser!(u32).range(1..))]
    fail_point: Option<u32>,
    /// Run under one interleaving schedule, as the guest's vhca.interleave takes it: `record`,
    /// `preempt:<thread>#<k>[,<thread>#<k>]` or `pct:<seed>[:<depth>]`; with --run, the reproducer of one run of
    /// an `interleavings` expansion.
    #[arg(long, conflicts_with = "fail_point")]
    interleaving: Option<String>,
    /// The global points a `pct:` schedule draws its change points among (vhca.pct_horizon) [default: the guest's,
    /// 2000]; a PCT run of an `interleavings` expansion takes its recording's count, and its reproducer says it.
    #[arg(long, requires = "interleaving", value_parser = clap::value_parser!(u32).range(1..))]
    pct_horizon: Option<u32>,
    /// Run it with this driver: `native` or `sys`, as `suite --driver` does [default: the run's own]; a failed
    /// vhca.sys run's reproducer says `--driver sys`, which names the same run whether the suite file or the
    /// suite's `--driver` made it a vhca.sys run.
    #[arg(long, value_parser = parse_driver)]
    driver: Option<Personality>,
    /// The NT model's processors and the guest's vCPUs (1 to 64) [default: the run's, else 2 in the model]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    processors: Option<u32>,
    /// Guest scenario (vhca.scenario) [default: smoke]
    #[arg(long)]
    scenario: Option<String>,
    /// Lock the control path holds: fast_mutex, kmutex, eresource (vhca.lock).
    #[arg(long)]
    lock: Option<String>,
    /// Driver Verifier flags, e.g. 0xAA [default: off]
    #[arg(long)]
    verifier: Option<String>,
    /// vhca-device --map-registers N.
    #[arg(long)]
    map_registers: Option<u32>,
    /// vhca-device --inject KEY=VALUE (repeatable).
    #[arg(long)]
    inject: Vec<String>,
    /// Guest setting vhca.KEY=VALUE (repeatable), e.g. --param init=hang, --param disable_rule=0xC4.
    #[arg(long)]
    param: Vec<String>,
    /// Expected verdict: pass, bugcheck CODE [PARAM1], device-fault CAUSE, guest-panic, hang [default: pass]
    #[arg(long)]
    expect: Option<String>,
    /// Hard timeout in seconds [default: the suite's, 60]
    #[arg(long)]
    timeout: Option<u32>,
    /// Seconds without serial output that count as a hang [default: the suite's, 30]
    #[arg(long)]
    silence: Option<u32>,
}

impl RunPick {
    /// Commands that only boot the Linux guest refuse a run picked from a Windows suite, saying `why`.
    fn refuse_windows(&self, why: &str) -> Result<()> {
        if self.run.is_some() && load_suite(self.suite.as_deref())?.0.guest == vhca_suite::GuestKind::Windows {
            bail!("{why}");
        }
        Ok(())
    }

    /// The one concrete run these flags describe, validated as a suite file would be.
    fn concrete(&self) -> Result<(ConcreteRun, Option<String>)> {
        let (mut run, file) = match &self.run {
            Some(name) => {
                let (mut suite, file) = load_suite(self.suite.as_deref())?;
                if let Some(driver) = self.driver {
                    suite.set_driver(driver);
                }
                let run = pick_run(&suite, name)?;
                match self.fail_point {
                    Some(k) => (run.at_fail_point(k), file),
                    None => (run, file),
                }
            }
            None => (self.ad_hoc()?, None),
        };
        if let Some(spec) = &self.interleaving {
            run = run.with_interleaving(spec).map_err(|e| anyhow::anyhow!("--interleaving: {e}"))?;
            run.interleaving.pct_horizon = self.pct_horizon;
        }
        if let Some(t) = self.timeout {
            run.guest.timeout_s = t;
        }
        if let Some(n) = self.processors {
            run.interleaving.processors = Some(n);
        }
        if let Some(s) = self.silence {
            run.guest.silence_s = s;
        }
        Ok((run, file))
    }

    /// Writes the flags as a one-run suite file and parses it, so flags get exactly a suite file's checks.
    fn ad_hoc(&self) -> Result<ConcreteRun> {
        let scenario = self.scenario.clone().unwrap_or_else(|| "smoke".into());
        vhca_run::known_scenarios::check_name(&scenario, "--scenario").map_err(anyhow::Error::msg)?;
        let mut run = toml::Table::new();
        run.insert("name".into(), scenario.clone().into());
        let on = self.verifier.as_deref().is_some_and(|v| !matches!(v.trim(), "0" | "0x0" | "off"));
        run.insert("modes".into(), toml::Value::Array(vec![(if on { "on" } else { "off" }).into()]));
        if on {
            run.insert("verifier_flags".into(), self.verifier.clone().unwrap_or_default().into());
        }
        run.insert("expect".into(), self.expect.clone().unwrap_or_else(|| "pass".into()).into());
        let mut device = toml::Table::new();
        if let Some(n) = self.map_registers {
            device.insert("map_registers".into(), i64::from(n).into());
        }
        if !self.inject.is_empty() {
            device.insert("inject".into(), self.inject.clone().into());
        }
        run.insert("device".into(), device.into());
        let mut guest = toml::Table::new();
        guest.insert("scenario".into(), scenario.into());
        if let Some(lock) = &self.lock {
            guest.insert("lock".into(), lock.clone().into());
        }
        let mut extra = toml::Table::new();
        for kv in &self.param {
            let Some((k, v)) = kv.split_once('=') else { bail!("--param {kv}: expected KEY=VALUE") };
            extra.insert(k.trim_start_matches("vhca.").to_string(), v.into());
        }
        guest.insert("extra".into(), extra.into());
        run.insert("guest".into(), guest.into());
        let mut doc = toml::Table::new();
        doc.insert("name".into(), "boot".into());
        doc.insert("run".into(), toml::Value::Array(vec![run.into()]));
        let text = toml::to_string(&doc).context("writing the run as TOML")?;
        let mut suite =
            Suite::parse(&text, "<command line>").map_err(|e| anyhow::anyhow!("{e}\n(the run as TOML:\n{text})"))?;
        if let Some(driver) = self.driver {
            suite.set_driver(driver);
        }
        suite.expand().into_iter().next().context("the command line describes no run")
    }
}

/// The suite from FILE, or the built-in seed suite; with the file's path for reproducers.
fn load_suite(file: Option<&Path>) -> Result<(Suite, Option<String>)> {
    match file {
        None => Ok((Suite::seed().map_err(|e| anyhow::anyhow!("{e}"))?, None)),
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let suite = Suite::parse(&text, &path.display().to_string()).map_err(|e| anyhow::anyhow!("{e}"))?;
            // Before anything boots: a misspelt scenario would cost a guest per run to find out.
            vhca_run::known_scenarios::check_suite(&suite).map_err(anyhow::Error::msg)?;
            let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
            Ok((suite, Some(abs.display().to_string())))
        }
    }
}

/// The Windows image a suite's runs boot: `--windows-image`, else the suite's `windows_image` (relative to the suite
/// file). None for a Linux suite. A Windows suite without a usable image is an error, never a skip.
fn windows_image(suite: &Suite, suite_file: Option<&str>, flag: Option<&Path>) -> Result<Option<Arc<WindowsImage>>> {
    if suite.guest != vhca_suite::GuestKind::Windows {
        if let Some(f) = flag {
            bail!(
                "--windows-image {}: suite {:?} runs the Linux guest (no `guest = \"windows\"`)",
                f.display(),
                suite.name
            );
        }
        return Ok(None);
    }
    let dir = match (flag, &suite.windows_image) {
        (Some(f), _) => f.to_path_buf(),
        (None, Some(p)) => {
            let base = suite_file.and_then(|f| Path::new(f).parent()).unwrap_or(Path::new("."));
            base.join(p)
        }
        (None, None) => bail!(
            "suite {:?} runs Windows guests (guest = \"windows\") but names no image: pass --windows-image DIR or set \
             windows_image in the suite. Build an image from your own Windows ISO with `vhca-run windows-image build` \
             (docs/windows.md); this rig ships none",
            suite.name
        ),
    };
    let image = WindowsImage::open(&dir).with_context(|| format!("suite {:?}", suite.name))?;
    Ok(Some(Arc::new(image)))
}

fn pick_run(suite: &Suite, name: &str) -> Result<ConcreteRun> {
    let runs = suite.expand();
    if let Some(r) = runs.iter().find(|r| r.name == name) {
        return Ok(r.clone());
    }
    let same: Vec<&ConcreteRun> = runs.iter().filter(|r| r.run == name).collect();
    match same.as_slice() {
        [one] => Ok((*one).clone()),
        [] => bail!("suite {:?} has no run {name:?}", suite.name),
        many => bail!(
            "run {name:?} has several modes; name one: {}",
            many.iter().map(|r| r.name.as_str()).collect::<Vec<_>>().join(", ")
        ),
    }
}

fn require(path: &Path, program: &paths::Program, install: &str) -> Result<()> {
    if !path.is_file() {
        let looked = paths::search_order(program);
        bail!("{} not found at {} ({looked}; install it with {install})", program.name, path.display());
    }
    Ok(())
}

/// The Linux guest image of `bins.guest`, from the cache (locked by the caller) or built now.
fn guest_image(bins: &Binaries, cache: &Path) -> Result<image::Image> {
    require(
        &bins.guest,
        &paths::GUEST,
        "RUSTFLAGS='-C target-feature=+crt-static' cargo install --path guest-driver/guest --target x86_64-unknown-linux-gnu",
    )?;
    image::ensure(cache, &bins.guest, &mut |msg| eprintln!("{msg}")).context("guest image")
}

/// The accelerator for a command that starts a guest without a session of its own (`windows-image`): the same
/// probe as every other, building the Linux guest image to probe with only when no probe of this boot is cached.
fn probed_accel(bins: &BinArgs) -> Result<AccelChoice> {
    let bins = Binaries::resolve(bins.device_bin.clone(), bins.guest_bin.clone());
    let cache = paths::cache_dir();
    let _lock = CacheLock::acquire(&cache).context("locking the image cache")?;
    let mut image = || guest_image(&bins, &cache).map_err(|e| format!("{e:#}"));
    accel::choose(&cache, &bins.qemu, &mut image).context("choosing the accelerator")
}

/// Binaries, image, accelerator and carrier: what every run of this invocation shares.
fn session(bins: &BinArgs) -> Result<(RunContext, AccelChoice)> {
    let bins = Binaries::resolve(bins.device_bin.clone(), bins.guest_bin.clone());
    require(&bins.device, &paths::DEVICE, "cargo install --path device")?;
    let cache = paths::cache_dir();
    let _lock = CacheLock::acquire(&cache).context("locking the image cache")?;
    let image = guest_image(&bins, &cache)?;
    let accel = accel::choose(&cache, &bins.qemu, &mut || Ok(image.clone())).context("choosing the accelerator")?;
    let carrier =
        probe_carrier(&bins.qemu).with_context(|| format!("asking {} for its devices", bins.qemu.display()))?;
    eprintln!(
        "vhca-run: accelerator {} ({}); carrier {}; kernel {} ({:?}); image {}{}",
        accel.accel.name(),
        accel.how,
        carrier.device_name(),
        image.kernel_package,
        image.kernel_kind,
        image.key,
        if image.built { " (built now)" } else { "" },
    );
    let ctx = RunContext {
        bins,
        image,
        accel: accel.accel,
        carrier,
        keep: false,
        gdb: None,
        snapshot: None,
        windows: None,
        paused: false,
        reuse_guests: true,
    };
    Ok((ctx, accel))
}

/// Gives the session its snapshot, or says why every run boots cold.
fn attach_snapshot(ctx: &mut RunContext, cold_because: Option<&str>) -> Result<()> {
    if let Some(why) = cold_because {
        eprintln!("vhca-run: cold boot for every run: {why}");
        return Ok(());
    }
    let dir = paths::snapshot_dir();
    let found = snapshot::prepare(&dir, &ctx.saved_machine(), &mut |msg| eprintln!("vhca-run: {msg}"))
        .context("preparing the snapshot")?;
    match &found {
        Some(s) => {
            let checked = s.checked.map(|c| format!(", checked in {c:.2} s")).unwrap_or_default();
            eprintln!(
                "vhca-run: runs restore snapshot {} ({}{checked}); --cold boots them instead",
                s.key,
                dir.display()
            )
        }
        None => eprintln!("vhca-run: no usable snapshot: every run boots cold"),
    }
    ctx.snapshot = found.map(Arc::new);
    Ok(())
}

fn program() -> String {
    std::env::current_exe().map(|p| p.display().to_string()).unwrap_or_else(|_| "vhca-run".into())
}

fn write_file(path: &Path, text: &str) -> Result<()> {
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// The table on stdout, the reports into the artifact root and wherever else asked.
fn publish(report: &SuiteReport, root: &Path, json: Option<&Path>, junit: Option<&Path>) -> Result<()> {
    // The table first: a full or broken artifacts disk must not cost the verdicts.
    let mut out = std::io::stdout().lock();
    let _ = write!(out, "{}", render_table(report));
    let _ = out.flush();
    let (json_text, junit_text) = (report.to_json(), render_junit(report));
    let mut written = Vec::new();
    for (path, text) in [
        (Some(root.join("report.json")), &json_text),
        (Some(root.join("junit.xml")), &junit_text),
        (json.map(Path::to_path_buf), &json_text),
        (junit.map(Path::to_path_buf), &junit_text),
    ] {
        if let Some(path) = path {
            write_file(&path, text)?;
            written.push(path.display().to_string());
        }
    }
    let page = vhca_suite::write_report_html(root, &serde_json::to_value(report)?, &[root.to_path_buf()])
        .with_context(|| format!("writing {}", root.join(vhca_suite::REPORT_HTML).display()))?;
    written.push(page.display().to_string());
    eprintln!("vhca-run: artifacts in {}; reports: {}", root.display(), written.join(", "));
    Ok(())
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

fn parse_interleavings_scope(text: &str) -> Result<InterleavingsScope, String> {
    InterleavingsScope::parse(text)
}

fn parse_driver(text: &str) -> Result<Personality, String> {
    Personality::parse(text).ok_or_else(|| format!("{text:?} is not a driver: native or sys"))
}

fn real_main(cli: Cli) -> Result<bool> {
    for dir in vhca_run::leftovers::sweep_dead_work_dirs(&std::env::temp_dir()) {
        eprintln!("vhca-run: removed {}, left by a runner that was killed", dir.display());
    }
    match cli.command {
        Cmd::Suite { file, jobs, filter, artifacts, json, junit, list, shard, durations, driver, interleavings } => {
            let (mut suite, suite_file) = load_suite(file.as_deref())?;
            if let Some(driver) = driver {
                suite.set_driver(driver);
            }
            let mut runs = match &filter {
                Some(re) => suite.expand_filtered(re).with_context(|| format!("--filter {re:?}"))?,
                None => suite.expand(),
            };
            interleavings.apply(&mut runs);
            if runs.is_empty() {
                bail!("no run of suite {:?} matches --filter {:?}", suite.name, filter.unwrap_or_default());
            }
            let root = artifacts.unwrap_or_else(|| paths::default_artifacts(&suite.name));
            let runs = match shard {
                Some(shard) => take_shard(&runs, shard, durations.as_deref(), &root)?,
                None => runs,
            };
            if list {
                for r in &runs {
                    println!("{}  expect {}", r.name, r.expected);
                }
                return Ok(true);
            }
            let windows = windows_image(&suite, suite_file.as_deref(), cli.windows_image.as_deref())?;
            let (mut ctx, _) = session(&cli.bins)?;
            ctx.reuse_guests = !cli.restore_per_run;
            if windows.is_some() {
                attach_snapshot(&mut ctx, Some("Windows guests boot cold"))?;
                ctx.windows = windows;
            } else {
                attach_snapshot(&mut ctx, cli.cold.then_some("--cold"))?;
            }
            let jobs = jobs.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
            let opts = SuiteOptions {
                jobs,
                artifacts: Some(root.clone()),
                program: program(),
                suite_file,
                expand_fail_points: true,
            };
            eprintln!("vhca-run: suite {} ({}): {} runs, {} at a time", suite.name, suite.source, runs.len(), jobs);
            let mut ui = SuiteUi::new(runs.len(), false);
            let report = run_suite(&ctx, &suite, &runs, &opts, &mut |e| ui.handle(e));
            ui.finish();
            let report = report?;
            publish(&report, &root, json.as_deref(), junit.as_deref())?;
            Ok(report.all_passed())
        }
        Cmd::Boot { pick, gdb, gdb_port, gdb_wait, keep, artifacts } => {
            pick.refuse_windows(
                "boot runs the Linux guest; for a Windows suite's run use `vhca-run debug --run NAME` \
                                 or `vhca-run suite FILE --filter NAME`",
            )?;
            let (run, _) = pick.concrete()?;
            let (mut ctx, _) = session(&cli.bins)?;
            ctx.reuse_guests = !cli.restore_per_run;
            let cold_because = if cli.cold {
                Some("--cold")
            } else if gdb || gdb_wait {
                Some("--gdb attaches to a booting kernel")
            } else {
                None
            };
            attach_snapshot(&mut ctx, cold_because)?;
            ctx.keep = keep;
            if gdb || gdb_wait {
                ctx.gdb = Some(GdbStub { port: gdb_port, wait: gdb_wait });
                let vmlinux = ctx.image.dir.join("vmlinux");
                let symbols = if vmlinux.is_file() { vmlinux } else { ctx.image.kernel.clone() };
                for line in linux_gdb_lines(&symbols, gdb_port, gdb_wait) {
                    eprintln!("{line}");
                }
            }
            run_one(&ctx, &run, artifacts)
        }
        Cmd::Bench { roundtrip: true, samples, completion, .. } => {
            let (ctx, _) = session(&cli.bins)?;
            let mut passed = true;
            for mode in &completion {
                let (measured, report) = bench::roundtrip(&ctx, samples, mode, &program(), &mut |e| {
                    if let vhca_run::suite_run::SuiteEvent::Finished { report, .. } = e {
                        eprintln!("[roundtrip {mode}] {}", vhca_run::ui::finished_line(&report));
                    }
                })?;
                if measured.is_null() {
                    bail!("the guest reported no round trip: {}", render_table(&report));
                }
                println!(
                    "\nround trip in the guest, vhca.completion={mode}, accelerator {}, cold boot",
                    ctx.accel.name()
                );
                print!("{}", bench::render_roundtrip(&measured));
                passed &= report.all_passed();
            }
            Ok(passed)
        }
        Cmd::Bench { alternate_completion: true, file, jobs, filter, completion, rounds, .. } => {
            let (suite, _) = load_suite(file.as_deref())?;
            let runs = match &filter {
                Some(re) => suite.expand_filtered(re).with_context(|| format!("--filter {re:?}"))?,
                None => suite.expand(),
            };
            if runs.is_empty() || jobs.is_empty() || jobs.contains(&0) || completion.is_empty() || rounds == 0 {
                bail!("nothing to measure: {} runs, -j {jobs:?}, modes {completion:?}, {rounds} rounds", runs.len());
            }
            let (mut ctx, _) = session(&cli.bins)?;
            ctx.reuse_guests = !cli.restore_per_run;
            attach_snapshot(&mut ctx, None)?;
            let Some(snap) = ctx.snapshot.clone() else { bail!("the completion bench runs from the snapshot: none") };
            let started = std::time::Instant::now();
            let ms =
                bench::measure_completion(&ctx, &suite, &runs, &jobs, &completion, rounds, &program(), &mut |l, e| {
                    if let vhca_run::suite_run::SuiteEvent::Finished { report, .. } = e {
                        eprintln!("[{l}] {}", vhca_run::ui::finished_line(&report));
                    }
                })?;
            println!(
                "suite {} ({} runs), accelerator {}, snapshot {}; bench {:.0} s",
                suite.name,
                runs.len(),
                ctx.accel.name(),
                snap.key,
                started.elapsed().as_secs_f64()
            );
            print!("{}", bench::render_completion(&ms));
            Ok(ms.iter().all(|m| m.passed == m.runs && m.off_mode == 0))
        }
        Cmd::Bench { file, jobs, filter, .. } => {
            let (suite, _) = load_suite(file.as_deref())?;
            let runs = match &filter {
                Some(re) => suite.expand_filtered(re).with_context(|| format!("--filter {re:?}"))?,
                None => suite.expand(),
            };
            if runs.is_empty() || jobs.is_empty() || jobs.contains(&0) {
                bail!("nothing to measure: {} runs, -j {jobs:?}", runs.len());
            }
            let (mut ctx, _) = session(&cli.bins)?;
            ctx.reuse_guests = !cli.restore_per_run;
            attach_snapshot(&mut ctx, None)?;
            let Some(snap) = ctx.snapshot.clone() else {
                bail!("the bench compares the snapshot with cold boots: no snapshot")
            };
            let started = std::time::Instant::now();
            let ms = bench::measure(&ctx, &suite, &runs, &jobs, &program(), &mut |label, e| {
                if let vhca_run::suite_run::SuiteEvent::Finished { report, .. } = e {
                    eprintln!("[{label}] {}", vhca_run::ui::finished_line(&report));
                }
            })?;
            println!(
                "suite {} ({} runs), accelerator {}, snapshot {}{}; bench {:.0} s",
                suite.name,
                runs.len(),
                ctx.accel.name(),
                snap.key,
                snap.built.map(|s| format!(" (built now in {s:.1} s)")).unwrap_or_default(),
                started.elapsed().as_secs_f64()
            );
            print!("{}", bench::render(&ms));
            let diffs = bench::verdict_differences(&ms);
            for (j, name, a, b) in &diffs {
                println!("VERDICTS DIFFER at -j {j}: {name}: snapshot {a}, cold {b}");
            }
            Ok(diffs.is_empty() && ms.iter().all(|m| m.passed == m.runs && m.off_path == 0))
        }
        Cmd::Soak { runs, artifacts, json } => {
            let (mut ctx, _) = session(&cli.bins)?;
            ctx.reuse_guests = !cli.restore_per_run;
            attach_snapshot(&mut ctx, cli.cold.then_some("--cold"))?;
            let root = artifacts.unwrap_or_else(|| paths::default_artifacts("soak"));
            let opts = SuiteOptions {
                jobs: 1,
                artifacts: Some(root),
                program: program(),
                suite_file: None,
                expand_fail_points: false,
            };
            println!(
                "{:>4}  {:<36} {:>7} {:>6} {:>10} {:>4} {:>15} {:>7} {:>17} {:>7} {:>5}",
                "run",
                "name",
                "verdict",
                "s",
                "runner KiB",
                "fds",
                "device KiB 1st/end",
                "fds",
                "QEMU KiB 1st/end",
                "fds",
                "left"
            );
            let report = soak::soak(&ctx, runs, &opts, &mut |s| {
                let verdict = if s.passed { "ok" } else { "WRONG" };
                // At the first output / at the end ("-": exiting by then).
                let both = |a: Option<vhca_run::proc_usage::ProcUsage>,
                            b: Option<vhca_run::proc_usage::ProcUsage>,
                            f: fn(vhca_run::proc_usage::ProcUsage) -> String| {
                    let one = |u: Option<_>| u.map_or("-".to_string(), f);
                    format!("{}/{}", one(a), one(b))
                };
                let (first, end) = (s.at_first_output, s.at_end);
                println!(
                    "{:>4}  {:<36} {:>7} {:>6.1} {:>10} {:>4} {:>15} {:>7} {:>17} {:>7} {:>5}",
                    s.index,
                    s.run,
                    verdict,
                    s.seconds,
                    s.runner_rss_kib,
                    s.runner_fds,
                    both(first.device, end.device, |u| u.rss_kib.to_string()),
                    both(first.device, end.device, |u| u.fds.to_string()),
                    both(first.qemu, end.qemu, |u| u.rss_kib.to_string()),
                    both(first.qemu, end.qemu, |u| u.fds.to_string()),
                    s.work_dirs_left + s.processes_left.len()
                );
            })?;
            if let Some(path) = json {
                write_file(&path, &serde_json::to_string_pretty(&report)?)?;
            }
            for g in &report.growth {
                println!("{}", g.summary());
            }
            for problem in &report.problems {
                println!("PROBLEM: {problem}");
            }
            println!(
                "soak: {} runs, {} with a wrong verdict, runner fds {} before and {} after, locks {} before and {} after, {}",
                report.samples.len(),
                report.failed_runs,
                report.fds_before,
                report.samples.last().map_or(report.fds_before, |s| s.runner_fds),
                report.locks_before,
                report.samples.last().map_or(report.locks_before, |s| s.runner_locks),
                if report.passed() { "passed" } else { "FAILED" }
            );
            Ok(report.passed())
        }
        Cmd::Report { action: ReportCmd::Merge { out, shard_dirs } } => merge_reports(&out, &shard_dirs),
        Cmd::Debug(args) => debug_cmd::run(&cli.bins, cli.windows_image.as_deref(), args),
        Cmd::WindowsImage(cmd) => windows_image_cmd::run(&cli.bins, cmd),
        Cmd::QemuArgs { pick, dir } => {
            pick.refuse_windows(
                "qemu-args prints the Linux guest's lines; a Windows run's exact QEMU command line is the \
                                 qemu.cmdline in its artifact folder",
            )?;
            let (run, _) = pick.concrete()?;
            let (ctx, accel) = session(&cli.bins)?;
            let (device, qemu) = plan(&ctx, &run, &dir);
            let (device_line, qemu_line) = command_lines(&device, &qemu);
            println!("# {}: accelerator {} ({})", run.name, accel.accel.name(), accel.how);
            println!("mkdir -p {}", shell_words::quote(&dir.display().to_string()));
            println!("{device_line} &");
            // QEMU must find the device listening, as the runner waits for the socket before starting it.
            println!("while [ ! -S {} ]; do sleep 0.1; done", shell_words::quote(&device.socket.display().to_string()));
            println!("{qemu_line}");
            Ok(true)
        }
    }
}

/// This shard's runs; the balance comes from `durations`, or the artifact root's previous report.json.
fn take_shard(runs: &[ConcreteRun], shard: Shard, durations: Option<&Path>, root: &Path) -> Result<Vec<ConcreteRun>> {
    let previous = root.join("report.json");
    let source = durations.map(Path::to_path_buf).or_else(|| previous.is_file().then_some(previous));
    let times = match &source {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("--durations {}", path.display()))?;
            vhca_suite::durations_from_report(&text)
        }
        None => Default::default(),
    };
    let mine = vhca_suite::shard_runs(runs, shard, &times);
    eprintln!(
        "vhca-run: shard {shard}: {} of {} runs, balanced by {}",
        mine.len(),
        runs.len(),
        match &source {
            Some(p) => format!("the run times in {} ({} known)", p.display(), times.len()),
            None => "run count (no previous report)".to_string(),
        }
    );
    Ok(mine)
}

/// `report merge`: one report.json, junit.xml and report.html from the shards'; true when every run passed.
fn merge_reports(out: &Path, shard_dirs: &[PathBuf]) -> Result<bool> {
    let read = |dir: &PathBuf, name: &str| -> Result<(String, String)> {
        let path = dir.join(name);
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        Ok((path.display().to_string(), text))
    };
    let json: Vec<(String, String)> = shard_dirs.iter().map(|d| read(d, "report.json")).collect::<Result<_>>()?;
    let junit: Vec<(String, String)> = shard_dirs.iter().map(|d| read(d, "junit.xml")).collect::<Result<_>>()?;
    let merged = vhca_suite::merge_json(&json)?;
    let suite = merged.json["suite"].as_str().unwrap_or("suite").to_string();
    let (xml, junit_failures) = vhca_suite::merge_junit(&junit, &suite)?;
    let text = serde_json::to_string_pretty(&merged.json).context("rendering the merged report")?;
    write_file(&out.join("report.json"), &text)?;
    write_file(&out.join("junit.xml"), &xml)?;
    // The page links each run's folder where it is: under the shard root that held it.
    vhca_suite::write_report_html(out, &merged.json, shard_dirs)
        .with_context(|| format!("writing {}", out.join(vhca_suite::REPORT_HTML).display()))?;
    println!(
        "suite {suite}: {} shards, {} runs, {} failed (JUnit: {junit_failures} failures); merged into {}",
        shard_dirs.len(),
        merged.runs,
        merged.failed,
        out.display()
    );
    Ok(merged.all_passed && junit_failures == 0)
}

/// One run in the foreground, its console on stderr (`boot`, `debug`): verdict table, reports, the run's files.
fn run_one(ctx: &RunContext, run: &ConcreteRun, artifacts: Option<PathBuf>) -> Result<bool> {
    let suite = Suite {
        name: "boot".into(),
        source: "<command line>".into(),
        runs: Vec::new(),
        guest: if ctx.windows.is_some() { vhca_suite::GuestKind::Windows } else { vhca_suite::GuestKind::Linux },
        windows_image: None,
    };
    let root = artifacts.unwrap_or_else(|| paths::default_artifacts("boot"));
    let opts = SuiteOptions {
        jobs: 1,
        artifacts: Some(root.clone()),
        program: program(),
        suite_file: None,
        expand_fail_points: false,
    };
    let mut ui = SuiteUi::new(1, true);
    let report = run_suite(ctx, &suite, std::slice::from_ref(run), &opts, &mut |e| ui.handle(e));
    ui.finish();
    let mut report = report?;
    // A boot is repeated by its own command line, not by a suite filter.
    let again: Vec<String> = std::env::args().map(|a| shell_words::quote(&a).into_owned()).collect();
    for r in report.runs.iter_mut().filter(|r| !r.passed()) {
        r.reproducer = Some(again.join(" "));
    }
    publish(&report, &root, None, None)?;
    if let Some(dir) = report.runs.first().and_then(|r| r.artifact_dir.as_ref()) {
        println!("run files: {}", dir.display());
    }
    Ok(report.all_passed())
}

#[cfg(test)]
mod reproducer_tests {
    //! A failed run's printed reproducer is a command line this program takes and that names the same run: the
    //! suite writes it, clap parses it back, and `RunPick` picks the run it came from.
    use super::*;
    use vhca_suite::{judge, BootPath, Observation, RunReport};

    /// A native-only entry (the suite file's `drivers`) made a vhca.sys run by `suite --driver sys`, and an entry
    /// whose file already runs it as vhca.sys.
    const SUITE: &str = "name = \"t\"\n[defaults]\ndrivers = [\"native\", \"sys\"]\n\
        [[run]]\nname = \"smoke\"\nmodes = [\"on\"]\ndriver = \"native\"\nexpect = \"pass\"\n\
        [[run]]\nname = \"two-requests-locked\"\nmodes = [\"on\"]\nexpect = \"pass\"\n";

    /// The reproducer of `run` failing, parsed back into the run `boot` would start.
    fn picked_again(run: &ConcreteRun, file: &str) -> ConcreteRun {
        let failed = Observation { guest_result: Some(serde_json::json!({"ok": false})), ..Default::default() };
        let mut report = RunReport::new(run, judge(&run.expected, &failed), 1.0, "tcg", BootPath::Cold);
        report.set_reproducer("vhca-run", Some(file));
        let line = report.reproducer.expect("a failed run has a reproducer");
        let words = shell_words::split(&line).unwrap_or_else(|e| panic!("{line}: {e}"));
        let cli = Cli::try_parse_from(&words).unwrap_or_else(|e| panic!("{line}:\n{e}"));
        let Cmd::Boot { pick, .. } = cli.command else { panic!("{line}: not a boot") };
        pick.concrete().unwrap_or_else(|e| panic!("{line}: {e:#}")).0
    }

    #[test]
    fn a_vhca_sys_runs_reproducer_boots_the_same_run() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(&file, SUITE).unwrap();
        let file = file.display().to_string();
        let mut by_flag = Suite::parse(SUITE, &file).unwrap();
        by_flag.set_driver(Personality::Sys);
        let by_file = Suite::parse(SUITE, &file).unwrap();
        let sys_runs: Vec<ConcreteRun> = by_flag
            .expand()
            .into_iter()
            .chain(by_file.expand().into_iter().filter(|r| r.guest.driver == Personality::Sys))
            .collect();
        assert_eq!(sys_runs.len(), 3, "{:?}", sys_runs.iter().map(|r| &r.name).collect::<Vec<_>>());
        for run in sys_runs {
            let interleaved = run.with_interleaving("preempt:system-worker-0#113").unwrap();
            for form in [run.at_fail_point(3), interleaved] {
                let again = picked_again(&form, &file);
                assert_eq!(again.name, form.name);
                assert_eq!(again.guest.driver, Personality::Sys, "{}", form.name);
                assert_eq!(again.interleaving.spec, form.interleaving.spec, "{}", form.name);
            }
        }
    }
}
