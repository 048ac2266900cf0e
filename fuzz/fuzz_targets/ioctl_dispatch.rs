//! libFuzzer entry for `vhca_fuzz::ioctl_dispatch` (the harness lives in the library so the stable replay test runs it too).
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| vhca_fuzz::ioctl_dispatch::run(data));
