//! `vhca-run windows-image build|add-state|answer-file`: the Windows image recipe from the command line. `build` turns
//! the user's own Windows ISO and the driver package into an image directory; `add-state` adds a Driver Verifier boot
//! state to one; `answer-file` writes the answer disc's generated files for inspection. Never run end to end here: no
//! Windows ISO or licence on these machines (docs/windows.md).

use std::net::Ipv4Addr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};

use vhca_run::accel::AccelChoice;
use vhca_run::paths;
use vhca_run::qemu_cmd::Accel;
use vhca_run::windows_guest::image_dir::WindowsImage;
use vhca_run::windows_guest::kdnet::{KdnetKey, KdnetSettings, DEFAULT_PORT, SLIRP_HOST};
use vhca_run::windows_guest::machine::Firmware;
use vhca_run::windows_guest::recipe::{add_state, answer_disc_files, build, record_state, BuildOptions};

use super::BinArgs;

#[derive(Subcommand)]
pub enum WindowsImageCmd {
    /// ISO + driver package -> image directory (base disk, boot states, image.json). Hours, not minutes.
    Build(BuildArgs),
    /// Add a boot state with other Driver Verifier flags to an image.
    AddState {
        #[arg(long)]
        image: PathBuf,
        /// Driver Verifier flags, e.g. 0x80 (0 for off).
        #[arg(long)]
        verifier_flags: String,
        #[command(flatten)]
        machine: MachineArgs,
    },
    /// Write the answer disc's generated files (autounattend.xml, set-up script, agent) into DIR to read them.
    AnswerFile {
        #[command(flatten)]
        answers: AnswerArgs,
        /// Where to write them.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Args)]
pub struct AnswerArgs {
    /// The install.wim image to install, as its /IMAGE/NAME.
    #[arg(long, default_value = "Windows 11 Pro")]
    edition: String,
    #[arg(long, default_value = "en-US")]
    locale: String,
    /// Needed by editions that do not install without one (evaluation media do).
    #[arg(long)]
    product_key: Option<String>,
    #[arg(long, default_value = "vhca")]
    account: String,
    /// The local account's password (stored in the answer file in plain text, as Setup requires).
    #[arg(long, default_value = "vhca")]
    password: String,
    /// uefi (OVMF; Windows 11) or bios (SeaBIOS; Windows 10 / Server).
    #[arg(long, default_value = "uefi", value_parser = parse_firmware)]
    firmware: Firmware,
    /// Where the guest's KDNET sends: 10.0.2.2 is the QEMU host; or the WinDbg machine's address.
    #[arg(long, default_value_t = SLIRP_HOST)]
    kdnet_host_ip: Ipv4Addr,
    #[arg(long, default_value_t = DEFAULT_PORT)]
    kdnet_port: u16,
}

#[derive(Args)]
pub struct MachineArgs {
    /// Show the screen on VNC display N (127.0.0.1:590N).
    #[arg(long)]
    vnc: Option<u16>,
    /// kvm or tcg [default: what the runner's KVM probe found, as for every command that starts a guest (Windows
    /// under TCG takes many hours)]
    #[arg(long)]
    accel: Option<String>,
}

#[derive(Args)]
pub struct BuildArgs {
    /// Your Windows ISO (none ships with this rig).
    #[arg(long)]
    iso: PathBuf,
    /// The test-signed driver package [default: $VHCA_WINDOWS_DRIVER_DIR, else vhca-sys/ next to vhca-run, else
    /// <target>/vhca-sys, which ci/build-windows.sh writes]
    #[arg(long)]
    driver_package: Option<PathBuf>,
    /// The image directory to create.
    #[arg(long)]
    out: PathBuf,
    /// Boot states besides verifier-off, comma-separated Driver Verifier flags [default: 0xAA, the seed suite's].
    #[arg(long, value_delimiter = ',', default_values_t = ["0xAA".to_string()])]
    verifier_flags: Vec<String>,
    #[command(flatten)]
    answers: AnswerArgs,
    #[command(flatten)]
    machine: MachineArgs,
}

fn parse_firmware(s: &str) -> Result<Firmware, String> {
    match s {
        "uefi" => Ok(Firmware::Uefi),
        "bios" => Ok(Firmware::Bios),
        other => Err(format!("{other:?}: expected uefi or bios")),
    }
}

fn parse_flags(s: &str) -> Result<u32> {
    let t = s.trim();
    let n = match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u32::from_str_radix(hex, 16),
        None => t.parse(),
    };
    n.with_context(|| format!("verifier flags {s:?}: expected 0x-prefixed hex or a number"))
}

/// `--accel`, else the probe every other command takes its accelerator from (accel.rs).
fn accel(bins: &BinArgs, choice: &Option<String>) -> Result<AccelChoice> {
    match choice {
        Some(a) => match Accel::parse(a) {
            Some(accel) => Ok(AccelChoice { accel, how: "--accel".into() }),
            None => bail!("--accel {a}: expected kvm or tcg"),
        },
        None => super::probed_accel(bins),
    }
}

fn options(
    bins: &BinArgs,
    (a, m): (&AnswerArgs, &MachineArgs),
    iso: PathBuf,
    package: PathBuf,
    out: PathBuf,
) -> Result<BuildOptions> {
    let accel = accel(bins, &m.accel)?;
    eprintln!("vhca-run windows-image: accelerator {} ({})", accel.accel.name(), accel.how);
    Ok(BuildOptions {
        iso,
        driver_package: package,
        out,
        edition: a.edition.clone(),
        locale: a.locale.clone(),
        product_key: a.product_key.clone(),
        account: a.account.clone(),
        password: a.password.clone(),
        firmware: a.firmware,
        kdnet_host_ip: a.kdnet_host_ip,
        kdnet_port: a.kdnet_port,
        verifier_flags: Vec::new(),
        qemu: paths::Binaries::resolve(None, None).qemu,
        accel: accel.accel,
        vnc: m.vnc,
    })
}

pub fn run(bins: &BinArgs, cmd: WindowsImageCmd) -> Result<bool> {
    let mut log = |line: &str| eprintln!("vhca-run windows-image: {line}");
    match cmd {
        WindowsImageCmd::Build(b) => {
            let package = match b.driver_package.or_else(paths::driver_package) {
                Some(dir) => dir,
                None => bail!(
                    "no driver package: pass --driver-package DIR or set VHCA_WINDOWS_DRIVER_DIR (ci/build-windows.sh \
                     builds and signs one into target/vhca-sys; docs/windows.md)"
                ),
            };
            let mut opts = options(bins, (&b.answers, &b.machine), b.iso, package, b.out)?;
            opts.verifier_flags = b.verifier_flags.iter().map(|f| parse_flags(f)).collect::<Result<_>>()?;
            let image = build(&opts, &mut log)?;
            println!(
                "image {} ready: KDNET port {}, key {}",
                image.dir.display(),
                image.meta.kdnet_port,
                image.meta.kdnet_key
            );
            Ok(true)
        }
        WindowsImageCmd::AddState { image, verifier_flags, machine } => {
            let img = WindowsImage::open(&image)?;
            let flags = parse_flags(&verifier_flags)?;
            let mut answers = AnswerArgs::defaults();
            answers.firmware = img.meta.firmware;
            let opts = options(bins, (&answers, &machine), PathBuf::new(), PathBuf::new(), image.clone())?;
            add_state(&opts, &image, flags, &mut log)?;
            record_state(&image, flags).context("image.json")?;
            Ok(true)
        }
        WindowsImageCmd::AnswerFile { answers, out } => {
            let opts = options(
                bins,
                (&answers, &MachineArgs { vnc: None, accel: Some("tcg".into()) }),
                PathBuf::new(),
                PathBuf::new(),
                out.clone(),
            )?;
            let key = KdnetKey::generate()?;
            let kdnet = KdnetSettings::new(answers.kdnet_host_ip, answers.kdnet_port, key)?;
            for (path, text) in answer_disc_files(&opts, &kdnet) {
                let p = out.join(&path);
                if let Some(dir) = p.parent() {
                    std::fs::create_dir_all(dir).with_context(|| dir.display().to_string())?;
                }
                std::fs::write(&p, text).with_context(|| p.display().to_string())?;
                println!("{}", p.display());
            }
            Ok(true)
        }
    }
}

impl AnswerArgs {
    fn defaults() -> AnswerArgs {
        AnswerArgs {
            edition: String::new(),
            locale: String::new(),
            product_key: None,
            account: String::new(),
            password: String::new(),
            firmware: Firmware::Uefi,
            kdnet_host_ip: SLIRP_HOST,
            kdnet_port: DEFAULT_PORT,
        }
    }
}
