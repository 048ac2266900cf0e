//! START_DEVICE's interrupt resources: every CmResourceTypeInterrupt descriptor of the raw and translated lists,
//! line-based or message-signalled, read in Windows' pack(4) layout. Portable, so the parsing is tested on Linux.
//!
//! The PnP manager gives an MSI device one message descriptor whose raw MessageCount says how many messages it got,
//! and an MSI-X device one descriptor per message; both carry CM_RESOURCE_INTERRUPT_MESSAGE in Flags. The raw list
//! holds what the bus sees (the message count); the translated list what the processor sees (the DIRQL in Level,
//! the vector, the affinity), which is what IoConnectInterruptEx connects. The two lists are in the same order.
//! The descriptor's layout (the union's raw and translated halves) is `vhca_ntapi::resource_list_layout`'s, the one
//! the loader writes these lists with.

use alloc::vec::Vec;

use vhca_ntapi::resource_list_layout::{
    descriptor_u16, descriptor_u32, descriptor_u64, descriptors, CM_RESOURCE_INTERRUPT_LATCHED,
    CM_RESOURCE_INTERRUPT_MESSAGE, CM_RESOURCE_TYPE_INTERRUPT, DESCRIPTOR_FLAGS, DESCRIPTOR_TYPE, INTERRUPT_AFFINITY,
    INTERRUPT_LEVEL, INTERRUPT_RAW_MESSAGE_COUNT, INTERRUPT_TRANSLATED_GROUP, INTERRUPT_VECTOR,
};

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
            let flags = descriptor_u16(t, DESCRIPTOR_FLAGS);
            let message = flags & CM_RESOURCE_INTERRUPT_MESSAGE != 0;
            InterruptResource {
                message,
                latched: flags & CM_RESOURCE_INTERRUPT_LATCHED != 0,
                message_count: if message { descriptor_u16(r, INTERRUPT_RAW_MESSAGE_COUNT) } else { 0 },
                raw_vector: descriptor_u32(r, INTERRUPT_VECTOR),
                vector: descriptor_u32(t, INTERRUPT_VECTOR),
                level: descriptor_u16(t, INTERRUPT_LEVEL),
                group: descriptor_u16(t, INTERRUPT_TRANSLATED_GROUP),
                affinity: descriptor_u64(t, INTERRUPT_AFFINITY),
            }
        })
        .collect();
    InterruptResources { descriptors }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A list written byte by byte from wdm.h's pack(4) layout (independent of the layout's constants): a memory BAR,
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
