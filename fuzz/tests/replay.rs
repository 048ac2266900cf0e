//! The stable test command's share of the fuzzing: every committed seed (corpus/TARGET/seed-*) and every crash the
//! fuzzer ever found (regressions/TARGET/*) replays through its harness, and the seed files are the ones
//! `seeds::all` builds. Runs without libFuzzer: `cargo test --no-default-features --test replay`.

use std::path::{Path, PathBuf};

use vhca_fuzz::{seeds, TARGETS};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut files: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_file()).collect();
    files.sort();
    files
}

#[test]
fn committed_seeds_are_the_generated_ones() {
    for (target, name, bytes) in seeds::all() {
        let path = root().join("corpus").join(target).join(format!("seed-{name}"));
        let on_disk =
            std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e} (run the write_seeds test)", path.display()));
        assert!(on_disk == bytes, "{} differs from seeds::all(); run the write_seeds test", path.display());
    }
}

#[test]
fn seeds_and_regressions_replay_clean() {
    for (target, run) in TARGETS {
        let seeds: Vec<PathBuf> =
            files(&root().join("corpus").join(target)).into_iter().filter(|p| is_seed(p)).collect();
        assert!(!seeds.is_empty(), "{target}: no committed seed");
        for path in seeds.iter().chain(&files(&root().join("regressions").join(target))) {
            let data = std::fs::read(path).unwrap();
            let caught = std::panic::catch_unwind(|| run(&data));
            assert!(caught.is_ok(), "{target}: {} fails its harness", path.display());
        }
    }
}

fn is_seed(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("seed-"))
}

/// Writes corpus/TARGET/seed-NAME from `seeds::all()`: `cargo test --no-default-features --test replay -- --ignored`.
#[test]
#[ignore]
fn write_seeds() {
    for (target, name, bytes) in seeds::all() {
        let dir = root().join("corpus").join(target);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
    }
}

/// The seeds are worth mutating from: the HCA seed completes an RDMA WRITE and meets a stale translation, and the
/// vhost-user seeds get a chain through the worker with and without a miss.
#[test]
fn seeds_reach_deep_states() {
    use vhca_hca::HcaEvent;
    let seed = |target: &str, name: &str| {
        seeds::all().into_iter().find(|(t, n, _)| *t == target && *n == name).map(|(_, _, b)| b).unwrap()
    };
    let events = vhca_fuzz::hca_commands::trace(&seed("hca_commands", "loopback-rdma-write"));
    let completions = events.iter().filter(|e| matches!(e, HcaEvent::Completion { .. })).count();
    assert!(completions >= 1, "no completion: {events:?}");
    assert!(events.iter().any(|e| matches!(e, HcaEvent::TranslationsStale { .. })), "{events:?}");
    for (name, wanted) in [
        ("iommu-mapped-query", &["iotlb_update", "desc"][..]),
        ("iommu-miss-then-update", &["iotlb_miss", "iotlb_update", "desc"]),
        ("no-iommu", &["desc"]),
    ] {
        let kinds = vhca_fuzz::vhost_user_connection::trace(&seed("vhost_user_connection", name));
        for kind in wanted {
            assert!(kinds.iter().any(|k| k == kind), "{name}: no {kind} in {kinds:?}");
        }
    }
}
