//! Where each file of one run lives inside its work dir: the sockets, the logs and the command lines. The planner,
//! the processes, the watch and the evidence all name a run's files through here.

use std::path::PathBuf;

/// The files of a run inside its work dir.
#[derive(Debug, Clone)]
pub struct RunFiles {
    pub dir: PathBuf,
}

impl RunFiles {
    pub fn socket(&self) -> PathBuf {
        self.dir.join("device.sock")
    }
    pub fn qmp(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }
    pub fn events(&self) -> PathBuf {
        self.dir.join("events.jsonl")
    }
    /// The device's stdout and stderr.
    pub fn device_log(&self) -> PathBuf {
        self.dir.join("device.log")
    }
    /// QEMU's stdout and stderr.
    pub fn qemu_log(&self) -> PathBuf {
        self.dir.join("qemu.log")
    }
    pub fn serial(&self) -> PathBuf {
        self.dir.join("serial.log")
    }
    /// The console socket of a restored guest (its output is still logged to `serial`).
    pub fn serial_socket(&self) -> PathBuf {
        self.dir.join("serial.sock")
    }
    /// When the run's end came, counted from the device's start: the result line, QEMU's and the device's exits.
    pub fn ending_log(&self) -> PathBuf {
        self.dir.join("ending.log")
    }
    /// How long each restore step took.
    pub fn restore_log(&self) -> PathBuf {
        self.dir.join("restore.log")
    }
    pub fn qmp_events(&self) -> PathBuf {
        self.dir.join("qmp-events.jsonl")
    }
    pub fn device_cmdline(&self) -> PathBuf {
        self.dir.join("device.cmdline")
    }
    pub fn qemu_cmdline(&self) -> PathBuf {
        self.dir.join("qemu.cmdline")
    }
}
