//! Windows guests: the image recipe (answer file, in-guest set-up, KDNET, boot states), the Windows QEMU machine and
//! the image directory the runner boots. Built and unit-tested here on what it generates; NEVER RUN against Windows
//! on the machines this project is developed on (no Windows ISO, no licence). docs/windows.md says what was verified
//! where.

pub mod agent_script;
pub mod answer_file;
pub mod guest_setup;
pub mod image_dir;
pub mod kdnet;
pub mod machine;
pub mod recipe;
pub mod run_boot;
