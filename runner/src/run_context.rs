//! The facts every run of a session shares (binaries, image, accelerator, snapshot, debugging), and the guest
//! options baked into every run, which the snapshot's machine is also saved with.

use std::sync::Arc;

use crate::image::Image;
use crate::paths::Binaries;
use crate::qemu_cmd::{Accel, Carrier, GdbStub};
use crate::snapshot::{SavedMachine, Snapshot, AGENT_WORD};
use crate::windows_guest::image_dir::WindowsImage;

/// Facts shared by every run of a session.
#[derive(Debug, Clone)]
pub struct RunContext {
    pub bins: Binaries,
    pub image: Image,
    pub accel: Accel,
    pub carrier: Carrier,
    /// Keep the run's work dir instead of removing it.
    pub keep: bool,
    /// Interactive debugging: a gdb stub, and no timeout or silence limit.
    pub gdb: Option<GdbStub>,
    /// The saved guest runs are restored from; None: every run boots cold.
    pub snapshot: Option<Arc<Snapshot>>,
    /// A Windows suite's image: every run boots it cold instead of the Linux guest (never run here: no image).
    pub windows: Option<Arc<WindowsImage>>,
    /// Start each QEMU paused (`vhca-run debug`): the debugger, or the person, continues it.
    pub paused: bool,
    /// A restored guest whose run left it clean serves its worker's next run (`run_process` in the guest says what
    /// clean is); off: one restore per run.
    pub reuse_guests: bool,
}

/// Guest options every run gets on either path: `reset_method=none`, then the words of $VHCA_GUEST_APPEND.
/// vfio-pci resets a device at every open and close with the first method it has; the HCA is hot-plugged (or
/// booted) fresh for each run with a new vhca-device behind it, and the guest resets it through virtio before using
/// it, so a reset at open checks nothing. The cheapest one, a D3hot cycle (`pm`), sleeps the kernel's 10 ms
/// d3hot delay twice: vfio open took 42-44 ms with it and 15-16 ms without (22 runs each, AMD EPYC, TCG). The
/// close is skipped at power-off anyway (bring_up.rs).
pub fn baked_guest_options() -> Vec<String> {
    let mut words = vec!["vhca.reset_method=none".to_string()];
    words.extend(std::env::var("VHCA_GUEST_APPEND").unwrap_or_default().split_whitespace().map(String::from));
    words
}

impl RunContext {
    /// The machine a snapshot of this session is taken of: no HCA, the baked-in options and the agent.
    pub fn saved_machine(&self) -> SavedMachine {
        let mut append = baked_guest_options();
        append.push(AGENT_WORD.to_string());
        SavedMachine {
            qemu: self.bins.qemu.clone(),
            accel: self.accel,
            kernel: self.image.kernel.clone(),
            initrd: self.image.initrd.clone(),
            append,
            vcpus: crate::qemu_cmd::DEFAULT_VCPUS,
        }
    }
}
