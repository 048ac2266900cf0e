//! Which NT model object stands behind a kernel object the driver keeps in its own memory (a KDPC, KTIMER or KEVENT
//! in its device extension), by the object's address there: the table each such family's thunks fill.

use std::collections::HashMap;
use std::sync::Mutex;

/// The model's objects of one kind, by driver object address.
pub struct ObjectTable<H> {
    by_address: Mutex<HashMap<usize, H>>,
}

impl<H> Default for ObjectTable<H> {
    fn default() -> Self {
        ObjectTable { by_address: Mutex::new(HashMap::new()) }
    }
}

impl<H: Copy> ObjectTable<H> {
    /// Binds `address` to `object`. A driver that initializes an object again at the same address (a KDPC
    /// re-initialized in START_DEVICE after a stop) gets the new model object, as Windows rewrites the structure.
    pub fn bind(&self, address: usize, object: H) {
        crate::lock(&self.by_address).insert(address, object);
    }

    pub fn get(&self, address: usize) -> Option<H> {
        crate::lock(&self.by_address).get(&address).copied()
    }

    /// The model object bound to `address`, or else `address` itself made a model handle by `as_handle`: an object
    /// the driver never initialized reaches the model as an address it does not know, which gives the verdict the
    /// native build gets for it; NULL stays NULL.
    pub fn model_of(&self, address: usize, as_handle: impl FnOnce(u64) -> H) -> H {
        self.get(address).unwrap_or_else(|| as_handle(address as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_initialization_at_one_address_replaces_the_first() {
        let table = ObjectTable::default();
        assert_eq!(table.get(0x1000), None);
        table.bind(0x1000, 7u64);
        table.bind(0x2000, 8u64);
        table.bind(0x1000, 9u64);
        assert_eq!((table.get(0x1000), table.get(0x2000)), (Some(9), Some(8)));
        assert_eq!((table.model_of(0x2000, |a| a), table.model_of(0x3000, |a| a)), (8, 0x3000));
    }
}
