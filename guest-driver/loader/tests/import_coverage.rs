//! Every routine vhca.sys may import (guest-driver/sys/imports.txt, kept by issue 12's package check) is either
//! bound to a thunk or on the short list of routines the model does not implement for a driver binary yet
//! (docs/loader.md says why). A new import fails here until it is bound or listed.

use vhca_loader::nt_thunks::NtThunks;
use vhca_loader::ImportResolver;

/// Not bound yet (none today; docs/loader.md keeps the list).
const NOT_BOUND_YET: [&str; 0] = [];

#[test]
fn every_import_vhca_sys_may_have_is_bound_or_listed() {
    let list = include_str!("../../sys/imports.txt");
    let mut bound = 0;
    for line in list.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (module, name) = line.split_once(' ').expect("module routine");
        match (NtThunks.resolve(module, name), NOT_BOUND_YET.contains(&name)) {
            (Some(_), false) => bound += 1,
            (None, true) => {}
            (Some(_), true) => panic!("{module}!{name} is bound now: take it off NOT_BOUND_YET"),
            (None, false) => panic!("{module}!{name} is neither bound nor listed as not bound yet"),
        }
    }
    assert_eq!(bound, 96, "imports.txt changed: update docs/loader.md's import table");
}
