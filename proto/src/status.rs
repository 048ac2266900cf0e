//! Command statuses (device → driver, in every response header). Stable numbers: they appear in event logs and suites.

/// A command's outcome. `Ok` is 0 so a zeroed response is never mistaken for a failure with a cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Status {
    Ok = 0,
    /// The opcode is not one the device knows.
    UnknownOpcode = 1,
    /// The request or response buffer is shorter than the command needs.
    BadLength = 2,
    /// A field has a value outside its range (zero entries, bad access flags, ...).
    InvalidParam = 3,
    /// A handle (PD, CQ, QP, MR key) names nothing live.
    InvalidHandle = 4,
    /// The object is in a state that forbids the command (QP transition not allowed, CQ still in use, ...).
    InvalidState = 5,
    /// Device object tables are full.
    NoResources = 6,
    /// The map-register pool cannot cover the pages asked for.
    MapRegistersExhausted = 7,
    /// The device could not DMA the command's own data (page list, ring) through the IOMMU.
    IommuFault = 8,
    /// Fault injection failed this command on purpose.
    Injected = 9,
}

impl Status {
    pub const ALL: [Status; 10] = [
        Status::Ok,
        Status::UnknownOpcode,
        Status::BadLength,
        Status::InvalidParam,
        Status::InvalidHandle,
        Status::InvalidState,
        Status::NoResources,
        Status::MapRegistersExhausted,
        Status::IommuFault,
        Status::Injected,
    ];

    pub fn from_u32(v: u32) -> Option<Status> {
        Status::ALL.iter().copied().find(|s| *s as u32 == v)
    }

    /// The name used in event logs, suite files and reports.
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "OK",
            Status::UnknownOpcode => "UNKNOWN_OPCODE",
            Status::BadLength => "BAD_LENGTH",
            Status::InvalidParam => "INVALID_PARAM",
            Status::InvalidHandle => "INVALID_HANDLE",
            Status::InvalidState => "INVALID_STATE",
            Status::NoResources => "NO_RESOURCES",
            Status::MapRegistersExhausted => "MAP_REGISTERS_EXHAUSTED",
            Status::IommuFault => "IOMMU_FAULT",
            Status::Injected => "INJECTED",
        }
    }
}

/// Work completion statuses, after ibverbs' `ibv_wc_status` (same meaning, vhca's own numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum WcStatus {
    Success = 0,
    /// Local length error: a RECV buffer too small for the SEND.
    LocLenErr = 1,
    /// Local QP operation error (malformed WQE).
    LocQpOpErr = 2,
    /// Local protection error: an SGE outside its MR, or a bad lkey.
    LocProtErr = 4,
    /// The QP left RTS; outstanding work requests are flushed with this.
    WrFlushErr = 5,
    /// Local access error: an MR without the right the operation needs, or an IOMMU refusal.
    LocAccessErr = 8,
    /// Remote access error: bad rkey, range outside the remote MR, or missing remote right.
    RemAccessErr = 10,
    /// Receiver had no RECV posted.
    RnrRetryExcErr = 13,
    /// Fatal device-side error.
    FatalErr = 16,
}

impl WcStatus {
    pub const ALL: [WcStatus; 9] = [
        WcStatus::Success,
        WcStatus::LocLenErr,
        WcStatus::LocQpOpErr,
        WcStatus::LocProtErr,
        WcStatus::WrFlushErr,
        WcStatus::LocAccessErr,
        WcStatus::RemAccessErr,
        WcStatus::RnrRetryExcErr,
        WcStatus::FatalErr,
    ];

    pub fn from_u32(v: u32) -> Option<WcStatus> {
        WcStatus::ALL.iter().copied().find(|s| *s as u32 == v)
    }

    pub fn name(self) -> &'static str {
        match self {
            WcStatus::Success => "SUCCESS",
            WcStatus::LocLenErr => "LOC_LEN_ERR",
            WcStatus::LocQpOpErr => "LOC_QP_OP_ERR",
            WcStatus::LocProtErr => "LOC_PROT_ERR",
            WcStatus::WrFlushErr => "WR_FLUSH_ERR",
            WcStatus::LocAccessErr => "LOC_ACCESS_ERR",
            WcStatus::RemAccessErr => "REM_ACCESS_ERR",
            WcStatus::RnrRetryExcErr => "RNR_RETRY_EXC_ERR",
            WcStatus::FatalErr => "FATAL_ERR",
        }
    }
}
