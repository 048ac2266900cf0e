//! One declaration per wire enum: the values, the list of all of them, decoding from the wire and the name used in
//! event logs, suites and reports, so the three can never disagree.

/// Declares a `#[repr(u32)]` enum whose variants each carry their wire value and their display name, with
/// `ALL`, `from_u32` and `name`.
macro_rules! wire_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $value:literal => $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum $name {
            $( $(#[$vmeta])* $variant = $value, )+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// Decodes a wire value; `None` for values this ABI does not define.
            pub fn from_u32(v: u32) -> Option<$name> {
                match v {
                    $( $value => Some($name::$variant), )+
                    _ => None,
                }
            }

            /// The name used in event logs, suite files and reports.
            pub fn name(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }
        }
    };
}
