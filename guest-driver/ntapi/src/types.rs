//! Windows' kernel types, constants and status codes as the driver core sees them.
//! Pointers are opaque 64-bit values so the model and the WDK shim can both stand behind them.

use alloc::boxed::Box;
use alloc::vec::Vec;

/// Interrupt request level of the calling thread.
pub type KIRQL = u8;
pub const PASSIVE_LEVEL: KIRQL = 0;
pub const APC_LEVEL: KIRQL = 1;
pub const DISPATCH_LEVEL: KIRQL = 2;
/// Lowest device IRQL on x64; device interrupts run in DIRQL_MIN..=HIGH_LEVEL-3.
pub const DIRQL_MIN: KIRQL = 3;
pub const HIGH_LEVEL: KIRQL = 15;

/// An NT status: negative values (top bit set) are errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NTSTATUS(pub i32);

impl NTSTATUS {
    pub fn is_success(self) -> bool {
        self.0 >= 0
    }
}

pub const STATUS_SUCCESS: NTSTATUS = NTSTATUS(0);
pub const STATUS_PENDING: NTSTATUS = NTSTATUS(0x0000_0103);
pub const STATUS_UNSUCCESSFUL: NTSTATUS = NTSTATUS(0xC000_0001_u32 as i32);
pub const STATUS_ACCESS_VIOLATION: NTSTATUS = NTSTATUS(0xC000_0005_u32 as i32);
pub const STATUS_INVALID_PARAMETER: NTSTATUS = NTSTATUS(0xC000_000D_u32 as i32);
pub const STATUS_NO_MEMORY: NTSTATUS = NTSTATUS(0xC000_0017_u32 as i32);
pub const STATUS_INSUFFICIENT_RESOURCES: NTSTATUS = NTSTATUS(0xC000_009A_u32 as i32);
pub const STATUS_DEVICE_NOT_READY: NTSTATUS = NTSTATUS(0xC000_00A3_u32 as i32);
pub const STATUS_BUFFER_TOO_SMALL: NTSTATUS = NTSTATUS(0xC000_0023_u32 as i32);
pub const STATUS_NOT_SUPPORTED: NTSTATUS = NTSTATUS(0xC000_00BB_u32 as i32);
pub const STATUS_INVALID_DEVICE_REQUEST: NTSTATUS = NTSTATUS(0xC000_0010_u32 as i32);

/// A virtual address (kernel or user). `PVOID::NULL` is how allocators report failure, as on Windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct PVOID(pub u64);

impl PVOID {
    pub const NULL: PVOID = PVOID(0);

    pub fn is_null(self) -> bool {
        self.0 == 0
    }

    /// The address `bytes` further on; `None` if that overflows.
    pub fn offset(self, bytes: u64) -> Option<PVOID> {
        self.0.checked_add(bytes).map(PVOID)
    }
}

/// A device-visible (logical) address: what the device puts on the bus. Under an IOMMU, an IOVA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(transparent)]
pub struct PHYSICAL_ADDRESS(pub u64);

macro_rules! opaque_pointer {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        #[repr(transparent)]
        pub struct $name(pub u64);

        impl $name {
            pub const NULL: $name = $name(0);
            pub fn is_null(self) -> bool {
                self.0 == 0
            }
        }
    )*};
}

opaque_pointer!(
    /// A FAST_MUTEX in non-paged memory.
    PFAST_MUTEX,
    /// A KGUARDED_MUTEX in non-paged memory.
    PKGUARDED_MUTEX,
    /// A KMUTEX (dispatcher mutex, recursive for its owner).
    PKMUTEX,
    /// An ERESOURCE (reader/writer lock).
    PERESOURCE,
    /// A KSPIN_LOCK.
    PKSPIN_LOCK,
    /// A memory descriptor list.
    PMDL,
    /// The DMA_ADAPTER IoGetDmaAdapter returns.
    PDMA_ADAPTER,
    /// The device object a DMA operation is for (the physical device object).
    PDEVICE_OBJECT,
    /// A SCATTER_GATHER_LIST handed to AdapterListControl by GetScatterGatherList.
    PSCATTER_GATHER_LIST,
    /// The map-register base an AllocateAdapterChannel execution routine receives.
    MAP_REGISTER_BASE,
    /// A handle for a buffer made a common buffer by IoMapCommonBuffer.
    HANDLE,
);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum POOL_TYPE {
    NonPagedPool = 0,
    PagedPool = 1,
    /// NonPagedPoolNx: non-paged, not executable.
    NonPagedPoolNx = 512,
}

impl POOL_TYPE {
    pub fn is_paged(self) -> bool {
        matches!(self, POOL_TYPE::PagedPool)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KPROCESSOR_MODE {
    KernelMode = 0,
    UserMode = 1,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LOCK_OPERATION {
    IoReadAccess = 0,
    IoWriteAccess = 1,
    IoModifyAccess = 2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MEMORY_CACHING_TYPE {
    MmNonCached = 0,
    MmCached = 1,
    MmWriteCombined = 2,
}

/// What an AllocateAdapterChannel execution routine returns: whether the channel and the registers stay held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IO_ALLOCATION_ACTION {
    KeepObject = 1,
    DeallocateObject = 2,
    DeallocateObjectKeepRegisters = 3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum INTERFACE_TYPE {
    PCIBus = 5,
}

pub const DEVICE_DESCRIPTION_VERSION: u32 = 0;
pub const DEVICE_DESCRIPTION_VERSION1: u32 = 1;
pub const DEVICE_DESCRIPTION_VERSION2: u32 = 2;
pub const DEVICE_DESCRIPTION_VERSION3: u32 = 3;

/// The fields of Windows' DEVICE_DESCRIPTION a bus-master PCI device fills in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DEVICE_DESCRIPTION {
    pub Version: u32,
    pub Master: bool,
    pub ScatterGather: bool,
    pub Dma32BitAddresses: bool,
    pub Dma64BitAddresses: bool,
    pub InterfaceType: INTERFACE_TYPE,
    /// Largest single transfer in bytes: sets how many map registers the adapter asks for.
    pub MaximumLength: u32,
    /// Version 3: the device's address width in bits. 0: not given, the two flags above say it (as for versions
    /// 0 to 2).
    pub DmaAddressWidth: u32,
}

impl DEVICE_DESCRIPTION {
    /// A 64-bit scatter/gather bus master on PCI, the HCA's description.
    pub fn bus_master_64(maximum_length: u32) -> DEVICE_DESCRIPTION {
        DEVICE_DESCRIPTION {
            Version: DEVICE_DESCRIPTION_VERSION3,
            Master: true,
            ScatterGather: true,
            Dma32BitAddresses: true,
            Dma64BitAddresses: true,
            InterfaceType: INTERFACE_TYPE::PCIBus,
            MaximumLength: maximum_length,
            // The flags say 64 bits; a description that gives the width too is the caller's to build.
            DmaAddressWidth: 0,
        }
    }
}

/// What GetDmaAdapterInfo reports (DMA_ADAPTER_INFO_V1's fields; the caller asks for DMA_ADAPTER_INFO_VERSION1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DMA_ADAPTER_INFO_V1 {
    pub ReadDmaCounterAvailable: u32,
    pub ScatterGatherLimit: u32,
    pub DmaAddressWidth: u32,
    pub Flags: u32,
    pub MinimumTransferUnit: u32,
}

pub const DMA_ADAPTER_INFO_VERSION1: u32 = 1;

/// What GetDmaTransferInfo reports (DMA_TRANSFER_INFO_V2's fields; version 1 has the first three).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DMA_TRANSFER_INFO_V2 {
    pub MapRegisterCount: u32,
    pub ScatterGatherElementCount: u32,
    pub ScatterGatherListSize: u32,
    pub LogicalPageCount: u32,
}

pub const DMA_TRANSFER_INFO_VERSION1: u32 = 1;
pub const DMA_TRANSFER_INFO_VERSION2: u32 = 2;

/// BuildScatterGatherListEx's flag: resources now or STATUS_INSUFFICIENT_RESOURCES, the routine (if any) called
/// before the call returns.
pub const DMA_SYNCHRONOUS_CALLBACK: u32 = 1;

/// Bytes of Windows x64's SCATTER_GATHER_LIST header (NumberOfElements, Reserved) and of one SCATTER_GATHER_ELEMENT
/// (Address, Length, Reserved): what a driver-supplied list buffer must hold.
pub const SCATTER_GATHER_LIST_HEADER_BYTES: u32 = 16;
pub const SCATTER_GATHER_ELEMENT_BYTES: u32 = 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SCATTER_GATHER_ELEMENT {
    pub Address: PHYSICAL_ADDRESS,
    pub Length: u32,
}

/// A scatter/gather list: the handle to give back to PutScatterGatherList and the elements the device uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SCATTER_GATHER_LIST {
    pub Handle: PSCATTER_GATHER_LIST,
    pub Elements: Vec<SCATTER_GATHER_ELEMENT>,
}

/// The driver's AdapterListControl routine (DRIVER_LIST_CONTROL) with its Context captured: called at DISPATCH_LEVEL
/// with the device object and the list, which stays the driver's until it hands `Handle` to PutScatterGatherList.
/// Windows also passes the device's current IRP; the driver core queues no IRPs, so it is left out.
pub type PDRIVER_LIST_CONTROL = Box<dyn FnOnce(PDEVICE_OBJECT, &SCATTER_GATHER_LIST) + Send>;

/// The driver's AdapterControl routine (DRIVER_CONTROL) with its Context captured: called at DISPATCH_LEVEL with the
/// device object and the map-register base; what it returns says whether the channel and registers stay held.
/// The IRP argument is left out as for PDRIVER_LIST_CONTROL.
pub type PDRIVER_CONTROL = Box<dyn FnOnce(PDEVICE_OBJECT, MAP_REGISTER_BASE) -> IO_ALLOCATION_ACTION + Send>;

/// MDL flags the driver core may look at (Windows' values).
pub const MDL_MAPPED_TO_SYSTEM_VA: u16 = 0x0001;
pub const MDL_PAGES_LOCKED: u16 = 0x0002;
pub const MDL_SOURCE_IS_NONPAGED_POOL: u16 = 0x0004;

pub const PAGE_SIZE: u64 = 4096;

/// Pages spanned by `length` bytes starting at `va`: ADDRESS_AND_SIZE_TO_SPAN_PAGES.
pub fn ADDRESS_AND_SIZE_TO_SPAN_PAGES(va: PVOID, length: u64) -> u64 {
    if length == 0 {
        return 0;
    }
    let offset = va.0 % PAGE_SIZE;
    (offset + length).div_ceil(PAGE_SIZE)
}

/// Pool tag from four characters, as the driver writes them ('vhca' reads "vhca" in a pool dump).
pub const fn pool_tag(tag: &[u8; 4]) -> u32 {
    u32::from_le_bytes(*tag)
}
