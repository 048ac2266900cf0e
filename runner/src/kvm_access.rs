//! Why /dev/kvm does not open for the user running the runner, in words that say what to do about it: most often
//! the device belongs to a group (`kvm`) the user is not in, and the fix is one `usermod`.

use std::ffi::CStr;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

/// The reason for the report and the console line, given the error opening `kvm` read-write gave. Ends in
/// "running TCG" because that is what the caller does next.
pub fn why_unusable(kvm: &Path, error: &io::Error) -> String {
    let shown = kvm.display();
    if error.kind() != io::ErrorKind::PermissionDenied {
        return format!("{shown} unusable ({error}) — running TCG");
    }
    let Ok(meta) = kvm.metadata() else { return format!("{shown} unusable ({error}) — running TCG") };
    let (gid, mode) = (meta.gid(), meta.mode() & 0o777);
    let group = group_name(gid).unwrap_or_else(|| gid.to_string());
    let kind = if meta.file_type().is_char_device() { "" } else { " (not a character device)" };
    if mode & 0o060 != 0o060 || gid == 0 {
        // No group a user could join opens it: the device's mode or group has to change first.
        return format!(
            "{shown}{kind} is mode {mode:04o}, group {group}: only its owner opens it; give it to a group with rw \
             (e.g. chgrp kvm {shown} && chmod 660 {shown}, as udev does on most distributions) and add yourself \
             (usermod -aG kvm $USER) — running TCG"
        );
    }
    if in_group(gid) {
        return format!(
            "{shown}{kind} is owned by group {group}, which this process is in, and still refuses it ({error}) — \
             running TCG"
        );
    }
    format!(
        "{shown}{kind} is owned by group {group}: add yourself (usermod -aG {group} $USER, then log in again) — \
         running TCG"
    )
}

/// The name of group `gid` in the group database.
fn group_name(gid: u32) -> Option<String> {
    let mut entry = std::mem::MaybeUninit::<libc::group>::uninit();
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: getgrgid_r writes only into `entry` and `buf` (whose length it is told) and sets `found` to `entry`
    // (then filled in) or null.
    let rc = unsafe { libc::getgrgid_r(gid, entry.as_mut_ptr(), buf.as_mut_ptr(), buf.len(), &mut found) };
    if rc != 0 || found.is_null() {
        return None;
    }
    // SAFETY: `found` is non-null, so it points at `entry`, which getgrgid_r filled in; its strings live in `buf`.
    let name = unsafe { (*found).gr_name };
    if name.is_null() {
        return None;
    }
    // SAFETY: gr_name is a NUL-terminated string inside `buf`, which is alive here.
    Some(unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned())
}

/// Whether this process has `gid` as its effective or a supplementary group (a user just added to a group has it
/// only from the next login).
fn in_group(gid: u32) -> bool {
    // SAFETY: getegid has no preconditions.
    if unsafe { libc::getegid() } == gid {
        return true;
    }
    let mut groups = vec![0 as libc::gid_t; 1024];
    // SAFETY: getgroups writes at most `groups.len()` ids into the buffer it is given.
    let n = unsafe { libc::getgroups(groups.len() as libc::c_int, groups.as_mut_ptr()) };
    usize::try_from(n).is_ok_and(|n| groups[..n.min(groups.len())].contains(&gid))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn denied() -> io::Error {
        io::Error::from_raw_os_error(libc::EACCES)
    }

    #[test]
    fn a_device_only_its_owner_opens_says_the_mode_must_change() {
        let dir = tempfile::tempdir().unwrap();
        let kvm = dir.path().join("kvm");
        std::fs::write(&kvm, b"").unwrap();
        std::fs::set_permissions(&kvm, std::fs::Permissions::from_mode(0o600)).unwrap();
        let why = why_unusable(&kvm, &denied());
        assert!(why.contains("mode 0600") && why.contains("chmod 660") && why.ends_with("running TCG"), "{why}");
    }

    #[test]
    fn a_group_device_names_its_group_and_the_usermod_line() {
        // A group-rw file of a group this process is not in: the case of a user outside `kvm`. The test picks a
        // group it is not in from the database, as the file's gid is what the message reads.
        let dir = tempfile::tempdir().unwrap();
        let kvm = dir.path().join("kvm");
        std::fs::write(&kvm, b"").unwrap();
        std::fs::set_permissions(&kvm, std::fs::Permissions::from_mode(0o660)).unwrap();
        let Some(gid) = (1..65534).find(|g| group_name(*g).is_some() && !in_group(*g)) else {
            panic!("no group in the group database this process is outside of");
        };
        let path = std::ffi::CString::new(kvm.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: chown on a NUL-terminated path of a file this test created; -1 keeps the owner.
        let rc = unsafe { libc::chown(path.as_ptr(), u32::MAX, gid) };
        if rc != 0 {
            // Only root (or a member of the group) may give a file to another group.
            // SAFETY: geteuid has no preconditions.
            assert_ne!(unsafe { libc::geteuid() }, 0, "root could not chgrp: {}", io::Error::last_os_error());
            return;
        }
        let group = group_name(gid).unwrap();
        let why = why_unusable(&kvm, &denied());
        assert!(why.contains(&format!("owned by group {group}: add yourself (usermod -aG {group} $USER")), "{why}");
    }

    #[test]
    fn a_missing_device_says_so() {
        let why = why_unusable(Path::new("/nonexistent/kvm"), &io::Error::from(io::ErrorKind::NotFound));
        assert!(why.starts_with("/nonexistent/kvm unusable ("), "{why}");
    }
}
