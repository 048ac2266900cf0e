//! The user program a vhca.sys run plays once the device started (`vhca.user=`): a process of the loader's model
//! that opens vhca's device interface and drives its IOCTLs as a user-mode verbs provider would, then exits.

use vhca_driver_core::ioctl_codec::*;
use vhca_loader::user_process::{UserProcess, UserProgram};
use vhca_proto::ACCESS_LOCAL_WRITE;
use zerocopy::{FromBytes, IntoBytes};

/// What the user program does (`vhca.user=`); None: no user process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum UserSequence {
    #[default]
    None,
    /// Opens a context, allocates a PD, registers an MR over its own memory and exits without DEREG_MR: what the
    /// driver's CLEANUP must release (the seed's user-exit-with-mr-registered and -released).
    ExitWithMr,
}

impl UserSequence {
    pub fn parse(value: &str) -> Result<UserSequence, String> {
        match value {
            "exit-with-mr" => Ok(UserSequence::ExitWithMr),
            _ => Err(format!("not exit-with-mr: {value:?}")),
        }
    }

    /// The program for the loader's life to run (None: no user process).
    pub fn program(self) -> Option<UserProgram> {
        match self {
            UserSequence::None => None,
            UserSequence::ExitWithMr => Some(Box::new(exit_with_mr)),
        }
    }
}

/// Unaligned and over three pages, as a user buffer is: the MR starts 0x1a0 bytes into its first page.
const MR_BYTES: usize = 2 * 4096 + 300;
const MR_OFFSET: usize = 0x1a0;

fn exit_with_mr(process: &mut UserProcess) -> Result<(), String> {
    let file = process.open_interface().map_err(|s| format!("CreateFile on the interface: {:#010x}", s as u32))?;
    let open = OpenContextIn { abi_version: USER_ABI_VERSION.into(), reserved: 0.into() };
    let _: OpenContextOut = call(process, file, "OPEN_CONTEXT", IOCTL_VHCA_OPEN_CONTEXT, open.as_bytes())?;
    let pd: HandleOut = call(process, file, "ALLOC_PD", IOCTL_VHCA_ALLOC_PD, &[])?;
    let addr = process.allocate(MR_BYTES, MR_OFFSET).ok_or("no user memory for the MR")?;
    let reg = RegMrIn {
        addr: (addr as u64).into(),
        length: (MR_BYTES as u32).into(),
        pd: pd.handle,
        access: ACCESS_LOCAL_WRITE.into(),
        reserved: 0.into(),
    };
    let mr: RegMrOut = call(process, file, "REG_MR", IOCTL_VHCA_REG_MR, reg.as_bytes())?;
    if mr.addr.get() != addr as u64 || mr.length.get() as usize != MR_BYTES {
        return Err(format!("REG_MR answered {mr:?} for {addr:#x}+{MR_BYTES:#x}"));
    }
    // The process exits here with the MR registered: its handle's CLEANUP is the driver's to release it.
    Ok(())
}

/// One METHOD_BUFFERED IOCTL that must succeed with exactly a `T` back.
fn call<T: FromBytes + IntoBytes + Default>(
    process: &UserProcess,
    file: usize,
    name: &str,
    code: u32,
    input: &[u8],
) -> Result<T, String> {
    let mut out = T::default();
    let reply = process.device_control(file, code, input, out.as_mut_bytes());
    if reply.status < 0 {
        return Err(format!("{name}: status {:#010x}", reply.status as u32));
    }
    T::read_from_bytes(&reply.output).map_err(|_| format!("{name}: {} bytes back", reply.output.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_is_named_or_refused() {
        assert_eq!(UserSequence::parse("exit-with-mr"), Ok(UserSequence::ExitWithMr));
        assert!(UserSequence::parse("exit").is_err());
        assert!(UserSequence::None.program().is_none());
        assert!(UserSequence::ExitWithMr.program().is_some());
    }
}
