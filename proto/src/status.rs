//! Command statuses (device → driver, in every response header). Stable numbers: they appear in event logs and suites.

wire_enum! {
    /// A command's outcome. `Ok` is 0 so a zeroed response is never mistaken for a failure with a cause.
    pub enum Status {
        Ok = 0 => "OK",
        /// The opcode is not one the device knows.
        UnknownOpcode = 1 => "UNKNOWN_OPCODE",
        /// The request or response buffer is shorter than the command needs.
        BadLength = 2 => "BAD_LENGTH",
        /// A field has a value outside its range (zero entries, bad access flags, ...).
        InvalidParam = 3 => "INVALID_PARAM",
        /// A handle (PD, CQ, QP, MR key) names nothing live.
        InvalidHandle = 4 => "INVALID_HANDLE",
        /// The object is in a state that forbids the command (QP transition not allowed, CQ still in use, ...).
        InvalidState = 5 => "INVALID_STATE",
        /// Device object tables are full.
        NoResources = 6 => "NO_RESOURCES",
        /// The map-register pool cannot cover the pages asked for.
        MapRegistersExhausted = 7 => "MAP_REGISTERS_EXHAUSTED",
        /// The device could not DMA the command's own data (page list, ring) through the IOMMU.
        IommuFault = 8 => "IOMMU_FAULT",
        /// Fault injection failed this command on purpose.
        Injected = 9 => "INJECTED",
    }
}

wire_enum! {
    /// Work completion statuses, after ibverbs' `ibv_wc_status` (same meaning, vhca's own numbering).
    pub enum WcStatus {
        Success = 0 => "SUCCESS",
        /// Local length error: a RECV buffer too small for the SEND.
        LocLenErr = 1 => "LOC_LEN_ERR",
        /// Local QP operation error (malformed WQE).
        LocQpOpErr = 2 => "LOC_QP_OP_ERR",
        /// Local protection error: an SGE outside its MR, or a bad lkey.
        LocProtErr = 4 => "LOC_PROT_ERR",
        /// The QP left RTS; outstanding work requests are flushed with this.
        WrFlushErr = 5 => "WR_FLUSH_ERR",
        /// Local access error: an MR without the right the operation needs, or an IOMMU refusal.
        LocAccessErr = 8 => "LOC_ACCESS_ERR",
        /// Remote access error: bad rkey, range outside the remote MR, or missing remote right.
        RemAccessErr = 10 => "REM_ACCESS_ERR",
        /// Receiver had no RECV posted.
        RnrRetryExcErr = 13 => "RNR_RETRY_EXC_ERR",
        /// Fatal device-side error.
        FatalErr = 16 => "FATAL_ERR",
    }
}
