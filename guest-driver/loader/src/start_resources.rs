//! START_DEVICE's resource lists: a CM_RESOURCE_LIST in Windows' layout (one full descriptor for the PCI bus, one
//! CmResourceTypeMemory partial descriptor per memory BAR, then one CmResourceTypeInterrupt descriptor per MSI-X
//! message when the run has interrupts), raw and translated. On x86 PCI the bus address of a memory BAR is its CPU
//! physical address, so the two lists carry the same ranges, as Windows gives them there.
//!
//! The interrupt descriptors follow Microsoft's "Using Interrupt Resource Descriptors": an MSI-X device gets one
//! descriptor per message, Flags CM_RESOURCE_INTERRUPT_LATCHED | CM_RESOURCE_INTERRUPT_MESSAGE; the raw one's
//! u.MessageInterrupt.Raw carries its MessageCount (1 per MSI-X descriptor, so the count over the list is the
//! messages granted), the translated one's u.MessageInterrupt.Translated the DIRQL in Level, the vector and the
//! affinity the NT model gives each message when IoConnectInterruptEx connects it.
//!
//! Laid out by hand, byte by byte, at the offsets of `vhca_ntapi::resource_list_layout` (the definition vhca.sys
//! reads them with): wdm.h declares the CM_* resource structures inside `pshpack4.h`, so on x64 a
//! CM_PARTIAL_RESOURCE_DESCRIPTOR is 20 bytes with its Start at offset 4, and the first one sits 20 bytes into the
//! list (the kernel's own type information says the same: 0x14 bytes, PartialDescriptors at 0x8 of its list).
//! windows-sys 0.61 declares them without that packing (24 bytes, Start at 8), so they cannot be used here: a
//! driver reading START_DEVICE's lists through windows-sys's types misreads what Windows passes, and should.

use std::alloc::{alloc_zeroed, dealloc, Layout};

use vhca_ntapi::resource_list_layout::*;
use vhca_ntapi::KIRQL;

/// Which of START_DEVICE's two lists: AllocatedResources (what the bus sees) or AllocatedResourcesTranslated (what
/// the processor sees).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListKind {
    Raw,
    Translated,
}

/// One MSI-X message as START_DEVICE's lists give it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageInterrupt {
    /// The DIRQL its ISR runs at (translated Level).
    pub level: KIRQL,
    pub vector: u32,
    /// KAFFINITY: the processors it is delivered to.
    pub affinity: u64,
}

/// The NT model's vector numbering: message n on vector 0x50 + n (vhca-ntmodel's interrupt.rs, which returns the
/// same in IO_INTERRUPT_MESSAGE_INFO; tests/interrupt_thunks.rs checks the two agree).
const MODEL_VECTOR_BASE: u32 = 0x50;
/// The `count` messages as `model` assigns them (`NtModel::assign_interrupts(device, Messages(count))`): each at
/// the model's device DIRQL, on its vector, to the processor the model delivers it to (`message_processor`: its
/// TargetProcessorSet as IoConnectInterruptEx reports it).
pub fn model_messages(model: &vhca_ntmodel::NtModel, count: u32) -> Vec<MessageInterrupt> {
    (0..count)
        .map(|n| MessageInterrupt {
            level: vhca_ntmodel::DEVICE_DIRQL,
            vector: MODEL_VECTOR_BASE + n,
            affinity: 1 << model.message_processor(n),
        })
        .collect()
}

/// One CM_RESOURCE_LIST, freed on drop.
pub struct ResourceList {
    list: *mut u8,
    layout: Layout,
}

impl ResourceList {
    /// A list of the memory ranges (start, length).
    pub fn memory(ranges: &[(u64, u32)]) -> ResourceList {
        ResourceList::new(ranges, &[], ListKind::Raw)
    }

    /// A list of the memory ranges (start, length), then one message interrupt descriptor per message, as `kind`'s
    /// list carries it.
    pub fn new(ranges: &[(u64, u32)], messages: &[MessageInterrupt], kind: ListKind) -> ResourceList {
        let descriptors = ranges.len() + messages.len();
        let bytes = FIRST_DESCRIPTOR + descriptors.max(1) * DESCRIPTOR_SIZE;
        let layout = Layout::from_size_align(bytes, 16).expect("resource list layout");
        // SAFETY: a non-zero size.
        let list = unsafe { alloc_zeroed(layout) };
        assert!(!list.is_null(), "out of memory for a resource list");
        let put = |at: usize, bytes: &[u8]| {
            // SAFETY: every offset written lies inside the block (FIRST_DESCRIPTOR + n * DESCRIPTOR_SIZE bytes).
            unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), list.add(at), bytes.len()) }
        };
        put(LIST_COUNT, &1u32.to_le_bytes());
        put(FULL_INTERFACE_TYPE, &PCI_BUS.to_le_bytes());
        put(FULL_BUS_NUMBER, &0u32.to_le_bytes());
        put(PARTIAL_VERSION, &1u16.to_le_bytes());
        put(PARTIAL_REVISION, &1u16.to_le_bytes());
        put(PARTIAL_COUNT, &(descriptors as u32).to_le_bytes());
        for (i, (start, length)) in ranges.iter().enumerate() {
            let d = FIRST_DESCRIPTOR + i * DESCRIPTOR_SIZE;
            put(d + DESCRIPTOR_TYPE, &[CM_RESOURCE_TYPE_MEMORY]);
            put(d + DESCRIPTOR_SHARE, &[SHARE_DEVICE_EXCLUSIVE]);
            put(d + DESCRIPTOR_FLAGS, &0u16.to_le_bytes()); // CM_RESOURCE_MEMORY_READ_WRITE
            put(d + MEMORY_START, &start.to_le_bytes());
            put(d + MEMORY_LENGTH, &length.to_le_bytes());
        }
        for (i, m) in messages.iter().enumerate() {
            let d = FIRST_DESCRIPTOR + (ranges.len() + i) * DESCRIPTOR_SIZE;
            put(d + DESCRIPTOR_TYPE, &[CM_RESOURCE_TYPE_INTERRUPT]);
            put(d + DESCRIPTOR_SHARE, &[SHARE_DEVICE_EXCLUSIVE]);
            put(d + DESCRIPTOR_FLAGS, &(CM_RESOURCE_INTERRUPT_LATCHED | CM_RESOURCE_INTERRUPT_MESSAGE).to_le_bytes());
            match kind {
                ListKind::Raw => {
                    put(d + INTERRUPT_RAW_GROUP, &0u16.to_le_bytes());
                    put(d + INTERRUPT_RAW_MESSAGE_COUNT, &1u16.to_le_bytes());
                }
                ListKind::Translated => {
                    put(d + INTERRUPT_LEVEL, &u16::from(m.level).to_le_bytes());
                    put(d + INTERRUPT_TRANSLATED_GROUP, &0u16.to_le_bytes());
                }
            }
            put(d + INTERRUPT_VECTOR, &m.vector.to_le_bytes());
            put(d + INTERRUPT_AFFINITY, &m.affinity.to_le_bytes());
        }
        ResourceList { list, layout }
    }

    /// The list, as START_DEVICE's Parameters hold it.
    pub fn as_ptr<T>(&self) -> *mut T {
        self.list.cast()
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the whole block, initialized (zeroed, then written).
        unsafe { std::slice::from_raw_parts(self.list, self.layout.size()) }
    }
}

impl Drop for ResourceList {
    fn drop(&mut self) {
        // SAFETY: the block `new` allocated with this layout, freed once.
        unsafe { dealloc(self.list, self.layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_sit_where_windows_puts_them() {
        let list = ResourceList::memory(&[(0xfebf_1000, 0x1000), (0x1_fe00_0000, 0x4000)]);
        let b = list.bytes();
        let u32_at = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        assert_eq!((u32_at(0), u32_at(4), u32_at(16)), (1, 5, 2));
        // The second descriptor: 20 + 20 bytes in, its Start 4 bytes into it (unaligned, as pack 4 puts it).
        assert_eq!(b[40], 3);
        assert_eq!(u64::from_le_bytes(b[44..52].try_into().unwrap()), 0x1_fe00_0000);
        assert_eq!(u32_at(52), 0x4000);
        assert_eq!(b.len(), 60);
    }

    #[test]
    fn each_message_is_one_latched_message_descriptor_after_the_bars() {
        let (model, _) = vhca_ntmodel::NtModel::for_tests(Default::default());
        let messages = model_messages(&model, 3);
        // Two processors by default: messages 0, 1, 2 go to processors 0, 1, 0.
        let affinities: Vec<u64> = messages.iter().map(|m| m.affinity).collect();
        assert_eq!(affinities, [1, 2, 1]);
        let raw = ResourceList::new(&[(0xfea0_0000, 0x4000)], &messages, ListKind::Raw);
        let translated = ResourceList::new(&[(0xfea0_0000, 0x4000)], &messages, ListKind::Translated);
        let (r, t) = (raw.bytes(), translated.bytes());
        let u16_at = |b: &[u8], at: usize| u16::from_le_bytes(b[at..at + 2].try_into().unwrap());
        let u32_at = |b: &[u8], at: usize| u32::from_le_bytes(b[at..at + 4].try_into().unwrap());
        assert_eq!((r.len(), u32_at(r, 16)), (20 + 4 * 20, 4));
        // Message 2: the fourth descriptor, 20 + 3 * 20 bytes in, written byte by byte from wdm.h's pack(4).
        let d = 80;
        assert_eq!(
            (r[d], r[d + 1], u16_at(r, d + 2)),
            (2, 1, 3),
            "CmResourceTypeInterrupt, exclusive, LATCHED|MESSAGE"
        );
        assert_eq!((u16_at(r, d + 6), u32_at(r, d + 8)), (1, 0x52), "raw: one message per MSI-X descriptor");
        assert_eq!(u16_at(t, d + 4), u16::from(vhca_ntmodel::DEVICE_DIRQL), "translated Level: the DIRQL");
        assert_eq!((u32_at(t, d + 8), u64::from_le_bytes(t[d + 12..d + 20].try_into().unwrap())), (0x52, 1));
        assert_eq!(u16_at(t, d + 6), 0, "group 0");
    }

    #[test]
    fn without_messages_the_lists_hold_the_bars_only() {
        let list = ResourceList::new(&[(0xfea0_0000, 0x4000)], &[], ListKind::Translated);
        assert_eq!(list.bytes(), ResourceList::memory(&[(0xfea0_0000, 0x4000)]).bytes());
        assert!(partial_descriptors(list.bytes()).all(|d| d.kind == CM_RESOURCE_TYPE_MEMORY));
    }

    #[test]
    fn the_drivers_reader_reads_back_what_is_written() {
        let list = ResourceList::memory(&[(0xfea0_0000, 0x4000), (0xfebf_1000, 0x1000)]);
        let read: Vec<_> = partial_descriptors(list.bytes()).map(|d| (d.kind, d.start, d.length)).collect();
        assert_eq!(read, [(3, 0xfea0_0000, 0x4000), (3, 0xfebf_1000, 0x1000)]);
    }
}
