//! START_DEVICE's interrupt resources: every CmResourceTypeInterrupt descriptor of the raw and translated lists,
//! line-based or message-signalled, read in Windows' pack(4) layout. Portable, so the parsing is tested on Linux.
//!
//! The PnP manager gives an MSI device one message descriptor whose raw MessageCount says how many messages it got,
//! and an MSI-X device one descriptor per message; both carry CM_RESOURCE_INTERRUPT_MESSAGE in Flags. The raw list
//! holds what the bus sees (the message count); the translated list what the processor sees (the DIRQL in Level,
//! the vector, the affinity), which is what IoConnectInterruptEx connects. The two lists are in the same order.
//!
//! ```text
//! CM_PARTIAL_RESOURCE_DESCRIPTOR (20 bytes), u at 4
//!   u.Interrupt / u.MessageInterrupt.Translated   u.MessageInterrupt.Raw
//!    4 Level (u16, the DIRQL)                      4 Group (u16; Reserved without processor groups)
//!    6 Group (u16)                                 6 MessageCount (u16)
//!    8 Vector (u32)                                8 Vector (u32)
//!   12 Affinity (KAFFINITY, u64, 4-aligned)       12 Affinity
//! ```

use alloc::vec::Vec;

use vhca_ntapi::resource_list_layout::{
    list_bytes, DESCRIPTOR_FLAGS, DESCRIPTOR_SIZE, DESCRIPTOR_TYPE, FIRST_DESCRIPTOR,
};

/// wdm.h's CmResourceTypeInterrupt.
pub const CM_RESOURCE_TYPE_INTERRUPT: u8 = 2;
/// Flags: edge-triggered (every message is).
pub const CM_RESOURCE_INTERRUPT_LATCHED: u16 = 0x1;
/// Flags: a message-signalled interrupt (MSI or MSI-X).
pub const CM_RESOURCE_INTERRUPT_MESSAGE: u16 = 0x2;

const LEVEL: usize = 4;
const RAW_MESSAGE_COUNT: usize = 6;
const TRANSLATED_GROUP: usize = 6;
const VECTOR: usize = 8;
const AFFINITY: usize = 12;

/// One interrupt descriptor, raw and translated taken at the same index of the two lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InterruptResource {
    /// CM_RESOURCE_INTERRUPT_MESSAGE was set (in both lists).
    pub message: bool,
    /// CM_RESOURCE_INTERRUPT_LATCHED: edge-triggered.
    pub latched: bool,
    /// Raw u.MessageInterrupt.Raw.MessageCount for a message descriptor (MSI: the messages granted; MSI-X: 1);
    /// 0 for a line-based one.
    pub message_count: u16,
    /// The raw vector (for a message, what the bus driver programmed).
    pub raw_vector: u32,
    /// Translated: the vector the processor takes, the DIRQL the ISR runs at, the processor group and the
    /// processors it may run on.
    pub vector: u32,
    pub level: u16,
    pub group: u16,
    pub affinity: u64,
}

/// The interrupts START_DEVICE gave the device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InterruptResources {
    pub descriptors: Vec<InterruptResource>,
}

impl InterruptResources {
    /// How many messages the device was given: each message descriptor counts its raw MessageCount (at least one,
    /// as an MSI-X descriptor is one message whatever its count says).
    pub fn messages(&self) -> u32 {
        self.descriptors.iter().filter(|d| d.message).map(|d| u32::from(d.message_count.max(1))).sum()
    }

    /// The line-based interrupt, when the device got one instead of messages.
    pub fn line(&self) -> Option<&InterruptResource> {
        self.descriptors.iter().find(|d| !d.message)
    }

    /// No interrupt at all: IoConnectInterruptEx would return STATUS_NOT_FOUND, so the driver polls.
    pub fn is_empty(&self) -> bool {
        self.descriptors.is_empty()
    }
}

/// The interrupt resources of START_DEVICE's raw and translated lists, given as their bytes (the same way
/// `bar_resources::memory_resources` reads the memory ones): a pair is used only when both lists say interrupt at
/// that index; a descriptor the bytes do not hold whole is left out.
pub fn interrupt_resources(raw: &[u8], translated: &[u8]) -> InterruptResources {
    let descriptors = descriptors(raw)
        .zip(descriptors(translated))
        .filter(|(r, t)| {
            r[DESCRIPTOR_TYPE] == CM_RESOURCE_TYPE_INTERRUPT && t[DESCRIPTOR_TYPE] == CM_RESOURCE_TYPE_INTERRUPT
        })
        .map(|(r, t)| {
            let flags = u16_at(t, DESCRIPTOR_FLAGS);
            let message = flags & CM_RESOURCE_INTERRUPT_MESSAGE != 0;
            InterruptResource {
                message,
                latched: flags & CM_RESOURCE_INTERRUPT_LATCHED != 0,
                message_count: if message { u16_at(r, RAW_MESSAGE_COUNT) } else { 0 },
                raw_vector: u32_at(r, VECTOR),
                vector: u32_at(t, VECTOR),
                level: u16_at(t, LEVEL),
                group: u16_at(t, TRANSLATED_GROUP),
                affinity: u64_at(t, AFFINITY),
            }
        })
        .collect();
    InterruptResources { descriptors }
}

/// Each whole partial descriptor of the list's first full descriptor, as its 20 bytes.
fn descriptors(list: &[u8]) -> impl Iterator<Item = &[u8]> + '_ {
    let count = list_bytes(list).map_or(0, |bytes| (bytes - FIRST_DESCRIPTOR) / DESCRIPTOR_SIZE);
    (0..count).map_while(move |i| {
        let at = FIRST_DESCRIPTOR + i * DESCRIPTOR_SIZE;
        list.get(at..at + DESCRIPTOR_SIZE)
    })
}

// Callers pass whole 20-byte descriptors, so every field read lies inside.
fn u16_at(d: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([d[at], d[at + 1]])
}

fn u32_at(d: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([d[at], d[at + 1], d[at + 2], d[at + 3]])
}

fn u64_at(d: &[u8], at: usize) -> u64 {
    (u64::from(u32_at(d, at + 4)) << 32) | u64::from(u32_at(d, at))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A list written byte by byte from wdm.h's pack(4) layout (independent of the constants above): a memory BAR,
    /// then `messages` interrupt descriptors as `fill` writes each.
    fn list(messages: usize, fill: impl Fn(&mut [u8], usize)) -> Vec<u8> {
        let n = 1 + messages;
        let mut b = vec![0u8; 20 + 20 * n];
        b[0] = 1; // Count
        b[4] = 5; // PCIBus
        b[12] = 1; // Version
        b[14] = 1; // Revision
        b[16] = n as u8;
        b[20] = 3; // memory
        b[24..32].copy_from_slice(&0xfebf_1000u64.to_le_bytes());
        b[32..36].copy_from_slice(&0x1000u32.to_le_bytes());
        for i in 0..messages {
            let d = 40 + 20 * i;
            b[d] = 2; // CmResourceTypeInterrupt
            b[d + 1] = 1; // device exclusive
            fill(&mut b[d..d + 20], i);
        }
        b
    }

    fn msix_raw(d: &mut [u8], _: usize) {
        d[2] = 3; // LATCHED | MESSAGE
        d[6] = 1; // MessageCount: one message per MSI-X descriptor
        d[8..12].copy_from_slice(&0xfee0_0000u32.to_le_bytes());
        d[12..20].copy_from_slice(&u64::MAX.to_le_bytes());
    }

    fn msix_translated(d: &mut [u8], i: usize) {
        d[2] = 3;
        d[4] = 0x0b; // Level: DIRQL 11
        d[6] = 0; // Group 0
        d[8..12].copy_from_slice(&(0x60 + i as u32).to_le_bytes());
        d[12..20].copy_from_slice(&(1u64 << i).to_le_bytes());
    }

    #[test]
    fn msix_messages_are_read_from_both_lists() {
        let r = interrupt_resources(&list(5, msix_raw), &list(5, msix_translated));
        assert_eq!(r.descriptors.len(), 5, "the memory descriptor is not an interrupt");
        assert_eq!(r.messages(), 5);
        assert_eq!(r.line(), None);
        assert_eq!(
            r.descriptors[2],
            InterruptResource {
                message: true,
                latched: true,
                message_count: 1,
                raw_vector: 0xfee0_0000,
                vector: 0x62,
                level: 0x0b,
                group: 0,
                affinity: 1 << 2,
            }
        );
    }

    #[test]
    fn one_msi_descriptor_counts_its_messages() {
        let raw = list(1, |d, _| {
            d[2] = 3;
            d[6] = 4; // four MSI messages in one descriptor
        });
        let r = interrupt_resources(&raw, &list(1, msix_translated));
        assert_eq!((r.descriptors.len(), r.messages()), (1, 4));
    }

    #[test]
    fn a_line_interrupt_is_the_fallback_and_no_interrupt_means_polling() {
        let line = |d: &mut [u8], _: usize| {
            d[2] = 0; // level-sensitive, not a message
            d[4] = 5;
            d[8] = 0x3a;
            d[12] = 0xf;
        };
        let r = interrupt_resources(&list(1, line), &list(1, line));
        assert_eq!(r.messages(), 0);
        let l = r.line().expect("the line interrupt");
        assert_eq!(
            (l.message, l.latched, l.level, l.vector, l.affinity, l.message_count),
            (false, false, 5, 0x3a, 0xf, 0)
        );
        let none = interrupt_resources(&list(0, msix_raw), &list(0, msix_raw));
        assert!(none.is_empty());
        assert!(interrupt_resources(&[], &[]).is_empty());
    }

    #[test]
    fn a_short_list_gives_only_whole_descriptors() {
        let raw = list(3, msix_raw);
        let translated = list(3, msix_translated);
        let cut = &translated[..translated.len() - 5];
        assert_eq!(interrupt_resources(&raw, cut).descriptors.len(), 2);
    }
}
