//! The generated `autounattend.xml`: Windows Setup reads it from the root of any removable drive and installs with no
//! questions. Written against Microsoft's "Unattended Windows Setup Reference" (components Microsoft-Windows-Setup,
//! -International-Core-WinPE, -International-Core, -Shell-Setup; passes windowsPE, specialize, oobeSystem). It has
//! never been fed to Windows Setup here: these machines have no Windows ISO. Serialised by quick-xml (escaping).

use std::io::Cursor;

use quick_xml::events::{BytesDecl, BytesEnd, BytesStart, BytesText, Event};
use quick_xml::Writer;

use super::machine::Firmware;

const UNATTEND_NS: &str = "urn:schemas-microsoft-com:unattend";
const WCM_NS: &str = "http://schemas.microsoft.com/WMIConfig/2002/State";

/// What the user chooses about the installed system.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnswerSettings {
    /// The install.wim image to install, by its `/IMAGE/NAME` (`Windows 11 Pro`, `Windows Server 2022 SERVERDATACENTER`).
    pub edition: String,
    /// Locale for UI, input, system and user (`en-US`).
    pub locale: String,
    /// A product key, when the edition needs one to install unattended (evaluation media do not).
    pub product_key: Option<String>,
    pub computer_name: String,
    /// The local administrator that logs on once to run the set-up.
    pub account: String,
    pub password: String,
    /// UEFI: GPT with EFI, MSR and Windows partitions. BIOS: one active MBR partition.
    pub firmware: Firmware,
    /// Run in order at the first logon (`FirstLogonCommands`).
    pub first_logon: Vec<FirstLogonCommand>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirstLogonCommand {
    pub command_line: String,
    pub description: String,
}

/// A small element tree, so the document's shape reads as the reference describes it.
struct Node {
    name: &'static str,
    attrs: Vec<(&'static str, String)>,
    body: Body,
}

enum Body {
    Text(String),
    Children(Vec<Node>),
}

fn el(name: &'static str, children: Vec<Node>) -> Node {
    Node { name, attrs: Vec::new(), body: Body::Children(children) }
}

fn text(name: &'static str, value: impl Into<String>) -> Node {
    Node { name, attrs: Vec::new(), body: Body::Text(value.into()) }
}

/// A list entry Windows Setup adds (`wcm:action="add"`).
fn added(name: &'static str, children: Vec<Node>) -> Node {
    Node { name, attrs: vec![("wcm:action", "add".into())], body: Body::Children(children) }
}

fn component(name: &str, children: Vec<Node>) -> Node {
    Node {
        name: "component",
        attrs: vec![
            ("name", name.to_string()),
            ("processorArchitecture", "amd64".into()),
            ("publicKeyToken", "31bf3856ad364e35".into()),
            ("language", "neutral".into()),
            ("versionScope", "nonSxS".into()),
        ],
        body: Body::Children(children),
    }
}

fn pass(name: &str, components: Vec<Node>) -> Node {
    Node { name: "settings", attrs: vec![("pass", name.to_string())], body: Body::Children(components) }
}

fn partition(order: u32, kind: &str, size_mb: Option<u32>) -> Node {
    let mut c = vec![text("Order", order.to_string()), text("Type", kind)];
    match size_mb {
        Some(mb) => c.push(text("Size", mb.to_string())),
        None => c.push(text("Extend", "true")),
    }
    added("CreatePartition", c)
}

fn modify(order: u32, id: u32, format: Option<&str>, label: Option<&str>, active: bool) -> Node {
    let mut c = vec![text("Order", order.to_string()), text("PartitionID", id.to_string())];
    if let Some(f) = format {
        c.push(text("Format", f));
    }
    if let Some(l) = label {
        c.push(text("Label", l));
    }
    if active {
        c.push(text("Active", "true"));
    }
    added("ModifyPartition", c)
}

impl AnswerSettings {
    /// The partition Windows goes to: 3 after EFI and MSR on GPT, 1 on MBR.
    pub fn windows_partition(&self) -> u32 {
        match self.firmware {
            Firmware::Uefi => 3,
            Firmware::Bios => 1,
        }
    }

    fn disk(&self) -> Node {
        let (create, modify_list) = match self.firmware {
            Firmware::Uefi => (
                vec![partition(1, "EFI", Some(100)), partition(2, "MSR", Some(16)), partition(3, "Primary", None)],
                vec![
                    modify(1, 1, Some("FAT32"), Some("System"), false),
                    modify(2, 2, None, None, false),
                    modify(3, 3, Some("NTFS"), Some("Windows"), false),
                ],
            ),
            Firmware::Bios => {
                (vec![partition(1, "Primary", None)], vec![modify(1, 1, Some("NTFS"), Some("Windows"), true)])
            }
        };
        el(
            "DiskConfiguration",
            vec![added(
                "Disk",
                vec![
                    text("DiskID", "0"),
                    text("WillWipeDisk", "true"),
                    el("CreatePartitions", create),
                    el("ModifyPartitions", modify_list),
                ],
            )],
        )
    }

    fn windows_pe(&self) -> Node {
        let mut user_data = vec![text("AcceptEula", "true"), text("FullName", &self.account)];
        if let Some(key) = &self.product_key {
            user_data.push(el("ProductKey", vec![text("Key", key), text("WillShowUI", "OnError")]));
        }
        // Windows 11 Setup refuses machines without TPM 2.0 and Secure Boot; the image needs Secure Boot off for test
        // signing anyway. Setup's own LabConfig values skip those checks (Windows 10 and Server ignore them).
        let lab_config = ["BypassTPMCheck", "BypassSecureBootCheck", "BypassRAMCheck"]
            .iter()
            .enumerate()
            .map(|(i, v)| {
                added(
                    "RunSynchronousCommand",
                    vec![
                        text("Order", (i + 1).to_string()),
                        text("Path", format!(r"reg add HKLM\SYSTEM\Setup\LabConfig /v {v} /t REG_DWORD /d 1 /f")),
                    ],
                )
            })
            .collect();
        pass(
            "windowsPE",
            vec![
                component(
                    "Microsoft-Windows-International-Core-WinPE",
                    vec![
                        el("SetupUILanguage", vec![text("UILanguage", &self.locale)]),
                        text("InputLocale", &self.locale),
                        text("SystemLocale", &self.locale),
                        text("UILanguage", &self.locale),
                        text("UserLocale", &self.locale),
                    ],
                ),
                component(
                    "Microsoft-Windows-Setup",
                    vec![
                        self.disk(),
                        el(
                            "ImageInstall",
                            vec![el(
                                "OSImage",
                                vec![
                                    el(
                                        "InstallFrom",
                                        vec![el(
                                            "MetaData",
                                            vec![text("Key", "/IMAGE/NAME"), text("Value", &self.edition)],
                                        )
                                        .with_action()],
                                    ),
                                    el(
                                        "InstallTo",
                                        vec![
                                            text("DiskID", "0"),
                                            text("PartitionID", self.windows_partition().to_string()),
                                        ],
                                    ),
                                ],
                            )],
                        ),
                        el("UserData", user_data),
                        el("RunSynchronous", lab_config),
                    ],
                ),
            ],
        )
    }

    fn specialize(&self) -> Node {
        pass(
            "specialize",
            vec![component(
                "Microsoft-Windows-Shell-Setup",
                vec![text("ComputerName", &self.computer_name), text("TimeZone", "UTC")],
            )],
        )
    }

    fn oobe(&self) -> Node {
        let password = || el("Password", vec![text("Value", &self.password), text("PlainText", "true")]);
        let commands = self
            .first_logon
            .iter()
            .enumerate()
            .map(|(i, c)| {
                added(
                    "SynchronousCommand",
                    vec![
                        text("Order", (i + 1).to_string()),
                        text("CommandLine", &c.command_line),
                        text("Description", &c.description),
                    ],
                )
            })
            .collect();
        pass(
            "oobeSystem",
            vec![
                component(
                    "Microsoft-Windows-International-Core",
                    vec![
                        text("InputLocale", &self.locale),
                        text("SystemLocale", &self.locale),
                        text("UILanguage", &self.locale),
                        text("UserLocale", &self.locale),
                    ],
                ),
                component(
                    "Microsoft-Windows-Shell-Setup",
                    vec![
                        el(
                            "OOBE",
                            vec![
                                text("HideEULAPage", "true"),
                                text("HideOEMRegistrationScreen", "true"),
                                text("HideOnlineAccountScreens", "true"),
                                text("HideWirelessSetupInOOBE", "true"),
                                text("ProtectYourPC", "3"),
                            ],
                        ),
                        el(
                            "UserAccounts",
                            vec![el(
                                "LocalAccounts",
                                vec![added(
                                    "LocalAccount",
                                    vec![password(), text("Group", "Administrators"), text("Name", &self.account)],
                                )],
                            )],
                        ),
                        el(
                            "AutoLogon",
                            vec![
                                password(),
                                text("Enabled", "true"),
                                text("LogonCount", "1"),
                                text("Username", &self.account),
                            ],
                        ),
                        el("FirstLogonCommands", commands),
                    ],
                ),
            ],
        )
    }

    /// The whole document, UTF-8 with its declaration.
    pub fn to_xml(&self) -> String {
        let root = Node {
            name: "unattend",
            attrs: vec![("xmlns", UNATTEND_NS.into()), ("xmlns:wcm", WCM_NS.into())],
            body: Body::Children(vec![self.windows_pe(), self.specialize(), self.oobe()]),
        };
        let mut w = Writer::new_with_indent(Cursor::new(Vec::new()), b' ', 2);
        // Writing to memory cannot fail; a failure would be a quick-xml bug, and shows as a truncated document.
        let _ = w.write_event(Event::Decl(BytesDecl::new("1.0", Some("utf-8"), None)));
        write_node(&mut w, &root);
        let mut xml = String::from_utf8(w.into_inner().into_inner()).unwrap_or_default();
        xml.push('\n');
        xml
    }
}

impl Node {
    /// MetaData is a list entry too.
    fn with_action(mut self) -> Node {
        self.attrs.push(("wcm:action", "add".into()));
        self
    }
}

fn write_node(w: &mut Writer<Cursor<Vec<u8>>>, n: &Node) {
    let mut start = BytesStart::new(n.name);
    for (k, v) in &n.attrs {
        start.push_attribute((*k, v.as_str()));
    }
    let _ = w.write_event(Event::Start(start));
    match &n.body {
        Body::Text(t) => {
            let _ = w.write_event(Event::Text(BytesText::new(t)));
        }
        Body::Children(children) => children.iter().for_each(|c| write_node(w, c)),
    }
    let _ = w.write_event(Event::End(BytesEnd::new(n.name)));
}
