//! vhca-device: listens on a vhost-user socket, serves exactly one front-end (QEMU) connection, then exits.
//! Exit status: 0 when the front-end disconnected cleanly, 2 after a protocol error or a bad command line (nothing
//! created then), 1 when setup failed, 3 when the sandbox stopped a forbidden system call.
//! The sandbox (capabilities dropped after the socket is bound, a seccomp filter once the connection is set up) is
//! on unless `--no-sandbox`.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{CommandFactory, Parser};
use vhca_device::config::HcaChoices;
use vhca_device::event_log::{EventLog, TransportEvent};
use vhca_device::sandbox;
use vhca_device::{serve_locked_down, DeviceOptions};

/// Largest pool `--map-registers` accepts: 4 GiB of 4 KiB pages, and a table of a few MiB.
const MAX_MAP_REGISTERS: i64 = 1 << 20;
/// Longest `--miss-timeout-ms`: an hour is already far past any QEMU answer.
const MAX_MISS_TIMEOUT_MS: u64 = vhca_device::shared::MAX_MISS_TIMEOUT.as_secs() * 1000;
/// Longest `--thread-slice-us`.
const MAX_THREAD_SLICE_US: u64 = vhca_device::thread_sched::LONGEST.as_micros() as u64;
/// Most `--max-notifications-per-ms`.
const MAX_NOTIFY_BURST: i64 = vhca_device::notifications::MAX_BURST as i64;
/// Longest `--poll-window-us`.
const MAX_POLL_WINDOW_US: u64 = vhca_device::queue_polling::MAX_POLL_WINDOW.as_micros() as u64;

#[derive(Debug, Parser)]
#[command(version, about = "vhost-user backend emulating an RDMA HCA behind QEMU's intel-iommu")]
struct Cli {
    /// Unix socket to create and listen on (a stale file there is removed).
    #[arg(long)]
    socket_path: PathBuf,
    /// JSON-lines event log to write.
    #[arg(long)]
    event_log: PathBuf,
    /// Size of the HCA's map-register pool (1 to 1048576).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..=MAX_MAP_REGISTERS))]
    map_registers: u32,
    /// Milliseconds an IOTLB miss may stay unanswered before the access counts as an IOMMU fault.
    #[arg(long, default_value_t = vhca_device::DEFAULT_MISS_TIMEOUT_MS,
          value_parser = clap::value_parser!(u64).range(0..=MAX_MISS_TIMEOUT_MS))]
    miss_timeout_ms: u64,
    /// Microseconds the queue worker keeps polling the request queues after its last work, with the driver's kicks
    /// suppressed (VRING_USED_F_NO_NOTIFY); 0 (the default): never poll, every request is kicked. Worth it only with
    /// a host core to spare (docs/protocol.md, docs/bench.md section 5).
    #[arg(long, default_value_t = vhca_device::DEFAULT_POLL_WINDOW_US,
          value_parser = clap::value_parser!(u64).range(0..=MAX_POLL_WINDOW_US))]
    poll_window_us: u64,
    /// Scheduler slice, in microseconds, asked for the queue worker and the IOTLB reply reader (Linux 6.12+; the
    /// kernel clamps it to 100–100000): a kick that wakes the worker where QEMU's vCPU thread runs then preempts
    /// that thread instead of waiting out its slice. 0: the kernel's default (docs/bench.md section 5).
    #[arg(long, default_value_t = vhca_device::thread_sched::SHORTEST.as_micros() as u64,
          value_parser = clap::value_parser!(u64).range(0..=MAX_THREAD_SLICE_US))]
    thread_slice_us: u64,
    /// Used-buffer notifications (call eventfd writes) each queue may send in any millisecond; the excess is folded
    /// into one later notification, so no driver can make the device interrupt it without pause (docs/protocol.md).
    #[arg(long, default_value_t = vhca_device::notifications::DEFAULT_BURST,
          value_parser = clap::value_parser!(u32).range(1..=MAX_NOTIFY_BURST))]
    max_notifications_per_ms: u32,
    /// Fault injection, KEY=VALUE (repeatable; a later one wins): fail_reg_mr=N, fail_ring_map=N,
    /// drop_completion=N, delay_completion=N, delay_doorbells=K, max_contiguous_pages=P,
    /// contiguous_policy=refuse|split, invalidate_at_dma=N, invalidate_iova=A, invalidate_size=S,
    /// hold_completion_ms=MS, hold_completion_wr=N (docs/protocol.md).
    #[arg(long, value_name = "KEY=VALUE")]
    inject: Vec<String>,
    /// Fault injection from a JSON object with the same keys; --inject flags override its knobs.
    #[arg(long, value_name = "FILE")]
    inject_config: Option<PathBuf>,
    /// Re-validate a map register made stale by an IOTLB invalidation on its next use, instead of refusing it.
    #[arg(long)]
    revalidate_stale: bool,
    /// Read one byte of every page when a ring or MR is mapped, so an IOVA the vIOMMU refuses fails the command.
    #[arg(long)]
    probe_pages: bool,
    /// Do not offer VIRTIO_F_ACCESS_PLATFORM (bit 33): a device that bypasses the IOMMU, for QEMU's
    /// iommu_platform=off; a driver behind an active IOMMU refuses it at start.
    #[arg(long)]
    no_access_platform: bool,
    /// Most protection domains alive at once.
    #[arg(long)]
    max_pd: Option<u32>,
    /// Most completion queues alive at once.
    #[arg(long)]
    max_cq: Option<u32>,
    /// Most queue pairs alive at once.
    #[arg(long)]
    max_qp: Option<u32>,
    /// Most memory regions alive at once.
    #[arg(long)]
    max_mr: Option<u32>,
    /// Run without the sandbox (no seccomp filter, capabilities kept): for debugging with strace or gdb.
    #[arg(long)]
    no_sandbox: bool,
    /// Test only: once the sandbox is on, make one system call it forbids, to show what a violation looks like.
    #[arg(long, hide = true)]
    debug_forbidden_syscall: bool,
    /// Test only: once the sandbox is on, open a file, which the sandbox refuses with EPERM; the device goes on.
    #[arg(long, hide = true)]
    debug_refused_open: bool,
}

impl Cli {
    /// The device's options, or a usage error (exit 2) naming the flag and value, before anything is created.
    fn device_options(&self) -> DeviceOptions {
        let choices = HcaChoices {
            map_registers: self.map_registers,
            max_pd: self.max_pd,
            max_cq: self.max_cq,
            max_qp: self.max_qp,
            max_mr: self.max_mr,
            probe_pages: self.probe_pages,
            revalidate_stale: self.revalidate_stale,
            inject_config: self.inject_config.clone(),
            inject: self.inject.clone(),
        };
        match choices.to_config() {
            Ok(hca) => DeviceOptions {
                hca,
                miss_timeout: Duration::from_millis(self.miss_timeout_ms),
                poll_window: Duration::from_micros(self.poll_window_us),
                thread_slice: Duration::from_micros(self.thread_slice_us),
                notify_bound: vhca_device::notifications::RateBound {
                    burst: self.max_notifications_per_ms,
                    window: vhca_device::notifications::DEFAULT_WINDOW,
                },
                access_platform: !self.no_access_platform,
                ..DeviceOptions::default()
            },
            Err(err) => Cli::command().error(clap::error::ErrorKind::ValueValidation, err).exit(),
        }
    }
}

/// Removes the socket file however `main` returns.
struct SocketFile<'a>(&'a Path);

impl Drop for SocketFile<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let options = cli.device_options();
    match run(&cli, &options) {
        Ok(code) => code,
        Err(err) => {
            tracing::error!("{err:#}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: &Cli, options: &DeviceOptions) -> anyhow::Result<ExitCode> {
    let hca = &options.hca;
    let injection = &hca.injection;
    if injection.is_empty() {
        tracing::info!("fault injection: none");
    } else {
        tracing::info!("fault injection: {}", injection.to_kv().join(" "));
    }
    tracing::info!(
        "map registers {}, probe_pages {}, revalidate_stale {}, miss timeout {} ms, poll window {} µs",
        hca.map_registers,
        hca.probe_pages,
        hca.revalidate_stale,
        cli.miss_timeout_ms,
        cli.poll_window_us
    );
    let events = Arc::new(
        EventLog::create(&cli.event_log)
            .with_context(|| format!("cannot create event log {}", cli.event_log.display()))?,
    );
    vhca_device::event_log::install_flush_guards(&events).context("event log flush on signals")?;
    events.record(&TransportEvent::Start {
        schema: vhca_hca::EVENT_SCHEMA_VERSION,
        pid: std::process::id(),
        socket: cli.socket_path.display().to_string(),
        map_registers: hca.map_registers,
        version: env!("CARGO_PKG_VERSION"),
        miss_timeout_ms: cli.miss_timeout_ms,
        probe_pages: hca.probe_pages,
        revalidate_stale: hca.revalidate_stale,
        max_pd: hca.max_pd,
        max_cq: hca.max_cq,
        max_qp: hca.max_qp,
        max_mr: hca.max_mr,
        injection: injection.clone(),
        max_notifications_per_ms: cli.max_notifications_per_ms,
    });
    match std::fs::remove_file(&cli.socket_path) {
        Ok(()) => tracing::info!("removed stale socket {}", cli.socket_path.display()),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(err).with_context(|| format!("cannot remove {}", cli.socket_path.display())),
    }
    // Bound and listening under a staging name, then renamed into place: the socket path appears only once a
    // connect to it is accepted. (UnixListener::bind makes the file at bind(), before listen(): a front-end that
    // connects in between is refused, which QEMU's chardev-add right after the file appeared hit.)
    let staging = PathBuf::from(format!("{}.{}.binding", cli.socket_path.display(), std::process::id()));
    let listener = UnixListener::bind(&staging).with_context(|| format!("cannot listen on {}", staging.display()))?;
    if let Err(err) = std::fs::rename(&staging, &cli.socket_path) {
        let _ = std::fs::remove_file(&staging);
        return Err(err).with_context(|| format!("cannot move the socket to {}", cli.socket_path.display()));
    }
    let _socket_file = SocketFile(&cli.socket_path);
    if cli.no_sandbox {
        tracing::warn!("sandbox off (--no-sandbox): no seccomp filter, capabilities kept");
    } else {
        sandbox::drop_capabilities()?;
    }
    tracing::info!("listening on {}", cli.socket_path.display());
    let (stream, _) = listener.accept().context("accepting the front-end connection")?;
    drop(listener);
    tracing::info!("front-end connected");
    events.record(&TransportEvent::Connected);
    let log = Arc::clone(&events);
    let lockdown = || {
        // What is logged so far reaches the file before the filter is on: a trapped call exits from a signal
        // handler, which cannot flush (at most one flush interval of later lines can be lost that way).
        log.flush();
        if !cli.no_sandbox {
            sandbox::install_filter(&cli.socket_path).map_err(|err| err.to_string())?;
        }
        if cli.debug_forbidden_syscall {
            sandbox::forbidden_syscall();
        }
        if cli.debug_refused_open {
            match sandbox::refused_open() {
                Ok(_) => tracing::warn!("debug: the open went through (sandbox off?)"),
                Err(err) => tracing::info!("debug: the open was refused: {err}"),
            }
        }
        Ok(())
    };
    match serve_locked_down(stream, events, options, lockdown) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(vhca_device::ServeError::Protocol(_)) => Ok(ExitCode::from(2)),
        Err(err) => Err(err.into()),
    }
}
