//! vhca-device: listens on a vhost-user socket, serves exactly one front-end (QEMU) connection, then exits.
//! Exit status: 0 when the front-end disconnected cleanly, 2 after a protocol error, 1 when setup failed.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use vhca_device::event_log::{EventLog, TransportEvent, SCHEMA_VERSION};
use vhca_device::{serve, DeviceOptions};

#[derive(Debug, Parser)]
#[command(version, about = "vhost-user backend emulating an RDMA HCA behind QEMU's intel-iommu")]
struct Cli {
    /// Unix socket to create and listen on (a stale file there is removed).
    #[arg(long)]
    socket_path: PathBuf,
    /// JSON-lines event log to write.
    #[arg(long)]
    event_log: PathBuf,
    /// Size of the HCA's map-register pool.
    #[arg(long, default_value_t = 4096)]
    map_registers: u32,
    /// Milliseconds an IOTLB miss may stay unanswered before the access counts as an IOMMU fault.
    #[arg(long, default_value_t = 1000)]
    miss_timeout_ms: u64,
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
    match run(&cli) {
        Ok(code) => code,
        Err(err) => {
            tracing::error!("{err:#}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<ExitCode> {
    let events = Arc::new(
        EventLog::create(&cli.event_log)
            .with_context(|| format!("cannot create event log {}", cli.event_log.display()))?,
    );
    events.record(&TransportEvent::Start {
        schema: SCHEMA_VERSION,
        pid: std::process::id(),
        socket: cli.socket_path.display().to_string(),
        map_registers: cli.map_registers,
        version: env!("CARGO_PKG_VERSION"),
    });
    match std::fs::remove_file(&cli.socket_path) {
        Ok(()) => tracing::info!("removed stale socket {}", cli.socket_path.display()),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
        Err(err) => return Err(err).with_context(|| format!("cannot remove {}", cli.socket_path.display())),
    }
    let listener = UnixListener::bind(&cli.socket_path)
        .with_context(|| format!("cannot listen on {}", cli.socket_path.display()))?;
    let _socket_file = SocketFile(&cli.socket_path);
    tracing::info!("listening on {}", cli.socket_path.display());
    let (stream, _) = listener.accept().context("accepting the front-end connection")?;
    drop(listener);
    tracing::info!("front-end connected");
    events.record(&TransportEvent::Connected);
    let options =
        DeviceOptions { map_registers: cli.map_registers, miss_timeout: Duration::from_millis(cli.miss_timeout_ms) };
    match serve(stream, events, &options) {
        Ok(()) => Ok(ExitCode::SUCCESS),
        Err(vhca_device::ServeError::Protocol(_)) => Ok(ExitCode::from(2)),
        Err(err) => Err(err.into()),
    }
}
