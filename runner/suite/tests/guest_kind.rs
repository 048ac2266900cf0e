//! `guest = "windows"` and `windows_image` in a suite file: parsed, defaulted to Linux, and refused when wrong.

use vhca_suite::{GuestKind, Suite};

const RUN: &str = "[[run]]\nname = \"smoke\"\nexpect = \"pass\"\n";

#[test]
fn a_suite_without_guest_is_linux_and_the_seed_suite_too() {
    let s = Suite::parse(&format!("name = \"s\"\n{RUN}"), "s.toml").unwrap();
    assert_eq!((s.guest, s.windows_image), (GuestKind::Linux, None));
    assert_eq!(Suite::seed().unwrap().guest, GuestKind::Linux);
}

#[test]
fn windows_suite_with_and_without_an_image() {
    let s = Suite::parse(&format!("name = \"w\"\nguest = \"windows\"\n{RUN}"), "w.toml").unwrap();
    assert_eq!((s.guest, s.windows_image.as_deref()), (GuestKind::Windows, None));
    let text = format!("name = \"w\"\nguest = \"windows\"\nwindows_image = \"img/win11\"\n{RUN}");
    let s = Suite::parse(&text, "w.toml").unwrap();
    assert_eq!(s.windows_image.as_deref(), Some("img/win11"));
    assert_eq!(s.guest.as_str(), "windows");
}

#[test]
fn unknown_guest_and_misplaced_image_are_refused_with_their_place() {
    let err = Suite::parse(&format!("name = \"w\"\nguest = \"macos\"\n{RUN}"), "w.toml").unwrap_err();
    let p = &err.problems[0];
    assert_eq!((p.line, p.field.as_str()), (2, "guest"));
    assert!(p.message.contains("\"linux\" or \"windows\""), "{}", p.message);
    let err = Suite::parse(&format!("name = \"l\"\nwindows_image = \"x\"\n{RUN}"), "l.toml").unwrap_err();
    assert_eq!((err.problems[0].line, err.problems[0].field.as_str()), (2, "windows_image"));
    let err = Suite::parse(&format!("name = \"w\"\nguest = \"windows\"\nwindows_image = \" \"\n{RUN}"), "w.toml")
        .unwrap_err();
    assert!(err.problems[0].message.contains("empty"));
}
