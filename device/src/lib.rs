//! vhca-device: the emulated HCA and the vhost-user transport that connects it to QEMU.
