//! vhca's Linux guest driver: drives the vhca device from user space through VFIO and virtio-pci.
//! The binary (main.rs) runs as the initramfs' init: it takes the run request and hands it to `bring_up` (or to
//! `test_modes`); these modules are also the base the NT model maps DMA with.

pub mod agent;
pub mod bring_up;
pub mod bugcheck_handler;
pub mod cmdline;
pub mod completion_times;
pub mod completion_wait;
pub mod driver_run;
pub mod hot_unplug;
pub mod hotplug_slot;
pub mod interleaving;
pub mod interrupt_thread;
pub mod kmsg;
pub mod low_resources;
pub mod model_interrupts;
pub mod msix_vectors;
pub mod nt_backend;
pub mod pci;
pub mod pnp_restart;
pub mod queue_interrupts;
pub mod report;
pub mod rng;
pub mod roundtrip;
pub mod run_process;
pub mod shutdown;
pub mod sleep_resume;
pub mod sys_driver;
pub mod test_modes;
pub mod user_program;
pub mod user_sleep_traffic;
pub mod user_wait_cancel;
pub mod vfio;
pub mod vfio_command_transport;
pub mod vfio_dma;
pub mod virtio_pci;
pub mod virtqueue;
