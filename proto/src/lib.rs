//! The vhca wire format: the one description of every byte the device and its driver exchange.
//! `no_std`, little-endian, fixed layouts; both sides encode and decode through these types only.
#![no_std]

#[macro_use]
mod wire_enum;

pub mod async_event;
pub mod command;
pub mod config;
pub mod doorbell;
pub mod status;
pub mod work;

pub use async_event::*;
pub use command::*;
pub use config::*;
pub use doorbell::*;
pub use status::Status;
pub use work::*;

/// Page size of every ring, MR page list and map register: the guest's and the IOMMU's 4 KiB page.
pub const PAGE_SIZE: u64 = 4096;

/// The pages `[iova, iova + len)` touches, page-aligned, in order (none for `len` 0); `None` when the range wraps
/// the address space.
pub fn pages_spanned(iova: u64, len: usize) -> Option<core::iter::StepBy<core::ops::RangeInclusive<u64>>> {
    let first = iova & !(PAGE_SIZE - 1);
    #[allow(clippy::reversed_empty_ranges)] // on purpose: no pages
    let pages = match (len as u64).checked_sub(1) {
        None => 1..=0,
        Some(rest) => first..=(iova.checked_add(rest)? & !(PAGE_SIZE - 1)),
    };
    Some(pages.step_by(PAGE_SIZE as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_spanned_walks_every_page_a_range_touches_and_refuses_a_wrap() {
        let spans = |iova, len, want: &[u64]| pages_spanned(iova, len).is_some_and(|p| p.eq(want.iter().copied()));
        assert!(spans(0x1ff8, 16, &[0x1000, 0x2000]));
        assert!(spans(0x2000, 4096, &[0x2000]));
        assert!(spans(0x2000, 0, &[]));
        assert!(spans(u64::MAX - 4095, 4096, &[u64::MAX - 4095]));
        assert!(pages_spanned(u64::MAX - 7, 16).is_none());
    }

    #[test]
    fn listed_pages_reads_the_page_list_after_the_fixed_body_or_nothing() {
        use zerocopy::IntoBytes;
        let fixed = Opcode::CreateCq.request_size();
        let mut request = [0u8; 256];
        let body_len = fixed + 16;
        let header = CommandHeader {
            opcode: (Opcode::CreateCq as u32).into(),
            tag: 1.into(),
            body_len: (body_len as u32).into(),
            reserved: 0.into(),
        };
        request[..COMMAND_HEADER_SIZE].copy_from_slice(header.as_bytes());
        let list = COMMAND_HEADER_SIZE + fixed;
        request[list..list + 8].copy_from_slice(&0x8000_1000u64.to_le_bytes());
        request[list + 8..list + 16].copy_from_slice(&0x8000_3000u64.to_le_bytes());
        let end = COMMAND_HEADER_SIZE + body_len;
        assert!(listed_pages(&request[..end]).eq([0x8000_1000, 0x8000_3000]));
        assert_eq!(listed_pages(&request[..end - 1]).count(), 0, "a body shorter than body_len lists nothing");
        request[0] = 0xff;
        assert_eq!(listed_pages(&request[..end]).count(), 0, "an unknown opcode lists nothing");
    }

    /// Every wire enum decodes each of its own values back to itself, refuses the first value past its last, and
    /// has distinct names: a value or name typed twice in a declaration fails here.
    #[test]
    fn wire_enums_round_trip_and_names_are_unique() {
        fn check<T: Copy + PartialEq + core::fmt::Debug>(
            all: &[T],
            value: fn(T) -> u32,
            from: fn(u32) -> Option<T>,
            name: fn(T) -> &'static str,
        ) {
            for (i, a) in all.iter().enumerate() {
                assert_eq!(from(value(*a)), Some(*a));
                for b in &all[i + 1..] {
                    assert_ne!(value(*a), value(*b), "{a:?} and {b:?} share a wire value");
                    assert_ne!(name(*a), name(*b), "{a:?} and {b:?} share a name");
                }
            }
            let past = all.iter().map(|a| value(*a)).max().unwrap() + 1;
            assert_eq!(from(past), None);
        }
        check(Opcode::ALL, |v| v as u32, Opcode::from_u32, Opcode::name);
        check(QpState::ALL, |v| v as u32, QpState::from_u32, QpState::name);
        check(Status::ALL, |v| v as u32, Status::from_u32, Status::name);
        check(status::WcStatus::ALL, |v| v as u32, status::WcStatus::from_u32, status::WcStatus::name);
        check(WrOpcode::ALL, |v| v as u32, WrOpcode::from_u32, WrOpcode::name);
        check(FaultCause::ALL, |v| v as u32, FaultCause::from_u32, FaultCause::name);
        check(EventKind::ALL, |v| v as u32, EventKind::from_u32, EventKind::name);
        check(DoorbellKind::ALL, |v| v as u32, DoorbellKind::from_u32, DoorbellKind::name);
        assert_eq!(Status::from_u32(7), Some(Status::MapRegistersExhausted));
        assert_eq!(FaultCause::StaleTranslation.name(), "stale_translation");
    }

    #[test]
    fn a_request_is_header_then_body_then_pages_and_the_size_must_match() {
        use zerocopy::FromBytes;
        let body = [1u8, 2, 3, 4];
        let pages = [0x1000u64, 0x10_0000_2000];
        let mut out = [0u8; COMMAND_HEADER_SIZE + 4 + 16];
        assert_eq!(request_len(body.len(), pages.len()), Some(out.len()));
        encode_request(&mut out, Opcode::RegMr, 7, &body, &pages).unwrap();
        let (header, rest) = CommandHeader::read_from_prefix(&out).unwrap();
        assert_eq!((header.opcode.get(), header.tag.get(), header.body_len.get()), (Opcode::RegMr as u32, 7, 20));
        assert_eq!(&rest[..4], &body);
        assert_eq!(rest[4..12], 0x1000u64.to_le_bytes());
        assert_eq!(rest[12..20], 0x10_0000_2000u64.to_le_bytes());
        assert_eq!(encode_request(&mut out[..20], Opcode::RegMr, 7, &body, &pages), None, "wrong size is refused");
        assert_eq!(request_len(usize::MAX, 1), None);
    }
}
