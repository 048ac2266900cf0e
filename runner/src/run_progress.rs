//! What a run reports while it goes (its stages, its console, notices for a person); the UI decides what to show.
//! Every step of a run reports through this one type, so the suite, the soak and the UI take it from here.

/// What a run reports while it goes; the UI decides what to show.
#[derive(Debug, Clone)]
pub enum Progress {
    Stage {
        run: String,
        what: String,
    },
    Serial {
        run: String,
        line: String,
    },
    /// Something a person should see even in a quiet suite (a snapshot that could not serve).
    Notice {
        run: String,
        what: String,
    },
}
