//! The snapshot's content digest: a hash of the state file's data pages only, so checking a sparse 540 MB file reads
//! the ~85 MB the guest used.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use sha2::{Digest, Sha256};

const PAGE: u64 = 4096;

/// A SHA-256 of the file's non-zero 4 KiB pages and their offsets. Holes and zero pages hash alike and are skipped,
/// so only the data the guest used is read (about 85 of 540 MB); any changed byte, or data written into a hole,
/// changes the digest.
pub fn state_digest(path: &Path) -> io::Result<String> {
    let file = File::open(path)?;
    let len = file.metadata()?.len();
    let mut h = Sha256::new();
    h.update(len.to_le_bytes());
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0u64;
    while pos < len {
        let Some((start, end)) = data_extent(&file, pos, len)? else { break };
        // Whole pages at page-aligned offsets, whatever the file system's extent boundaries.
        let mut at = start - start % PAGE;
        let end = end.div_ceil(PAGE).saturating_mul(PAGE).min(len);
        while at < end {
            let want = usize::try_from((end - at).min(buf.len() as u64)).unwrap_or(buf.len());
            let got = file.read_at(&mut buf[..want], at)?;
            if got == 0 {
                break;
            }
            for (i, page) in buf[..got].chunks(PAGE as usize).enumerate() {
                if page.iter().any(|&b| b != 0) {
                    h.update((at + i as u64 * PAGE).to_le_bytes());
                    h.update(page);
                }
            }
            at += got as u64;
        }
        pos = end.max(pos + 1);
    }
    Ok(hex::encode(h.finalize()))
}

/// The next run of data at or after `pos`, from SEEK_DATA/SEEK_HOLE; the rest of the file where those are not
/// supported. None when only a hole is left.
fn data_extent(file: &File, pos: u64, len: u64) -> io::Result<Option<(u64, u64)>> {
    let seek = |offset: u64, whence: libc::c_int| -> io::Result<Option<u64>> {
        let offset = libc::off_t::try_from(offset).map_err(io::Error::other)?;
        // SAFETY: lseek on a descriptor `file` owns; it moves only the file offset, which no other code here uses
        // (reads go through read_at/pread).
        let r = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
        if r >= 0 {
            return Ok(Some(r as u64));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ENXIO) => Ok(None),
            _ => Err(e),
        }
    };
    match seek(pos, libc::SEEK_DATA) {
        Ok(None) => Ok(None),
        Ok(Some(start)) => Ok(Some((start, seek(start, libc::SEEK_HOLE)?.unwrap_or(len).min(len)))),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(Some((pos, len))),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_sees_a_changed_byte_and_data_in_a_hole_but_not_hole_layout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.img");
        let file = File::create(&path).unwrap();
        file.set_len(64 * PAGE).unwrap();
        file.write_at(b"QEVM header", 0).unwrap();
        file.write_at(&[7u8; 100], 40 * PAGE + 10).unwrap();
        let base = state_digest(&path).unwrap();
        assert_eq!(base, state_digest(&path).unwrap());
        // Zeros written over a hole are the same content.
        file.write_at(&[0u8; 4096], 20 * PAGE).unwrap();
        assert_eq!(base, state_digest(&path).unwrap(), "explicit zeros hash like a hole");
        file.write_at(&[8u8], 40 * PAGE + 50).unwrap();
        let changed = state_digest(&path).unwrap();
        assert_ne!(base, changed, "a changed byte in data");
        file.write_at(&[1u8], 60 * PAGE).unwrap();
        assert_ne!(changed, state_digest(&path).unwrap(), "data written into a hole");
    }
}
