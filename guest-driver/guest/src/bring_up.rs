//! Bring-up of one run: find the device, open it through VFIO, set up the virtio-pci transport and its queues, then
//! run the scenario on it (smoke, the unmapped negative control, a driver scenario on the NT model, or the rng self-test).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cmdline::{Options, PciId};
use crate::driver_run::{self, DriverRun};
use crate::queue_interrupts::QueueInterrupts;
use crate::report::{progress, ConfigView, QueryDeviceView, Report};
use crate::vfio_command_transport::{command_queue, report_command_buffers, CommandQueue, VfioCommandTransport};
use crate::vfio_dma::{DmaMapper, DmaRegion, PAGE_SIZE};
use crate::virtio_pci::{QueueNotifier, VirtioPci, F_ACCESS_PLATFORM, F_VERSION_1, STATUS_ACKNOWLEDGE, STATUS_DRIVER};
use crate::virtqueue::{RingLayout, SplitQueue};
use crate::{kmsg, pci, rng, vfio};
use anyhow::{bail, ensure, Context};
use vhca_loader::pnp_sequence::PnpSequence;
use vhca_proto::{
    DeviceConfig, Opcode, CONFIG_MAGIC, DEVICE_CONFIG_SIZE, NUM_QUEUES, PCI_VENDOR_VIRTIO, QUEUE_COMMAND,
    QUEUE_DOORBELL, QUEUE_EVENT, QUEUE_SIZE,
};
use zerocopy::FromBytes;

/// QEMU's virtio-rng (modern id), the backend-less device used to prove the transport.
const PCI_DEVICE_RNG: u16 = 0x1044;
/// Upper bound on queues set up, whatever the device claims.
const MAX_QUEUES: u16 = 16;

/// What the run does. `Unmapped` is the negative control: DMA aimed at an IOVA that was never mapped must fault,
/// which shows the checks that pass `Smoke` are able to fail.
/// `Driver` runs the driver core on the NT model (scenarios/).
#[derive(Clone, Copy)]
enum Scenario {
    Smoke,
    Unmapped,
    /// Time QUERY_DEVICE against QEMU's virtio-rng (`roundtrip`); the runner's `bench --roundtrip`.
    RoundTrip,
    Driver(vhca_scenarios::Scenario),
}

impl Scenario {
    fn parse(name: &str) -> anyhow::Result<Scenario> {
        match name {
            "smoke" => Ok(Scenario::Smoke),
            "unmapped" => Ok(Scenario::Unmapped),
            "roundtrip" => Ok(Scenario::RoundTrip),
            _ => match driver_run::find(name) {
                Some(s) => Ok(Scenario::Driver(s)),
                None => {
                    let known: Vec<&str> = vhca_scenarios::Scenario::DRIVER.iter().map(|s| s.name()).collect();
                    bail!("unknown scenario {name:?} (known: smoke, unmapped, roundtrip, {})", known.join(", "))
                }
            },
        }
    }

    fn is_unmapped(self) -> bool {
        matches!(self, Scenario::Unmapped)
    }
}

/// What a driver scenario leaves for the end of the run: its queues and buffers, alive until the device is reset.
type DriverKeep = Option<(VfioCommandTransport, Option<DriverRun>)>;

/// How long the negative control waits for the IOMMU's fault report to reach the kernel log.
const FAULT_REPORT_WAIT: Duration = Duration::from_millis(500);

/// What the `roundtrip` scenario times on vhca's command queue once QUERY_DEVICE answered. The caller, which chooses
/// the modes (main.rs), passes `roundtrip::measure_into`: a bench is never imported by the code it measures.
pub type RoundTripBench<'a> =
    &'a mut dyn FnMut(&mut CommandQueue, &Options, Duration, &mut Report) -> anyhow::Result<()>;

/// What the device turned out to be, which decides what each scenario does on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TargetDevice {
    Vhca,
    Rng,
}

pub fn run(
    options: &Options,
    patience: Duration,
    report: &mut Report,
    roundtrip: RoundTripBench,
) -> anyhow::Result<()> {
    let scenario = Scenario::parse(&options.scenario)?;
    let timeout = Duration::from_millis(options.timeout_ms);
    let wanted = match options.device {
        Some(id) => vec![id],
        None => vec![
            PciId { vendor: PCI_VENDOR_VIRTIO, device: vhca_proto::PCI_DEVICE_SND_CARRIER },
            PciId { vendor: PCI_VENDOR_VIRTIO, device: vhca_proto::PCI_DEVICE_RDMA },
        ],
    };
    let hotplug = Instant::now();
    let device = pci::wait_for(&wanted, patience)?;
    // On the snapshot path this is the hot-plugged device's enumeration and vfio-pci's probe.
    report.phases_ms.push(("hotplug", hotplug.elapsed().as_secs_f64() * 1000.0));
    report.device = Some(device.id.to_string());
    report.pci_address = Some(device.address.clone());
    let target_device = if device.id.device == PCI_DEVICE_RNG { TargetDevice::Rng } else { TargetDevice::Vhca };
    progress(format_args!("found {} at {} (driver {:?})", device.id, device.address, device.driver()));

    if let Some(method) = &options.reset_method {
        device.set_reset_method(method)?;
    }
    let mut phase = Instant::now();
    let mut mark = |report: &mut Report, name: &'static str| {
        report.phases_ms.push((name, phase.elapsed().as_secs_f64() * 1000.0));
        phase = Instant::now();
    };
    device.bind_vfio()?;
    mark(report, "bind");
    let group = device.iommu_group()?;
    report.iommu_group = Some(group);
    let session = vfio::Session::open(group, &device.address).context("VFIO setup")?;
    mark(report, "vfio_open");
    // Armed before the driver starts, so the platform's request to take the device back reaches the program
    // whenever it comes (`vhca.pnp=hot-unplug`); the BARs are noted while sysfs still lists them.
    let removal = match options.pnp {
        PnpSequence::HotUnplug | PnpSequence::HotUnplugDuringTraffic => Some((
            crate::hot_unplug::RemovalRequest::arm(&session.device)?,
            crate::hot_unplug::memory_bars(&device.address),
        )),
        _ => None,
    };
    // A user process (`vhca.user`) is the loader's: its IRPs need the I/O manager the native program has not got.
    if options.user != crate::user_program::UserSequence::None && options.driver != crate::cmdline::Personality::Sys {
        bail!("vhca.user needs vhca.driver=sys: the native program has no I/O manager to send a process's IRPs");
    }
    // So is the process a rebalance or a hot-unplug lands under (`vhca.pnp=...-during-traffic`).
    if matches!(options.pnp, PnpSequence::RebalanceDuringTraffic | PnpSequence::HotUnplugDuringTraffic)
        && options.driver != crate::cmdline::Personality::Sys
    {
        bail!("vhca.pnp={:?} needs vhca.driver=sys: its user process is the loader's", options.pnp);
    }
    // So are the power modes about a user process's traffic and the D0 IRP's IRQL: natively the first would sleep
    // nothing and the second would be a plain sleep-resume, and either would pass for nothing.
    if (options.sleep_during_traffic || options.d0_at_dispatch) && options.driver != crate::cmdline::Personality::Sys {
        let mode = if options.sleep_during_traffic { "sleep-during-traffic" } else { "sleep-resume-d0-dispatch" };
        bail!("vhca.power={mode} needs vhca.driver=sys: a user process's IRPs, the D0 IRP's IRQL");
    }
    if options.driver == crate::cmdline::Personality::Sys {
        let Some((request, bars)) = removal else { return crate::sys_driver::run(&session, options, report) };
        let noticed = crate::hot_unplug::plan_for_pnp_manager(request);
        let result = crate::sys_driver::run(&session, options, report);
        // vhca.sys let go at REMOVE and the bus released its regions: the session is the program's last hold.
        drop(session);
        let took = *noticed.lock().unwrap_or_else(|e| e.into_inner());
        let Some(took) = took else { return result };
        let mut seen = crate::hot_unplug::UnplugSeen { notice_ms: took.as_secs_f64() * 1000.0, ..Default::default() };
        let removed = crate::hot_unplug::after_release(&device.address, &bars, &mut seen);
        report.details.insert("hot_unplug".into(), serde_json::to_value(&seen).unwrap_or_default());
        return result.and(removed.context("hot-unplug"));
    }
    progress(format_args!("vfio-pci bound, IOMMU group {group}, container type1v2"));
    let mapper = Arc::new(DmaMapper::new(session.container.clone()));

    let transport = VirtioPci::open(&session.device).context("virtio-pci transport")?;
    report.mmio = Some(if transport.mmio_mapped() { "mmap" } else { "pread" });
    transport.reset(timeout)?;
    transport.add_status(STATUS_ACKNOWLEDGE)?;
    transport.add_status(STATUS_DRIVER)?;
    let features = transport.negotiate(F_VERSION_1 | F_ACCESS_PLATFORM, 0)?;
    report.features = Some(format!("{features:#x}"));

    let num_queues = transport.num_queues()?;
    report.num_queues = Some(num_queues);
    if target_device == TargetDevice::Vhca {
        ensure!(num_queues >= NUM_QUEUES, "device has {num_queues} queues, vhca needs {NUM_QUEUES}");
    }
    let queue_count = num_queues.min(MAX_QUEUES);
    let mut interrupts =
        QueueInterrupts::for_run(options.completion, &session.device, &transport, queue_count, report)?;
    // Every queue the device has is set up: QEMU pre-sends an IOTLB update for each used ring at DRIVER_OK.
    let mut queues = Vec::new();
    for index in 0..queue_count {
        let (mut queue, notifier) = setup_queue(&transport, &mapper, index)?;
        if let Some(interrupts) = interrupts.as_mut() {
            interrupts.attach(index, &mut queue);
        }
        report.iovas.rings.push(queue.ring_iovas());
        queues.push(Some((queue, notifier)));
    }
    transport.driver_ok()?;
    mark(report, "virtio_init");
    progress(format_args!(
        "DRIVER_OK: features {features:#x}, {num_queues} queues, registers {}",
        report.mmio.unwrap_or("?")
    ));

    let mut commands = None;
    let mut driver: DriverKeep = None;
    let result = match (target_device, scenario) {
        (TargetDevice::Vhca, Scenario::Driver(s)) => {
            let messages = model_messages(interrupts.as_ref());
            driver_scenario(s, options, &transport, &mut queues, &mut driver, &mapper, timeout, report, messages)
        }
        // With the verifier on, smoke is the driver core under the NT model, so its checks run.
        (TargetDevice::Vhca, Scenario::Smoke) if options.verifier.enabled() => driver_scenario(
            vhca_scenarios::Scenario::Smoke,
            options,
            &transport,
            &mut queues,
            &mut driver,
            &mapper,
            timeout,
            report,
            model_messages(interrupts.as_ref()),
        ),
        (TargetDevice::Vhca, _) => {
            vhca(scenario, options, &transport, &mut queues, &mut commands, &mapper, timeout, report, roundtrip)
        }
        (TargetDevice::Rng, Scenario::Driver(s)) => Err(anyhow::anyhow!("{} needs the vhca device", s.name())),
        (TargetDevice::Rng, _) => self_test_rng(scenario, &mut queues, &mapper, timeout, report),
    };
    mark(report, "scenario");
    // D3 (vhca.sys quiesces the device) and STOP or REMOVE (it releases it) leave the device here alike: the reset
    // first, then the rings and buffers it had go, and a bring-up from nothing, proved by QUERY_DEVICE. The VFIO BAR
    // mappings and MSI-X eventfds stay: the guest program is its own bus driver, and their release is vhca.sys's
    // side of the rule.
    let mut reinitialise = |step: &str, rounds: u32| -> (u32, anyhow::Result<()>) {
        let mut done = 0;
        let result = (0..rounds).try_for_each(|_| {
            transport.reset(timeout).with_context(|| format!("{step}: reset"))?;
            commands = None;
            driver = None;
            queues.clear();
            let up = crate::sleep_resume::power_up(&transport, &mapper, interrupts.as_mut(), queue_count, timeout)?;
            queues = up.queues;
            commands = Some(up.commands);
            done += 1;
            anyhow::Ok(())
        });
        (done, result)
    };
    let result = match result {
        Ok(()) if options.sleep_resume > 0 => {
            let (cycles, slept) = reinitialise("D3", options.sleep_resume);
            report.details.insert("power".into(), serde_json::json!({ "sleep_resume_cycles": cycles }));
            slept.context("sleep/resume")
        }
        other => other,
    };
    let result = match result {
        Ok(()) if crate::pnp_restart::restarts(options.pnp) > 0 => {
            let (restarts, restarted) = reinitialise("STOP", crate::pnp_restart::restarts(options.pnp));
            report.details.insert("pnp".into(), serde_json::json!({ "native_restarts": restarts }));
            restarted.context("PnP stop/start")
        }
        other => other,
    };
    // A real hot-unplug once the scenario is done: the surprise path, vhca.sys's at IRP_MN_SURPRISE_REMOVAL. Under
    // QEMU's ACPI hot-plug the function stays until the guest let go of it, and its backend still runs the rings: so
    // the reset below still reaches it (a function really gone reads all ones and ends the reset at its first read,
    // vhca-virtio's DeviceGone), then the rings and buffers go, then the program lets go (no power-off shortcut:
    // the kernel's removal waits for it).
    let mut unplugged = None;
    let result = match (result, removal.as_ref()) {
        (Ok(()), Some((request, _))) => request
            .ask_and_wait()
            .map(|took| {
                unplugged =
                    Some(crate::hot_unplug::UnplugSeen { notice_ms: took.as_secs_f64() * 1000.0, ..Default::default() })
            })
            .context("hot-unplug"),
        (other, _) => other,
    };
    // Stop the device before its rings and buffers are unmapped (dropped), so it cannot DMA into freed IOVAs.
    let reset = transport.reset(timeout);
    drop(commands);
    drop(driver);
    drop(queues);
    report.interrupts = interrupts.map(QueueInterrupts::finish);
    report.kernel_log = kmsg::iommu_lines(32);
    let deadline = Instant::now() + FAULT_REPORT_WAIT;
    let own = Some(device.address.as_str());
    while scenario.is_unmapped() && kmsg::count_faults(&report.kernel_log, own) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        report.kernel_log = kmsg::iommu_lines(32);
    }
    report.iommu_faults = kmsg::count_faults(&report.kernel_log, own);
    // Closing the device fd makes vfio-pci reset the device once more, and dropping the mapper unmaps every buffer.
    // Neither checks anything, and a machine about to power off makes both moot: then they are skipped (the device
    // was reset and checked above; the event log is complete up to here).
    if options.poweroff && unplugged.is_none() {
        std::mem::forget((mapper, transport, session));
    } else {
        drop(mapper);
        drop(transport);
        drop(session);
    }
    if let (Some(mut seen), Some((request, bars))) = (unplugged, removal) {
        drop(request);
        let removed = crate::hot_unplug::after_release(&device.address, &bars, &mut seen);
        report.details.insert("hot_unplug".into(), serde_json::to_value(&seen).unwrap_or_default());
        removed.context("hot-unplug")?;
    }
    mark(report, "teardown");
    result?;
    reset.context("reset at the end")?;
    match (scenario, target_device) {
        (Scenario::Smoke | Scenario::RoundTrip, _) => {
            ensure!(report.iommu_faults == 0, "{} IOMMU fault line(s) in the kernel log", report.iommu_faults)
        }
        // Both QEMU's own devices and a vhost-user backend's IOTLB miss go through the vIOMMU's translation, which
        // reports the refused IOVA to the guest (measured for virtio-rng and vhca): no fault line means no check.
        (Scenario::Unmapped, _) => {
            ensure!(report.iommu_faults > 0, "DMA to an unmapped IOVA left no IOMMU fault in the kernel log")
        }
        // IOMMU faults are part of some driver scenarios' story (use-after-unmap); the count is reported.
        (Scenario::Driver(_), _) => {}
    }
    Ok(())
}

pub type Queue = (SplitQueue<DmaRegion>, QueueNotifier);

/// The messages the native driver's NT model gets, when the run has interrupts.
fn model_messages(interrupts: Option<&QueueInterrupts>) -> Option<driver_run::ModelMessages> {
    interrupts.map(|i| driver_run::ModelMessages { sink: i.model_sink(), count: i.message_count() })
}

pub fn setup_queue(transport: &VirtioPci, mapper: &DmaMapper, index: u16) -> anyhow::Result<Queue> {
    let max = transport.queue_max_size(index)?;
    ensure!(max > 0, "queue {index} has size 0");
    // Split rings need a power of two; take the largest one the device allows, capped at the carrier's size.
    let size = 1u16 << (15 - max.min(QUEUE_SIZE).leading_zeros().min(15));
    let layout = RingLayout::new(size)?;
    let memory = mapper.alloc(layout.bytes, vfio::DmaAccess::READ_WRITE)?;
    let queue = SplitQueue::new(size, memory)?;
    let notifier = transport.setup_queue(index, size, queue.ring_iovas())?;
    Ok((queue, notifier))
}

fn read_config(transport: &VirtioPci, report: &mut Report) -> anyhow::Result<DeviceConfig> {
    let raw = transport.read_device_config(DEVICE_CONFIG_SIZE)?.context("device has no device-config capability")?;
    let config =
        DeviceConfig::read_from_bytes(&raw).map_err(|_| anyhow::anyhow!("device config of {} bytes", raw.len()))?;
    report.config = Some(ConfigView::from(&config));
    if config.magic.get() != CONFIG_MAGIC {
        bail!(
            "device config magic {:#010x}, expected {CONFIG_MAGIC:#010x} (\"VHCA\"): not a vhca backend",
            config.magic.get()
        );
    }
    Ok(config)
}

/// The driver core over the three queues, on an NT model whose DMA goes through VFIO.
#[allow(clippy::too_many_arguments)]
fn driver_scenario(
    scenario: vhca_scenarios::Scenario,
    options: &Options,
    transport: &VirtioPci,
    queues: &mut [Option<Queue>],
    keep: &mut DriverKeep,
    mapper: &Arc<DmaMapper>,
    timeout: Duration,
    report: &mut Report,
    messages: Option<driver_run::ModelMessages>,
) -> anyhow::Result<()> {
    read_config(transport, report)?;
    let mut take =
        |index: u16| queues.get_mut(index as usize).and_then(Option::take).with_context(|| format!("no queue {index}"));
    let (cq, cn) = take(QUEUE_COMMAND)?;
    let (eq, en) = take(QUEUE_EVENT)?;
    let (dq, dn) = take(QUEUE_DOORBELL)?;
    let commands = command_queue(cq, cn, mapper, timeout)?;
    report_command_buffers(&commands, report);
    let channel = VfioCommandTransport::new(commands, (eq, en), (dq, dn), mapper, timeout)?;
    *keep = Some((channel.clone(), None));
    let sink = Arc::new(Mutex::new(report.clone()));
    progress(format_args!("driver scenario {}", scenario.name()));
    let (run, result) = driver_run::run(scenario, options, channel, mapper.clone(), sink.clone(), timeout, messages);
    if let Some(k) = keep.as_mut() {
        k.1 = run;
    }
    *report = sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
    result
}

#[allow(clippy::too_many_arguments)]
fn vhca(
    scenario: Scenario,
    options: &Options,
    transport: &VirtioPci,
    queues: &mut [Option<Queue>],
    commands: &mut Option<CommandQueue>,
    mapper: &DmaMapper,
    timeout: Duration,
    report: &mut Report,
    roundtrip: RoundTripBench,
) -> anyhow::Result<()> {
    read_config(transport, report)?;
    let (queue, notifier) = queues.first_mut().and_then(Option::take).context("no command queue")?;
    // Kept by the caller until the device is reset, so a late completion never lands in unmapped memory.
    let commands = commands.insert(command_queue(queue, notifier, mapper, timeout)?);
    report_command_buffers(commands, report);
    if scenario.is_unmapped() {
        let iova = mapper.reserve_iova(PAGE_SIZE)?;
        report.iovas.resp = Some(iova);
        return match commands.execute_to(Opcode::QueryDevice, &[], Some(iova)) {
            Ok(response) => bail!("QUERY_DEVICE answered {:?} through unmapped IOVA {iova:#x}", response.header),
            Err(e) => {
                progress(format_args!("QUERY_DEVICE into unmapped IOVA {iova:#x} failed as it must: {e}"));
                report.expected_failure = Some(e.to_string());
                Ok(())
            }
        };
    }
    let (resp, response) = commands.query_device()?;
    progress(format_args!(
        "QUERY_DEVICE: abi {}, {} map registers ({} free), max_qp {}",
        resp.abi_version.get(),
        resp.map_registers_total.get(),
        resp.map_registers_free.get(),
        resp.max_qp.get()
    ));
    report.query_device = Some(QueryDeviceView::new(&resp, response.header.tag.get(), response.used_len));
    if matches!(scenario, Scenario::RoundTrip) {
        roundtrip(commands, options, timeout, report)?;
    }
    Ok(())
}

fn self_test_rng(
    scenario: Scenario,
    queues: &mut [Option<Queue>],
    mapper: &DmaMapper,
    timeout: Duration,
    report: &mut Report,
) -> anyhow::Result<()> {
    let (queue, notifier) = queues.first_mut().and_then(Option::as_mut).context("no request queue")?;
    if scenario.is_unmapped() {
        let read = rng::read_entropy_unmapped(queue, notifier, mapper, timeout)?;
        progress(format_args!("entropy into unmapped IOVA {:#x}: completion of {} bytes", read.iova, read.used_len));
        report.rng = Some(read);
        return Ok(());
    }
    let read = rng::read_entropy(queue, notifier, mapper, timeout)?;
    progress(format_args!("entropy: {} bytes at IOVA {:#x}: {}", read.used_len, read.iova, &read.bytes_hex[..16]));
    report.rng = Some(read);
    Ok(())
}
