//! The VFIO user-space API from the guest's side: container (type1 IOMMU), group, device fd, its regions and its
//! interrupts as eventfds. Only the ioctls a user-space driver needs; struct layouts come from `vfio-bindings`, ioctl
//! numbers are made here.
//!
//! Why not `vfio-ioctls`: that crate is written for VMMs. Its container wants a KVM device fd or mshv for the
//! KVM-VFIO pseudo device, its DMA mapping API is keyed to guest memory it owns, and it pulls vmm-sys-util and
//! KVM bindings into what must be a small static binary. A guest driver needs ten ioctls and its own choice of
//! IOVAs, so the raw bindings (`vfio-bindings`, which has the layouts but no ioctl numbers) fit better.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio as sys;

#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error("open {path}: {source}")]
    Open { path: String, source: std::io::Error },
    #[error("{what}: {source}")]
    Ioctl { what: &'static str, source: std::io::Error },
    #[error("VFIO API version {0}, this program speaks {expected}", expected = sys::VFIO_API_VERSION)]
    ApiVersion(i32),
    #[error("the kernel's VFIO has no type1v2 IOMMU (is vfio_iommu_type1 loaded?)")]
    NoType1v2,
    #[error("IOMMU group {0} is not viable: another device in it is not bound to vfio-pci")]
    GroupNotViable(u32),
    #[error("region {index}: {what} at offset {offset:#x} (+{len}) outside its {size:#x} bytes")]
    OutOfRange { index: u32, what: &'static str, offset: u64, len: usize, size: u64 },
    #[error("region {index}: {len}-byte access at {offset:#x} is not naturally aligned")]
    Misaligned { index: u32, offset: u64, len: usize },
    #[error("region {index}: {op} at {offset:#x}: {source}")]
    Io { index: u32, op: &'static str, offset: u64, source: std::io::Error },
    #[error("region {index} cannot be read or written (flags {flags:#x})")]
    NoAccess { index: u32, flags: u32 },
}

// ioctl numbers: _IO(VFIO_TYPE, VFIO_BASE + n), i.e. no direction or size bits, as include/uapi/linux/vfio.h has it.
const fn vfio_io(n: u32) -> u64 {
    ((sys::VFIO_TYPE as u64) << 8) | (sys::VFIO_BASE + n) as u64
}
const VFIO_GET_API_VERSION: u64 = vfio_io(0);
const VFIO_CHECK_EXTENSION: u64 = vfio_io(1);
const VFIO_SET_IOMMU: u64 = vfio_io(2);
const VFIO_GROUP_GET_STATUS: u64 = vfio_io(3);
const VFIO_GROUP_SET_CONTAINER: u64 = vfio_io(4);
const VFIO_GROUP_GET_DEVICE_FD: u64 = vfio_io(6);
const VFIO_DEVICE_GET_REGION_INFO: u64 = vfio_io(8);
const VFIO_DEVICE_GET_IRQ_INFO: u64 = vfio_io(9);
const VFIO_DEVICE_SET_IRQS: u64 = vfio_io(10);
const VFIO_IOMMU_MAP_DMA: u64 = vfio_io(13);
const VFIO_IOMMU_UNMAP_DMA: u64 = vfio_io(14);

/// Region index of PCI config space on a vfio-pci device.
pub const CONFIG_REGION: u32 = sys::VFIO_PCI_CONFIG_REGION_INDEX;
/// Interrupt index of MSI-X on a vfio-pci device: one interrupt per MSI-X table entry.
pub const MSIX_IRQ_INDEX: u32 = sys::VFIO_PCI_MSIX_IRQ_INDEX;
/// Interrupt index of vfio-pci's request notifier: one eventfd, signalled when the kernel wants the device back.
pub const REQ_IRQ_INDEX: u32 = sys::VFIO_PCI_REQ_IRQ_INDEX;

fn ioctl(file: &File, what: &'static str, request: u64, arg: libc::c_ulong) -> Result<i32, VfioError> {
    // SAFETY: every caller passes a request number from the VFIO uapi together with the argument that request
    // expects (an integer, or a pointer to a live, correctly sized and initialised struct or C string).
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), request as _, arg) };
    if rc < 0 {
        Err(VfioError::Ioctl { what, source: std::io::Error::last_os_error() })
    } else {
        Ok(rc)
    }
}

fn open_rw(path: &str) -> Result<File, VfioError> {
    OpenOptions::new().read(true).write(true).open(path).map_err(|source| VfioError::Open { path: path.into(), source })
}

/// Which directions the device may use a DMA mapping for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaAccess {
    pub device_reads: bool,
    pub device_writes: bool,
}

impl DmaAccess {
    pub const READ_WRITE: DmaAccess = DmaAccess { device_reads: true, device_writes: true };
}

/// A type1v2 IOMMU container: the guest-side IOMMU domain every mapping of ours goes into.
#[derive(Debug)]
pub struct Container {
    file: File,
}

impl Container {
    pub fn open() -> Result<Container, VfioError> {
        let file = open_rw("/dev/vfio/vfio")?;
        let version = ioctl(&file, "VFIO_GET_API_VERSION", VFIO_GET_API_VERSION, 0)?;
        if version != sys::VFIO_API_VERSION as i32 {
            return Err(VfioError::ApiVersion(version));
        }
        if ioctl(&file, "VFIO_CHECK_EXTENSION", VFIO_CHECK_EXTENSION, sys::VFIO_TYPE1v2_IOMMU as _)? != 1 {
            return Err(VfioError::NoType1v2);
        }
        Ok(Container { file })
    }

    /// Only valid once a group is attached: the kernel picks the IOMMU driver for the groups it has.
    fn set_iommu_type1v2(&self) -> Result<(), VfioError> {
        ioctl(&self.file, "VFIO_SET_IOMMU(TYPE1v2)", VFIO_SET_IOMMU, sys::VFIO_TYPE1v2_IOMMU as _).map(drop)
    }

    /// Maps `size` bytes of this process at `vaddr` to `iova` for the device. The kernel pins the pages.
    pub fn map_dma(&self, vaddr: u64, iova: u64, size: u64, access: DmaAccess) -> Result<(), VfioError> {
        let mut flags = 0;
        if access.device_reads {
            flags |= sys::VFIO_DMA_MAP_FLAG_READ;
        }
        if access.device_writes {
            flags |= sys::VFIO_DMA_MAP_FLAG_WRITE;
        }
        let map = sys::vfio_iommu_type1_dma_map {
            argsz: std::mem::size_of::<sys::vfio_iommu_type1_dma_map>() as u32,
            flags,
            vaddr,
            iova,
            size,
        };
        ioctl(&self.file, "VFIO_IOMMU_MAP_DMA", VFIO_IOMMU_MAP_DMA, &map as *const _ as libc::c_ulong).map(drop)
    }

    /// Removes the mapping at `iova`; returns how many bytes the kernel unmapped.
    pub fn unmap_dma(&self, iova: u64, size: u64) -> Result<u64, VfioError> {
        let mut unmap = sys::vfio_iommu_type1_dma_unmap {
            argsz: std::mem::size_of::<sys::vfio_iommu_type1_dma_unmap>() as u32,
            flags: 0,
            iova,
            size,
            data: Default::default(),
        };
        ioctl(&self.file, "VFIO_IOMMU_UNMAP_DMA", VFIO_IOMMU_UNMAP_DMA, &mut unmap as *mut _ as libc::c_ulong)?;
        Ok(unmap.size)
    }
}

/// An IOMMU group, held open for as long as its device is used.
#[derive(Debug)]
pub struct Group {
    file: File,
    pub number: u32,
}

impl Group {
    pub fn open(number: u32) -> Result<Group, VfioError> {
        let file = open_rw(&format!("/dev/vfio/{number}"))?;
        let mut status =
            sys::vfio_group_status { argsz: std::mem::size_of::<sys::vfio_group_status>() as u32, flags: 0 };
        ioctl(&file, "VFIO_GROUP_GET_STATUS", VFIO_GROUP_GET_STATUS, &mut status as *mut _ as libc::c_ulong)?;
        if status.flags & sys::VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(VfioError::GroupNotViable(number));
        }
        Ok(Group { file, number })
    }

    fn set_container(&self, container: &Container) -> Result<(), VfioError> {
        let fd: libc::c_int = container.file.as_raw_fd();
        ioctl(&self.file, "VFIO_GROUP_SET_CONTAINER", VFIO_GROUP_SET_CONTAINER, &fd as *const _ as libc::c_ulong)
            .map(drop)
    }

    fn device(&self, address: &str) -> Result<File, VfioError> {
        let name = CString::new(address).map_err(|_| VfioError::Open {
            path: address.into(),
            source: std::io::Error::from(std::io::ErrorKind::InvalidInput),
        })?;
        let fd = ioctl(&self.file, "VFIO_GROUP_GET_DEVICE_FD", VFIO_GROUP_GET_DEVICE_FD, name.as_ptr() as _)?;
        // SAFETY: the ioctl succeeded, so `fd` is a new file descriptor that nothing else owns.
        Ok(unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) })
    }
}

/// Where one region lives in the device fd's offset space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    pub index: u32,
    pub flags: u32,
    pub size: u64,
    pub offset: u64,
}

impl RegionInfo {
    pub fn mmappable(&self) -> bool {
        self.flags & sys::VFIO_REGION_INFO_FLAG_MMAP != 0
    }
}

/// One of the device's interrupt indexes (INTx, MSI, MSI-X, ...) as VFIO describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IrqInfo {
    pub index: u32,
    pub flags: u32,
    /// Interrupts under this index (for MSI-X: the device's table size; 0: the device has none).
    pub count: u32,
}

impl IrqInfo {
    pub fn signals_eventfds(&self) -> bool {
        self.flags & sys::VFIO_IRQ_INFO_EVENTFD != 0
    }
}

// VFIO_DEVICE_SET_IRQS takes a vfio_irq_set followed by its data (here: one eventfd, an s32, per interrupt): the
// header's fields are all u32, so a u32 buffer holds it aligned, and the data starts right after it.
const IRQ_SET_HEADER: usize = std::mem::size_of::<sys::vfio_irq_set>();
const _: () =
    assert!(std::mem::offset_of!(sys::vfio_irq_set, data) == IRQ_SET_HEADER && IRQ_SET_HEADER.is_multiple_of(4));

/// The argument of VFIO_DEVICE_SET_IRQS for interrupts `0..eventfds.len()` of `index`, as u32 words.
fn irq_set_request(flags: u32, index: u32, eventfds: &[RawFd]) -> Vec<u32> {
    let argsz = IRQ_SET_HEADER + std::mem::size_of_val(eventfds);
    let header = sys::vfio_irq_set {
        argsz: argsz as u32,
        flags,
        index,
        start: 0,
        count: eventfds.len() as u32,
        data: Default::default(),
    };
    let mut words = vec![0u32; argsz / 4];
    // SAFETY: `words` holds at least IRQ_SET_HEADER bytes and is u32-aligned, as the all-u32 header is; the header
    // is plain data read as bytes, and the two do not overlap.
    unsafe {
        std::ptr::copy_nonoverlapping(
            (&header as *const sys::vfio_irq_set).cast::<u8>(),
            words.as_mut_ptr().cast(),
            IRQ_SET_HEADER,
        )
    };
    for (word, fd) in words[IRQ_SET_HEADER / 4..].iter_mut().zip(eventfds) {
        *word = *fd as u32;
    }
    words
}

/// The device fd: config space, BARs, interrupts and reset all go through it.
#[derive(Debug)]
pub struct Device {
    file: Arc<File>,
    pub address: String,
}

/// Everything VFIO hands out for one device. Field order is drop order: the device closes before its group,
/// the group before the container.
#[derive(Debug)]
pub struct Session {
    pub device: Device,
    pub group: Group,
    pub container: Arc<Container>,
}

/// How long vfio-pci's probe of a freshly bound (hot-plugged) device may take to finish.
const PROBE_PATIENCE: Duration = Duration::from_secs(2);

impl VfioError {
    /// The kernel links a device to its driver in sysfs before it calls the driver's probe, so right after a bind
    /// (above all a hot-plug) vfio-pci may not have made `/dev/vfio/<group>` yet (seen: "open /dev/vfio/3: No such
    /// file or directory"), or not yet put the device in its group (seen: "VFIO_GROUP_GET_DEVICE_FD: No such
    /// device"). Both end when the probe does.
    fn is_probe_in_progress(&self) -> bool {
        match self {
            VfioError::Open { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
            VfioError::Ioctl { what, source } => {
                *what == "VFIO_GROUP_GET_DEVICE_FD" && source.raw_os_error() == Some(libc::ENODEV)
            }
            _ => false,
        }
    }
}

/// Runs `attempt` until it succeeds, fails for a reason other than a probe still in progress, or `patience` is out.
fn retry_while_probing<T>(
    patience: Duration,
    mut attempt: impl FnMut() -> Result<T, VfioError>,
) -> Result<T, VfioError> {
    let deadline = Instant::now() + patience;
    loop {
        match attempt() {
            Err(err) if err.is_probe_in_progress() && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(2));
            }
            other => return other,
        }
    }
}

impl Session {
    /// Opens the device's VFIO session, waiting out the end of vfio-pci's probe (see `is_probe_in_progress`).
    pub fn open(group_number: u32, address: &str) -> Result<Session, VfioError> {
        retry_while_probing(PROBE_PATIENCE, || Session::open_once(group_number, address))
    }

    /// The fixed order the kernel demands: container, group, attach, choose the IOMMU, then the device.
    fn open_once(group_number: u32, address: &str) -> Result<Session, VfioError> {
        let container = Container::open()?;
        let group = Group::open(group_number)?;
        group.set_container(&container)?;
        container.set_iommu_type1v2()?;
        let file = Arc::new(group.device(address)?);
        Ok(Session { device: Device { file, address: address.into() }, group, container: Arc::new(container) })
    }
}

impl Device {
    pub fn region_info(&self, index: u32) -> Result<RegionInfo, VfioError> {
        let mut info = sys::vfio_region_info {
            argsz: std::mem::size_of::<sys::vfio_region_info>() as u32,
            flags: 0,
            index,
            cap_offset: 0,
            size: 0,
            offset: 0,
        };
        ioctl(&self.file, "VFIO_DEVICE_GET_REGION_INFO", VFIO_DEVICE_GET_REGION_INFO, &mut info as *mut _ as _)?;
        Ok(RegionInfo { index, flags: info.flags, size: info.size, offset: info.offset })
    }

    pub fn irq_info(&self, index: u32) -> Result<IrqInfo, VfioError> {
        let mut info =
            sys::vfio_irq_info { argsz: std::mem::size_of::<sys::vfio_irq_info>() as u32, flags: 0, index, count: 0 };
        ioctl(&self.file, "VFIO_DEVICE_GET_IRQ_INFO", VFIO_DEVICE_GET_IRQ_INFO, &mut info as *mut _ as _)?;
        Ok(IrqInfo { index, flags: info.flags, count: info.count })
    }

    /// Has the kernel signal `eventfds[i]` for interrupt i of `index`. For MSI-X, vfio-pci enables MSI-X in the
    /// device with that many table entries and writes their messages: the guest kernel owns the MSI-X table.
    pub fn set_irq_eventfds(&self, index: u32, eventfds: &[BorrowedFd<'_>]) -> Result<(), VfioError> {
        let fds: Vec<RawFd> = eventfds.iter().map(AsRawFd::as_raw_fd).collect();
        let flags = sys::VFIO_IRQ_SET_DATA_EVENTFD | sys::VFIO_IRQ_SET_ACTION_TRIGGER;
        let request = irq_set_request(flags, index, &fds);
        ioctl(&self.file, "VFIO_DEVICE_SET_IRQS(eventfds)", VFIO_DEVICE_SET_IRQS, request.as_ptr() as _).map(drop)
    }

    /// Removes every trigger of `index`; for MSI-X, vfio-pci disables MSI-X in the device and lets the eventfds go.
    pub fn disable_irqs(&self, index: u32) -> Result<(), VfioError> {
        let request = irq_set_request(sys::VFIO_IRQ_SET_DATA_NONE | sys::VFIO_IRQ_SET_ACTION_TRIGGER, index, &[]);
        ioctl(&self.file, "VFIO_DEVICE_SET_IRQS(disable)", VFIO_DEVICE_SET_IRQS, request.as_ptr() as _).map(drop)
    }

    /// Opens a region for register access: mmapped when VFIO allows it, else through pread/pwrite on the fd.
    pub fn region(&self, index: u32) -> Result<Region, VfioError> {
        let info = self.region_info(index)?;
        let rw = sys::VFIO_REGION_INFO_FLAG_READ | sys::VFIO_REGION_INFO_FLAG_WRITE;
        if info.flags & rw != rw || info.size == 0 {
            return Err(VfioError::NoAccess { index, flags: info.flags });
        }
        let mapping = if info.mmappable() { self.mmap(&info) } else { None };
        Ok(Region { info, file: self.file.clone(), mapping })
    }

    fn mmap(&self, info: &RegionInfo) -> Option<Mapping> {
        map_region(&self.file, info.offset, usize::try_from(info.size).ok()?)
    }
}

/// `len` bytes of the device fd's region space from `offset`, shared, read/write.
fn map_region(file: &File, offset: u64, len: usize) -> Option<Mapping> {
    let offset = libc::off_t::try_from(offset).ok()?;
    // SAFETY: a fresh shared mapping of the device fd chosen by the kernel (null hint); no existing memory is
    // touched. The result is checked before use and unmapped exactly once in `Mapping::drop` (or by the owner
    // `Region::second_mapping` hands it to).
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            offset,
        )
    };
    if ptr == libc::MAP_FAILED {
        return None;
    }
    NonNull::new(ptr.cast::<u8>()).map(|ptr| Mapping { ptr, len })
}

#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned, and no reference into the mapping outlives `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Register access to one region (a BAR or config space). Every access is bounds- and alignment-checked, so
/// offsets read from the device's own capabilities cannot reach outside the region.
#[derive(Debug)]
pub struct Region {
    info: RegionInfo,
    file: Arc<File>,
    mapping: Option<Mapping>,
}

// SAFETY: the mapping is device memory accessed only with volatile loads and stores of whole registers; the
// device, not Rust aliasing rules, decides what concurrent accesses mean, as for any MMIO register.
unsafe impl Send for Region {}
// SAFETY: as for Send: shared access only performs volatile MMIO or pread/pwrite, never hands out references.
unsafe impl Sync for Region {}

macro_rules! region_access {
    ($read:ident, $write:ident, $ty:ty) => {
        pub fn $read(&self, offset: u64) -> Result<$ty, VfioError> {
            let mut bytes = [0u8; std::mem::size_of::<$ty>()];
            match self.checked(offset, bytes.len(), "read")? {
                // SAFETY: `checked` proved offset..offset+size lies inside the mapping and is naturally aligned.
                Some(ptr) => Ok(unsafe { std::ptr::read_volatile(ptr.cast::<$ty>()) }),
                None => {
                    self.pread(offset, &mut bytes)?;
                    Ok(<$ty>::from_le_bytes(bytes))
                }
            }
        }

        pub fn $write(&self, offset: u64, value: $ty) -> Result<(), VfioError> {
            match self.checked(offset, std::mem::size_of::<$ty>(), "write")? {
                // SAFETY: `checked` proved offset..offset+size lies inside the mapping and is naturally aligned.
                Some(ptr) => Ok(unsafe { std::ptr::write_volatile(ptr.cast::<$ty>(), value) }),
                None => self.pwrite(offset, &value.to_le_bytes()),
            }
        }
    };
}

impl Region {
    pub fn info(&self) -> &RegionInfo {
        &self.info
    }

    /// Where the region is mapped in this process, when it is (a driver binary reads its registers there).
    pub fn mapped_ptr(&self) -> Option<*mut u8> {
        self.mapping.as_ref().map(|m| m.ptr.as_ptr())
    }

    pub fn is_mapped(&self) -> bool {
        self.mapping.is_some()
    }

    /// A second mapping of the region's pages from `offset` (page-aligned), `len` bytes: the same registers at
    /// another address, which the caller owns and unmaps (the PE loader's race watch steps the driver's trapped
    /// register accesses through it while the first mapping stays inaccessible). None when the region is not
    /// mapped or the range is not whole pages inside it.
    pub fn second_mapping(&self, offset: u64, len: usize) -> Option<*mut u8> {
        let page = crate::vfio_dma::PAGE_SIZE as u64;
        let inside = offset.checked_add(len as u64).is_some_and(|end| end <= self.info.size);
        if self.mapping.is_none() || !inside || !offset.is_multiple_of(page) || !(len as u64).is_multiple_of(page) {
            return None;
        }
        let mapping = map_region(&self.file, self.info.offset + offset, len)?;
        let ptr = mapping.ptr.as_ptr();
        std::mem::forget(mapping);
        Some(ptr)
    }

    /// Validates an access; returns the host pointer when the region is mapped.
    fn checked(&self, offset: u64, len: usize, what: &'static str) -> Result<Option<*mut u8>, VfioError> {
        let index = self.info.index;
        self.checked_range(offset, len, what)?;
        if !offset.is_multiple_of(len as u64) {
            return Err(VfioError::Misaligned { index, offset, len });
        }
        // The range check above bounds offset by the mapping length, a usize, so the cast is lossless.
        Ok(self.mapping.as_ref().map(|m| m.ptr.as_ptr().wrapping_add(offset as usize)))
    }

    /// Reads bytes through the fd, whatever the mapping: config space is never mapped.
    pub fn pread(&self, offset: u64, buf: &mut [u8]) -> Result<(), VfioError> {
        self.checked_range(offset, buf.len(), "pread")?;
        self.file.read_exact_at(buf, self.info.offset + offset).map_err(|source| VfioError::Io {
            index: self.info.index,
            op: "pread",
            offset,
            source,
        })
    }

    pub fn pwrite(&self, offset: u64, buf: &[u8]) -> Result<(), VfioError> {
        self.checked_range(offset, buf.len(), "pwrite")?;
        self.file.write_all_at(buf, self.info.offset + offset).map_err(|source| VfioError::Io {
            index: self.info.index,
            op: "pwrite",
            offset,
            source,
        })
    }

    fn checked_range(&self, offset: u64, len: usize, what: &'static str) -> Result<(), VfioError> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.info.size => Ok(()),
            _ => Err(VfioError::OutOfRange { index: self.info.index, what, offset, len, size: self.info.size }),
        }
    }

    region_access!(read_u8, write_u8, u8);
    region_access!(read_u16, write_u16, u16);
    region_access!(read_u32, write_u32, u32);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enodev() -> VfioError {
        VfioError::Ioctl { what: "VFIO_GROUP_GET_DEVICE_FD", source: std::io::Error::from_raw_os_error(libc::ENODEV) }
    }

    #[test]
    fn a_probe_in_progress_is_waited_out_and_other_errors_are_not() {
        let mut tries = 0;
        let opened = retry_while_probing(Duration::from_secs(5), || {
            tries += 1;
            match tries {
                1 => Err(VfioError::Open { path: "/dev/vfio/3".into(), source: std::io::ErrorKind::NotFound.into() }),
                2 => Err(enodev()),
                _ => Ok(tries),
            }
        });
        assert_eq!(opened.unwrap(), 3);

        let mut tries = 0;
        let refused = retry_while_probing(Duration::from_secs(5), || -> Result<(), _> {
            tries += 1;
            Err(VfioError::GroupNotViable(3))
        });
        assert!(matches!(refused, Err(VfioError::GroupNotViable(3))) && tries == 1, "no retry for a real refusal");

        let started = Instant::now();
        let gone = retry_while_probing(Duration::from_millis(30), || -> Result<(), _> { Err(enodev()) });
        assert!(matches!(gone, Err(VfioError::Ioctl { .. })), "still an error once patience is out");
        assert!(started.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn an_irq_set_request_is_the_header_then_one_fd_per_interrupt() {
        let flags = sys::VFIO_IRQ_SET_DATA_EVENTFD | sys::VFIO_IRQ_SET_ACTION_TRIGGER;
        // argsz, flags, index, start, count, then the fds: struct vfio_irq_set of include/uapi/linux/vfio.h.
        assert_eq!(irq_set_request(flags, MSIX_IRQ_INDEX, &[7, 9]), vec![28, 0x24, 2, 0, 2, 7, 9]);
        let disable = sys::VFIO_IRQ_SET_DATA_NONE | sys::VFIO_IRQ_SET_ACTION_TRIGGER;
        assert_eq!(irq_set_request(disable, MSIX_IRQ_INDEX, &[]), vec![20, 0x21, 2, 0, 0]);
    }

    #[test]
    fn ioctl_numbers_match_the_kernel_header() {
        // Values of the _IO(';', 100 + n) macros as compiled from include/uapi/linux/vfio.h.
        assert_eq!(VFIO_GET_API_VERSION, 0x3b64);
        assert_eq!(VFIO_SET_IOMMU, 0x3b66);
        assert_eq!(VFIO_GROUP_GET_DEVICE_FD, 0x3b6a);
        assert_eq!(VFIO_DEVICE_GET_REGION_INFO, 0x3b6c);
        assert_eq!(VFIO_DEVICE_GET_IRQ_INFO, 0x3b6d);
        assert_eq!(VFIO_DEVICE_SET_IRQS, 0x3b6e);
        assert_eq!(VFIO_IOMMU_MAP_DMA, 0x3b71);
        assert_eq!(VFIO_IOMMU_UNMAP_DMA, 0x3b72);
    }
}
